"""The default test run (``make test``): the layers in three steps of one or two pytest
processes (the two at once).

1. ``unit`` beside ``integration``. The unit layer (no Ray) in a process of its own: not on
   the integration layer's workers, since some unit tests switch process-wide state, the
   fault hooks among them, that the integration tests of the same worker then miss. The
   integration layer's modules spread over ``RAYSINK_TEST_WORKERS`` (default 2)
   pytest-xdist workers a module at a time (``--dist loadfile``: a module's shared runtime
   stays in one process), costliest first when their costs are stored
   (``tests.support.schedule``). Each worker has its own Ray, PostgreSQL and fault
   directory.
2. ``kafka`` then ``chaos`` beside ``spark``: two processes at once, each sharing its one
   costly start across its layers (a broker; a RayDP session). With the tests' JVMs on C1
   (``tests/conftest.py``) these layers wait more than they compute: in one process they
   kept the machine's 2 cores only 1.33 busy; the kafka and chaos layers together take
   about as long as the spark layer. Ray starts its workers at nice 15, the RayDP JVMs
   beside them run at 0: the first process's actors run at 0 too
   (``RAY_worker_niceness``), or the chaos sample, the layer with the least margin under
   its budget, waits on the JVMs (127-136 s of its 180 here, 114 s at equal priority,
   92 s alone). The side process's output is printed when the step ends.
3. ``cluster``: one process, alone (a multi-node Ray on this machine, with waits for Ray
   to declare lost nodes dead).

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
# Ray starts its workers at nice 15, below the JVMs of a RayDP session beside them (nice 0):
# the phase beside the spark layer runs its actors at the JVMs' priority
EQUAL_PRIORITY = ("RAY_worker_niceness", "0")


@dataclass(frozen=True)
class Phase:
    name: str
    paths: tuple[str, ...]
    options: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()  # set for its process, over the run's own


def steps(workers: int) -> list[list[Phase]]:
    """The phases in the order they run; the phases of one step run at once."""
    # with the modules' stored costs, the order of collection (costliest first, see
    # tests.support.schedule); without, pytest-xdist's (the most tests first)
    ordered = ("--no-loadscope-reorder",) if MODULE_SECONDS.exists() else ()
    parallel = ("-n", str(workers), "--dist", "loadfile", *ordered) if workers > 1 else ()
    return [[Phase("unit", ("tests/unit",)),
             Phase("integration", ("tests/integration",), parallel)],
            [Phase("kafka, chaos", ("tests/kafka", "tests/chaos"), env=(EQUAL_PRIORITY,)),
             Phase("spark", ("tests/spark",))],
            [Phase("cluster", ("tests/cluster",))]]


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
    process: subprocess.Popen[bytes]
    layers: Path
    times: Path
    output: Path | None
    started: float


def start_phase(phase: Phase, args: Sequence[str], work: Path, *, aside: bool) -> Started:
    """Start one phase's pytest; ``aside``: its output to a file (another phase of its step
    has the terminal)."""
    stem = Path(phase.paths[0]).name
    layers, times = work / f"{stem}-layers.json", work / f"{stem}-times.json"
    env = {**os.environ, **dict(phase.env), "RAYSINK_TEST_LAYERS": str(layers),
           "RAYSINK_TEST_TIMES": str(times)}
    command = pytest_command(*phase.paths, *phase.options, *args)
    where = " (its output when the step ends)" if aside else ""
    print(f"\n=== phase: {phase.name}{where} ({' '.join(command[3:])})", flush=True)
    if not aside:
        process = subprocess.Popen(command, cwd=REPO, env=env)
        return Started(phase, process, layers, times, None, time.monotonic())
    output = work / f"{stem}.log"
    with open(output, "wb") as sink:
        process = subprocess.Popen(command, cwd=REPO, env=env, stdout=sink,
                                   stderr=subprocess.STDOUT)
    return Started(phase, process, layers, times, output, time.monotonic())


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


def wait_all(running: Sequence[Started]) -> dict[int, tuple[int, float]]:
    """Each phase's exit code and seconds, by its index in ``running``, once all ended."""
    ended: dict[int, tuple[int, float]] = {}
    while len(ended) < len(running):
        for i, run in enumerate(running):
            code = run.process.poll() if i not in ended else None
            if code is not None:
                ended[i] = (code, time.monotonic() - run.started)
        time.sleep(0.2)
    return ended


def run_step(step: Sequence[Phase], args: Sequence[str], work: Path
             ) -> list[tuple[int, Path, Path]]:
    """Run a step's phases at once (the last one on the terminal); each one's exit code and
    the files its layer book and times went to."""
    busy, began = busy_seconds(), time.monotonic()
    running: list[Started] = []
    try:
        for i, phase in enumerate(step):
            running.append(start_phase(phase, args, work, aside=i < len(step) - 1))
        ended = wait_all(running)
    finally:
        stop(running)  # none left when all ended; on Ctrl-C or an error, the rest
    seconds, busy_after = time.monotonic() - began, busy_seconds()
    for i, run in enumerate(running):
        code, phase_seconds = ended[i]
        if run.output is not None:
            print(f"\n=== output of phase {run.phase.name}, run beside the others", flush=True)
            sys.stdout.write(run.output.read_text(errors="replace"))
        print(f"=== phase {run.phase.name}: exit {code} after {phase_seconds:.0f} s", flush=True)
    if busy is not None and busy_after is not None:
        print(f"=== the step's {seconds:.0f} s: the machine's cores "
              f"{(busy_after - busy) / seconds:.2f} busy on average", flush=True)
    return [(0 if ended[i][0] == NO_TESTS else ended[i][0], run.layers, run.times)
            for i, run in enumerate(running)]


def summary(results: list[tuple[int, Path, Path]], seconds: float) -> None:
    layers: dict[str, LayerCost] = {}
    tests: dict[str, dict[str, float]] = {}
    for _, layer_file, times_file in results:
        if layer_file.exists():
            layers.update(LayerBook.load(layer_file))
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
