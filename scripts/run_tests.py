"""The default test run (``make test``): the layers in four steps. A step is one or two
*lanes* run at once, a lane one or more pytest processes (*phases*) run one after another.

1. ``unit``: no Ray, alone, on as many pytest-xdist workers as the integration layer, a
   module at a time (23 s here against 40-44 s in one process). (Not on the integration
   layer's workers: some unit tests switch process-wide state, the fault hooks among
   them, that the integration tests of the same worker then miss; beside them, on this
   machine's 2 cores busy with them, it took 65 s of its 60.)
2. ``integration``: its modules spread over ``RAYSINK_TEST_WORKERS`` (default 2)
   pytest-xdist workers a module at a time (``--dist loadfile``: a module's shared runtime
   stays in one process), costliest first when their costs are stored
   (``tests.support.schedule``). Each worker has its own Ray, PostgreSQL and fault
   directory.
3. ``kafka`` then part of ``cluster`` beside ``spark`` then ``chaos``: the kafka layer
   shares one broker in its process, the spark layer one RayDP session in another; the
   chaos sample runs in a process of its own once the spark layer ended. The cluster
   layer's modules that need no Spark (``CLUSTER_AFTER_KAFKA``: nodes lost mid-epoch,
   placement, rescale) follow the kafka layer in its process, using its broker: that lane
   ended 140-240 s before the other in three clean-clone runs at 016af61. Measured over
   four clean-clone runs at fde6eef, it moves time more than it saves: step 4 is 55 s
   shorter, step 3 about as much longer (the spark layer 351-383 s against 283-350,
   slowed beside the node-loss test), and the cluster layer costs 220-255 s of its 300
   against 185-204 (its Ray cluster starts in both processes). ``CLUSTER_AFTER_KAFKA =
   ()`` puts the layer back whole in step 4. The spark layer stays whole in its
   process: with one of its tests moved beside the kafka layer to even the lanes (the
   Kafka pipeline test, then the demo test), that test ran beside the spark process's
   JVMs and the layer took 398 and 421 s of its 480 in two clean-clone runs (bd451a0,
   fc4d6ac). With the tests' JVMs on C1 (``tests/conftest.py``) these layers wait more
   than they compute (in one process they kept the 2 cores only 1.33 busy). Chaos beside
   spark makes the step 85-90 s shorter on a quiet machine, but in three clean-clone runs
   the spark layer then took 365, 433 and 444 s of its 480 (281-347 s with chaos after
   it), and the chaos sample 122-149 s of its 180 (92 s alone), even with the chaos
   process's Ray workers at nice 0 (``Phase.env``: ``RAY_worker_niceness``), the RayDP
   JVMs' priority.
4. ``cluster``: the rest of the layer (a job submitted to a Ray head of its own, executor
   nodes lost under Spark), one process, alone: RayDP sessions on a multi-node Ray, with
   waits for Ray to declare lost nodes dead.

The output of a lane that does not have the terminal is printed when its step ends.
Then one table of every layer's time against its budget (``tests.support.layers``), the
slowest tests of the whole run, and the total. Arguments go to every phase's pytest
(``make test PYTEST_ARGS='-m "not slow" -x'``); arguments that name tests (a path or a
``::`` node id) make it one plain pytest run over just those.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.support.layers import LayerBook, LayerCost, table  # noqa: E402
from tests.support.schedule import MODULE_SECONDS, module_seconds  # noqa: E402

TIMES = REPO / "bench" / "out" / "test-times.json"
MODULES = REPO / "bench" / "out" / "module-seconds.json"
SLOWEST = 25
NO_TESTS = 5  # pytest's exit code when a phase's selection holds no test


@dataclass(frozen=True)
class Phase:
    """One pytest process."""

    name: str
    paths: tuple[str, ...]
    options: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()  # set for its process, over the run's own


Lane = tuple[Phase, ...]
"""Phases run one after another; the lanes of a step run at once."""


CLUSTER_AFTER_KAFKA = ("tests/cluster/test_node_loss.py", "tests/cluster/test_placement.py",
                       "tests/cluster/test_rescale.py")
"""The cluster layer's modules that need no Spark: in the kafka process, after its layer
(the node-loss test's broker is that layer's); the rest of the layer in step 4."""


KAFKA_CLUSTER_CASE = "tests/kafka_cluster"
"""The three-broker Kafka cluster's one case of the default run (the progress partition's
leader killed mid-commit; the module's other cases are marked ``kafka_cluster``, run by
``make kafka-cluster``): in the kafka process, after the single-broker tests."""


def steps(workers: int) -> list[list[Lane]]:
    """The steps in the order they run, each as its lanes."""
    spread = ("-n", str(workers), "--dist", "loadfile") if workers > 1 else ()
    # with the modules' stored costs, the order of collection (costliest first, see
    # tests.support.schedule); without, pytest-xdist's (the most tests first)
    parallel = (*spread, "--no-loadscope-reorder") if spread and MODULE_SECONDS.exists() \
        else spread
    alone = tuple(f"--ignore={path}" for path in CLUSTER_AFTER_KAFKA)
    return [[(Phase("unit", ("tests/unit",), spread),)],
            [(Phase("integration", ("tests/integration",), parallel),)],
            [(Phase("kafka, cluster", ("tests/kafka", KAFKA_CLUSTER_CASE,
                                        *CLUSTER_AFTER_KAFKA)),),
             (Phase("spark", ("tests/spark",)), Phase("chaos", ("tests/chaos",)))],
            [(Phase("cluster", ("tests/cluster",), alone),)]]


def names_tests(args: Sequence[str]) -> bool:
    """Whether ``args`` select tests by path or node id (then no phases)."""
    return any("::" in arg or (not arg.startswith("-") and (REPO / arg).exists())
               for arg in args)


def pytest_command(*args: str) -> list[str]:
    """One pytest process over ``args``: no cache directory left in the tree, the slowest
    tests listed at its end."""
    return [sys.executable, "-m", "pytest", *args, "-p", "no:cacheprovider",
            f"--durations={SLOWEST}"]


def busy_seconds() -> float | None:
    """CPU seconds the whole machine has been busy since boot (``/proc/stat``), or None."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return None
    ticks = [int(f) for f in fields]
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle and iowait
    return (sum(ticks[:8]) - idle) / os.sysconf("SC_CLK_TCK")


