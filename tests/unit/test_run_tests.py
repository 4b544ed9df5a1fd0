"""The default run's steps (``scripts/run_tests.py``): the phases of one step run at once,
each one's exit code is kept in the order of the step, and the output of a phase run
beside the terminal's comes whole, after the step, never interleaved with it."""

from __future__ import annotations

import ast
import importlib.util
import os
import signal
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest

from tests.support.layers import LayerBook

REPO = Path(__file__).resolve().parents[2]


def _run_tests() -> ModuleType:
    spec = importlib.util.spec_from_file_location("run_tests", REPO / "scripts" / "run_tests.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("run_tests", module)
    spec.loader.exec_module(module)
    return module


def _test_file(root: Path, name: str, other: str, *, passes: bool) -> str:
    """A test that marks itself started, then waits (60 s at most) for the ``other`` one's
    mark: it passes the wait only if both run at once."""
    path = root / f"test_{name}.py"
    path.write_text(
        "import pathlib, time\n\n\n"
        f"def test_{name}():\n"
        f"    pathlib.Path({str(root / name)!r}).touch()\n"
        f"    other = pathlib.Path({str(root / other)!r})\n"
        "    deadline = time.monotonic() + 60\n"
        "    while not other.exists() and time.monotonic() < deadline:\n"
        "        time.sleep(0.05)\n"
        "    assert other.exists(), 'the other phase never ran beside this one'\n"
        f"    assert {passes}\n")
    return str(path)


def test_a_step_runs_its_phases_at_once_and_keeps_each_exit_code(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    run_tests = _run_tests()
    tests, work = tmp_path / "tests", tmp_path / "work"
    tests.mkdir()
    work.mkdir()
    side = run_tests.Phase("side", (_test_file(tests, "side", "main", passes=True),))
    main = run_tests.Phase("main", (_test_file(tests, "main", "side", passes=False),))
    results = run_tests.run_step([(side,), (main,)], ["-q"], work)
    out = capfd.readouterr().out
    assert "AssertionError: the other phase" not in out, out
    assert [code for code, _, _ in results] == [0, 1]  # the step's order, not the ends'
    # the side phase's whole output follows the terminal phase's, with both exit lines
    assert out.index("1 failed") < out.index("=== output of phase side") < out.index("1 passed")
    assert "=== phase side: exit 0" in out and "=== phase main: exit 1" in out


def test_a_lane_runs_its_phases_one_after_another(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """The second phase of a lane starts once the first ended, beside the other lane;
    exit codes come in the step's order."""
    run_tests = _run_tests()
    tests, work = tmp_path / "tests", tmp_path / "work"
    tests.mkdir()
    work.mkdir()
    first = tests / "test_first.py"
    first.write_text("import pathlib, time\n\n\n"
                     "def test_first():\n"
                     f"    assert not pathlib.Path({str(tests / 'second')!r}).exists()\n"
                     "    time.sleep(1)\n"
                     f"    pathlib.Path({str(tests / 'first')!r}).touch()\n")
    second = tests / "test_second.py"
    second.write_text("import pathlib\n\n\n"
                      "def test_second():\n"
                      f"    assert pathlib.Path({str(tests / 'first')!r}).exists()\n"
                      f"    pathlib.Path({str(tests / 'second')!r}).touch()\n"
                      "    assert False\n")
    lane = (run_tests.Phase("first", (str(first),)), run_tests.Phase("second", (str(second),)))
    other = run_tests.Phase("other", (_test_file(tests, "other", "first", passes=True),))
    results = run_tests.run_step([lane, (other,)], ["-q"], work)
    out = capfd.readouterr().out
    assert [code for code, _, _ in results] == [0, 1, 0], out
    assert "=== phase first: exit 0" in out and "=== phase second: exit 1" in out


def test_an_interrupted_step_ends_the_phases_still_running(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run_tests = _run_tests()
    tests, work = tmp_path / "tests", tmp_path / "work"
    tests.mkdir()
    work.mkdir()
    pid_file = tmp_path / "side.pid"
    side_test = tests / "test_long.py"
    side_test.write_text(
        "import os, pathlib, time\n\n\n"
        "def test_long():\n"
        f"    pathlib.Path({str(pid_file)!r}).write_text(str(os.getpid()))\n"
        "    time.sleep(300)\n")
    side = run_tests.Phase("side", (str(side_test),))
    main = run_tests.Phase("main", (_test_file(tests, "main", "main", passes=True),))

    def interrupted() -> None:  # the runner's pause between polls, once both started
        if pid_file.exists():
            raise KeyboardInterrupt
        time.sleep(0.05)

    monkeypatch.setattr(run_tests, "pause", interrupted)
    # as in CI, where the run is a background job of a script: SIGINT ignored, inherited
    ignored = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with pytest.raises(KeyboardInterrupt):
            run_tests.run_step([(side,), (main,)], ["-q"], work)
    finally:
        signal.signal(signal.SIGINT, ignored)
    pid = int(pid_file.read_text())
    with pytest.raises(ProcessLookupError):  # ended and reaped, not left running
        os.kill(pid, 0)
    # ended by the interrupt (its teardown ran), not killed after the grace
    assert "KeyboardInterrupt" in (work / "side.log").read_text()


def test_the_default_run_puts_kafka_and_cluster_modules_beside_spark_then_chaos() -> None:
    run_tests = _run_tests()
    steps = run_tests.steps(2)
    lanes = [[tuple(phase.paths for phase in lane) for lane in step] for step in steps]
    after_kafka = run_tests.CLUSTER_AFTER_KAFKA
    assert lanes == [[(("tests/unit",),)], [(("tests/integration",),)],
                     [(("tests/kafka", "tests/kafka_cluster", *after_kafka),),
                      (("tests/spark",), ("tests/chaos",))],
                     [(("tests/cluster",),)]]
    assert "-n" in steps[0][0][0].options and "-n" in steps[1][0][0].options
    # every cluster module runs once: after the kafka layer or in the last step
    modules = {f"tests/cluster/{p.name}" for p in (REPO / "tests" / "cluster").glob("test_*.py")}
    ignored = {o.removeprefix("--ignore=") for o in steps[3][0][0].options}
    assert set(after_kafka) <= modules and ignored == set(after_kafka)
    assert modules - ignored, "the last step runs no cluster module"


def test_a_phase_runs_with_its_own_environment(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    run_tests = _run_tests()
    test = tmp_path / "test_env.py"
    test.write_text("import os\n\n\n"
                    "def test_env():\n"
                    "    assert os.environ['RAY_worker_niceness'] == '0'\n")
    phase = run_tests.Phase("env", (str(test),), env=(("RAY_worker_niceness", "0"),))
    assert [code for code, _, _ in run_tests.run_step([(phase,)], ["-q"], tmp_path)] == [0]
    assert "1 passed" in capfd.readouterr().out


def _check_tests() -> list[str]:
    """The node ids ``make check`` runs (the Makefile's ``CHECK_TESTS``)."""
    lines = (REPO / "Makefile").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("CHECK_TESTS :="))
    words: list[str] = []
    for line in lines[start:]:
        words += line.removeprefix("CHECK_TESTS :=").rstrip("\\").split()
        if not line.endswith("\\"):
            break
    return words


def test_make_check_names_tests_that_exist() -> None:
    """``make check`` once named a test renamed since, and pytest refused the whole run."""
    ids = _check_tests()
    assert len(ids) >= 3, ids
    for nodeid in ids:
        module, _, name = nodeid.partition("::")
        path = REPO / module
        assert path.is_file(), f"make check names {module}, which does not exist"
        tree = ast.parse(path.read_text())
        names = {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}
        assert name in names, f"make check names {nodeid}, not there"


def test_a_layer_run_in_two_processes_costs_the_sum_of_both(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The runner's table adds up a layer whose tests ran in two phases (a spark-layer test
    run in the kafka process, say), never keeping one phase's share only."""
    run_tests = _run_tests()
    spark, kafka = LayerBook(), LayerBook()
    spark.record("s::one", ["spark"], 200.0, 0.0, 200.0, 3)
    kafka.record("k::one", ["kafka"], 150.0, 0.0, 150.0, 2)
    kafka.record("s::two", ["spark"], 50.0, 150.0, 200.0, 0)
    results = []
    for phase, book in (("spark", spark), ("kafka", kafka)):
        book.save(tmp_path / f"{phase}.json")
        results.append((0, tmp_path / f"{phase}.json", tmp_path / f"{phase}-times.json"))
    run_tests.summary(results, 400.0)
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines() if line}
    assert lines["spark"].startswith("spark          250.0 s of   480 s")
    assert "   3 runtime starts" in lines["spark"]
    assert lines["kafka"].startswith("kafka          150.0 s of   480 s")
