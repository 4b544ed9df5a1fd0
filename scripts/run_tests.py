"""The default test run (``make test``): the layers in three phases, each one pytest process.

1. ``unit``: no Ray, one process. (Not beside the integration layer on its workers: some
   unit tests switch process-wide state, the fault hooks among them, that the integration
   tests of the same worker then miss.)
2. ``integration``: its modules spread over ``RAYSINK_TEST_WORKERS`` (default 2)
   pytest-xdist workers a module at a time (``--dist loadfile``: a module's shared runtime
   stays in one process), costliest first when their costs are stored
   (``tests.support.schedule``). Each worker has its own Ray, PostgreSQL and fault
   directory.
3. ``kafka``, ``spark``, ``chaos``, ``cluster``: one process. Each shares one costly
   start (a broker, a RayDP session, a multi-node Ray) across the layer, and they compute
   more than they wait: the spark layer on one worker beside kafka and chaos on another
   took 546 s against 553 s in one process, with the machine's 2 cores 1.86 busy.

Then one table of every layer's time against its budget (``tests.support.layers``), the
slowest tests of the whole run, and the total. Arguments go to every phase's pytest
(``make test PYTEST_ARGS='-m "not slow" -x'``); arguments that name tests (a path or a
``::`` node id) make it one plain pytest run over just those.
"""

from __future__ import annotations

import json
import os
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
    name: str
    paths: tuple[str, ...]
    options: tuple[str, ...] = ()


def phases(workers: int) -> list[Phase]:
    # with the modules' stored costs, the order of collection (costliest first, see
    # tests.support.schedule); without, pytest-xdist's (the most tests first)
    ordered = ("--no-loadscope-reorder",) if MODULE_SECONDS.exists() else ()
    parallel = ("-n", str(workers), "--dist", "loadfile", *ordered) if workers > 1 else ()
    return [Phase("unit", ("tests/unit",)),
            Phase("integration", ("tests/integration",), parallel),
            Phase("kafka, spark, chaos, cluster",
                  ("tests/kafka", "tests/spark", "tests/chaos", "tests/cluster"))]


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


def run_phase(phase: Phase, args: Sequence[str], work: Path) -> tuple[int, Path, Path]:
    """Run one phase; its exit code and the files its layer book and times went to."""
    stem = Path(phase.paths[0]).name
    layers, times = work / f"{stem}-layers.json", work / f"{stem}-times.json"
    env = {**os.environ, "RAYSINK_TEST_LAYERS": str(layers), "RAYSINK_TEST_TIMES": str(times)}
    command = pytest_command(*phase.paths, *phase.options, *args)
    print(f"\n=== phase: {phase.name} ({' '.join(command[3:])})", flush=True)
    started, busy = time.monotonic(), busy_seconds()
    code = subprocess.run(command, cwd=REPO, env=env, check=False).returncode
    seconds, busy_after = time.monotonic() - started, busy_seconds()
    cores = ("" if busy is None or busy_after is None else
             f", the machine's cores {(busy_after - busy) / seconds:.2f} busy on average")
    print(f"=== phase {phase.name}: exit {code} after {seconds:.0f} s{cores}", flush=True)
    return (0 if code == NO_TESTS else code), layers, times


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
        results = [run_phase(phase, args, Path(work)) for phase in phases(workers)]
        summary(results, time.monotonic() - started)
    failed = [code for code, _, _ in results if code]
    return failed[0] if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