@dataclass
class Started:
    """A phase's pytest process, and where its output goes when it is not the terminal."""

    phase: Phase
    place: tuple[int, int]  # its lane in the step, its place in the lane
    process: subprocess.Popen[bytes]
    layers: Path
    times: Path
    output: Path | None
    started: float
    code: int | None = None
    seconds: float = 0.0

    def ended(self) -> bool:
        """Whether the process ended (its exit code and seconds noted then)."""
        if self.code is None and (code := self.process.poll()) is not None:
            self.code, self.seconds = code, time.monotonic() - self.started
        return self.code is not None


def start_phase(phase: Phase, place: tuple[int, int], args: Sequence[str], work: Path, *,
                aside: bool) -> Started:
    """Start one phase's pytest; ``aside``: its output to a file (a phase of another lane
    has the terminal)."""
    stem = phase.name.replace(", ", "-")
    layers, times = work / f"{stem}-layers.json", work / f"{stem}-times.json"
    env = {**os.environ, **dict(phase.env), "RAYSINK_TEST_LAYERS": str(layers),
           "RAYSINK_TEST_TIMES": str(times)}
    command = pytest_command(*phase.paths, *phase.options, *args)
    where = " (its output when the step ends)" if aside else ""
    print(f"\n=== phase: {phase.name}{where} ({' '.join(command[3:])})", flush=True)
    if not aside:
        process = subprocess.Popen(command, cwd=REPO, env=env, preexec_fn=_interruptible)
        return Started(phase, place, process, layers, times, None, time.monotonic())
    output = work / f"{stem}.log"
    with open(output, "wb") as sink:
        process = subprocess.Popen(command, cwd=REPO, env=env, stdout=sink,
                                   stderr=subprocess.STDOUT, preexec_fn=_interruptible)
    return Started(phase, place, process, layers, times, output, time.monotonic())


