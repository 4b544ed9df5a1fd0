"""Shared fixtures: one local Ray per test session (per worker, when pytest-xdist runs
layers on parallel workers: ``scripts/run_tests.py`` does for the integration layer).

Layers (pytest markers) and their budgets in the default run (``tests.support.layers``):
unit (no Ray) 1 min, integration (real ray.init) 13 min, kafka (a real Kafka broker,
one per session) 5 min, spark (RayDP) 8 min, chaos sample 3 min, cluster (a multi-node Ray
on this machine) 5 min. ``tests/kafka_cluster/`` (a KRaft controller and three brokers)
is no layer: its cases are marked ``kafka_cluster`` (``make kafka-cluster``) and left out
of the default run, but for one counted in the kafka layer. Modules under
tests/<layer>/ get their layer's marker automatically. The cluster layer runs last: it
ends the session's single-node Ray before its own cluster starts.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.layers import LAYERS, LayerBook, table

# Spark's Python workers must run this interpreter; set before any Ray starts.
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
# Every JVM the tests start (Spark's driver, RayDP's app master and executors, the Kafka
# broker, the jobs of the cluster layer) compiles with C1 only and collects with one
# thread: the tests' JVMs live minutes and never reach the peak C2 would buy. A RayDP
# start and four 50,000-row writes took 59 CPU-s against 91 with the defaults
# (two runs each). Benchmarks keep the defaults (they do not load this file).
os.environ.setdefault("JAVA_TOOL_OPTIONS", "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC")
# Fault hooks work only in processes started with this set (raysink._faults reads it once,
# at import): a private directory of this test session, inherited by Ray and its actors.
# Each pytest-xdist worker has its own (its Ray and its faults are its own).
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["RAYSINK_FAULT_DIR"] = tempfile.mkdtemp(
        prefix=f"raysink-faults-{os.environ['PYTEST_XDIST_WORKER']}-")
os.environ.setdefault("RAYSINK_FAULT_DIR", tempfile.mkdtemp(prefix="raysink-faults-"))

# Hypothesis checks no per-example deadline: a timing is no pass/fail criterion on this
# shared machine (at load 38 the vnode properties overran the default 200 ms and failed).
try:
    from hypothesis import settings as _hypothesis_settings
except ImportError:  # pragma: no cover - hypothesis is a test dependency
    pass
else:
    _hypothesis_settings.register_profile("raysink", deadline=None)
    _hypothesis_settings.load_profile("raysink")

# Idle Ray workers started after each test for the next one (``_warm_workers``).
_WARM_WORKERS = int(os.environ.get("RAYSINK_TEST_WARM_WORKERS", "3"))
# The one-process layers only: the integration layer's two workers keep both cores busy,
# where a worker started ahead is CPU taken from the other's tests, and some are never used
# (a test without actors; Ray ends idle workers beyond its limit). Each module alone, in a
# cgroup (cpuacct), warm against not: test_hardening 90.4 against 82.8 CPU-s,
# test_sinks_bad_input 108.2 against 90.6. The chaos trials stay as they were.
_WARMED_LAYERS = ("kafka", "spark")

# What each layer cost (``tests.support.layers``): seconds, and runtimes started
# (``ActorSet.start`` in this process: a test's driver-side runtime starts, the suite's main
# cost besides Spark's), with each test's seconds and starts written to ``TIMES_FILE``
# (or ``RAYSINK_TEST_TIMES``) at the end of the session for whoever makes the suite faster.
# A worker of pytest-xdist counts its tests' starts and sends them in the test reports
# (``user_properties``); the process that prints the summary adds them up.
_BOOK = LayerBook()
_STARTS_NOW: dict[str, int] = {}  # runtime starts of the running test's current phase
_CURRENT: dict[str, str] = {}
TIMES_FILE = Path(os.environ.get("RAYSINK_TEST_TIMES") or
                  Path(__file__).resolve().parents[1] / "bench" / "out" / "test-times.json")


def _counting(start: Callable[..., None]) -> Callable[..., None]:
    def counted(self: Any, *args: Any, **kwargs: Any) -> None:
        test = _CURRENT.get("test")
        if test is not None:
            _STARTS_NOW[test] = _STARTS_NOW.get(test, 0) + 1
        start(self, *args, **kwargs)

    return counted


def pytest_configure(config: pytest.Config) -> None:
    from raysink.driver.lifecycle import ActorSet

    _BOOK.parallel = str(getattr(config.option, "dist", "no") or "no") != "no"
    if not getattr(ActorSet.start, "_counted", False):
        ActorSet.start = _counting(ActorSet.start)  # type: ignore[method-assign]
        ActorSet.start._counted = True  # type: ignore[attr-defined]


def pytest_runtest_logstart(nodeid: str, location: Any) -> None:
    _CURRENT["test"] = nodeid


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]
                              ) -> Iterator[None]:
    """The runtimes started in this phase of the test travel in its report."""
    outcome = yield
    starts = _STARTS_NOW.pop(item.nodeid, 0)
    if starts:
        outcome.get_result().user_properties.append(("runtime_starts", starts))  # type: ignore[attr-defined]


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    starts = sum(v for k, v in report.user_properties
                 if k == "runtime_starts" and isinstance(v, int))
    _BOOK.record(report.nodeid, report.keywords, report.duration, report.start,
                 report.stop, starts)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    terminalreporter.write_sep("-", "time per test layer")
    for line in table(_BOOK.layers):
        terminalreporter.write_line(line)
    if os.environ.get("RAYSINK_TEST_LAYERS"):
        _BOOK.save(Path(os.environ["RAYSINK_TEST_LAYERS"]))
    if _BOOK.tests:
        TIMES_FILE.parent.mkdir(parents=True, exist_ok=True)
        TIMES_FILE.write_text(json.dumps(_BOOK.tests, indent=1, sort_keys=True) + "\n")
        terminalreporter.write_line(f"each test's seconds and runtime starts: {TIMES_FILE}")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        parts = Path(str(item.fspath)).parts
        for layer in LAYERS:
            if layer in parts:
                item.add_marker(getattr(pytest.mark, layer))
    # the cluster layer last (stable: the others keep their order): its fixture ends the
    # single-node Ray the other layers share
    items.sort(key=lambda item: item.get_closest_marker("cluster") is not None)


@pytest.fixture(scope="session")
def ray_session() -> Iterator[None]:
    """One local Ray for the whole test session (8 logical CPUs so RayDP fits on 2 cores).
    ``address="local"``: always a new Ray of this session's own, never a cluster some
    other process on the machine started (a bare ``ray.init()`` would join one)."""
    import ray

    if not ray.is_initialized():
        ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def _idle_task() -> Callable[[], None]:
    """A function that does nothing: running it as a Ray task leaves a started worker in
    Ray's idle pool. Made inside a function so that Ray ships it by value: a module-level
    function travels by reference, and every worker that ran it imported this module and
    with it pytest, hypothesis and psycopg (0.2 s of CPU each, hundreds of workers a run)."""

    def idle() -> None:
        return None

    return idle


_IDLE: dict[str, Any] = {}  # ``_idle_task()`` as a Ray task, made once


@pytest.fixture(autouse=True)
def _warm_workers(request: pytest.FixtureRequest) -> Iterator[None]:
    """After each test on the session's Ray, a few worker processes are started in the
    background for the next test's actors: an actor takes an idle worker from Ray's pool
    at once, where starting one costs it 2-4 s on this machine (Python, Ray, pyarrow).
    Ray keeps up to ``num_cpus`` idle workers; the tasks are not waited for."""
    yield
    if "ray_session" not in request.fixturenames or not any(
            request.node.get_closest_marker(layer) for layer in _WARMED_LAYERS):
        return
    import ray

    if ray.is_initialized() and _WARM_WORKERS:
        idle = _IDLE.get("task") or _IDLE.setdefault("task", ray.remote(num_cpus=0)(_idle_task()))
        for _ in range(_WARM_WORKERS):
            idle.remote()


@pytest.fixture(autouse=True)
def _pg_server_running(request: pytest.FixtureRequest) -> None:
    """The session's PostgreSQL is up when a test starts: a test that stopped it and failed
    before starting it again costs that test only, not every later one."""
    if "pg_server" in request.fixturenames:
        request.getfixturevalue("pg_server").start()


@pytest.fixture
def name(request: pytest.FixtureRequest) -> Iterator[str]:
    """A runtime name no other test or session uses; its fault arms removed afterwards."""
    from raysink.testing import disarm_faults

    module = request.module.__name__.rsplit(".", 1)[-1].removeprefix("test_")
    runtime = f"{module[:12].replace('_', '-')}-{uuid.uuid4().hex[:8]}"
    yield runtime
    disarm_faults(runtime)


from tests.support.kafka import kafka_broker  # noqa: E402,F401
from tests.support.postgres import pg_server  # noqa: E402,F401