def _interruptible() -> None:
    """In a phase's process before pytest starts: SIGINT back to its default, so that
    Python turns it into ``KeyboardInterrupt`` (and pytest tears its fixtures down) even
    when this runner was started with SIGINT ignored, as a script's background job is."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def stop(running: Sequence[Started], grace: float = 30.0) -> None:
    """End the phases still running (the step was interrupted): each pytest gets an
    interrupt, as from Ctrl-C, so that its fixtures tear down what they started (brokers,
    PostgreSQL, Ray), and is killed if it has not ended ``grace`` seconds later."""
    alive = [run.process for run in running if run.process.poll() is None]
    for process in alive:
        process.send_signal(signal.SIGINT)
    deadline = time.monotonic() + grace
    for process in alive:
        try:
            process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def pause() -> None:
    time.sleep(0.2)


def run_lanes(step: Sequence[Lane], args: Sequence[str], work: Path) -> list[Started]:
    """Start each lane's first phase, and each next one as the one before it ends (the
    last lane on the terminal); every phase, once all ended, in the step's order. On an
    interrupt or an error the phases still running are ended (``stop``)."""
    waiting = [list(lane) for lane in step]
    running: dict[int, Started] = {}
    started: list[Started] = []
    try:
        while True:
            for lane, phases in enumerate(waiting):
                if lane in running and running[lane].ended():
                    del running[lane]
                if lane not in running and phases:
                    place = (lane, len(step[lane]) - len(phases))
                    running[lane] = start_phase(phases.pop(0), place, args, work,
                                                aside=lane < len(step) - 1)
                    started.append(running[lane])
            if not running:
                return sorted(started, key=lambda run: run.place)
            pause()
    finally:
        stop(started)  # none left when all ended; on Ctrl-C or an error, the rest


def run_step(step: Sequence[Lane], args: Sequence[str], work: Path
             ) -> list[tuple[int, Path, Path]]:
    """Run a step's lanes at once; each phase's exit code and the files its layer book
    and times went to, in the step's order."""
    busy, began = busy_seconds(), time.monotonic()
    ended = run_lanes(step, args, work)
    seconds, busy_after = time.monotonic() - began, busy_seconds()
    for run in ended:
        if run.output is not None:
            print(f"\n=== output of phase {run.phase.name}, run beside the others", flush=True)
            sys.stdout.write(run.output.read_text(errors="replace"))
    for run in ended:
        print(f"=== phase {run.phase.name}: exit {run.code} after {run.seconds:.0f} s",
              flush=True)
    if busy is not None and busy_after is not None:
        print(f"=== the step's {seconds:.0f} s: the machine's cores "
              f"{(busy_after - busy) / seconds:.2f} busy on average", flush=True)
    return [(0 if run.code == NO_TESTS else int(run.code or 0), run.layers, run.times)
            for run in ended]


def summary(results: list[tuple[int, Path, Path]], seconds: float) -> None:
    layers: dict[str, LayerCost] = {}
    tests: dict[str, dict[str, float]] = {}
    for _, layer_file, times_file in results:
        if layer_file.exists():
            for name, cost in LayerBook.load(layer_file).items():
                layers[name] = layers[name].merged(cost) if name in layers else cost
        if times_file.exists():
            tests.update(json.loads(times_file.read_text()))
    print("\n" + " time per test layer, all phases ".center(88, "-"))
    for line in table(layers):
        print(line)
    print(f"the whole run: {seconds:.0f} s ({seconds / 60:.1f} min)")
    if tests:
        TIMES.parent.mkdir(parents=True, exist_ok=True)
        TIMES.write_text(json.dumps(tests, indent=1, sort_keys=True) + "\n")
        print(f"each test's seconds and runtime starts: {TIMES}")
        modules = module_seconds(tests, "integration")
        if modules:
            MODULES.write_text(json.dumps(modules, indent=1) + "\n")
            print(f"each integration module's seconds (its workers' order): {MODULES}")
        print(f"the slowest {SLOWEST} tests of the run:")
        slowest = sorted(tests.items(), key=lambda kv: -kv[1]["seconds"])[:SLOWEST]
        for nodeid, test in slowest:
            print(f"{test['seconds']:8.1f} s  {nodeid}")


def main(args: Sequence[str]) -> int:
    if names_tests(args):
        return subprocess.run(pytest_command(*args), cwd=REPO, check=False).returncode
    workers = int(os.environ.get("RAYSINK_TEST_WORKERS", "2"))
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="raysink-test-run-") as work:
        results = [result for step in steps(workers)
                   for result in run_step(step, args, Path(work))]
        summary(results, time.monotonic() - started)
    failed = [code for code, _, _ in results if code]
    return failed[0] if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
