"""Writers and the coordinator killed at each named protocol point; the result is exact.

The cases share one runtime (``shared``), in turn, as a job's runtime lives through one
fault after another: each writes an epoch, kills its victim at its protocol point of the
next one, writes one more, and compares both Parquet tables with every epoch written so
far, row by row. So each case also shows the runtime healed from every kill before it
(24 in a row), and none pays a runtime's start.

Two ways to kill: ``sigkill`` is a real SIGKILL of the victim's process (Ray restarts the
actor; the point fires inside the victim, or the victim's pid is signalled while the point
holds the epoch still); ``ray.kill`` ends the actor for good while the point holds the
epoch still (the runtime re-creates it).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import ray

from raysink import SinkRuntime
from raysink.sinks import ParquetSink
from raysink.testing import arm_fault, disarm_faults, fired
from tests.integration.helpers import (
    actor_pid,
    assert_exactly,
    end_for_good,
    epoch_table,
    run_in_thread,
    sigkill,
    unique_name,
    wait_fired,
)

pytestmark = pytest.mark.usefixtures("ray_session")

ROWS = 400

# (protocol point, the process it fires in)
WRITER_POINTS = [
    ("writer.during_write", "writer"),
    ("writer.after_pre_commit", "writer"),
    ("coordinator.after_pending", "coordinator"),
    ("sink.mid_commit", "coordinator"),
    ("coordinator.after_commit", "coordinator"),
]
COORDINATOR_POINTS = [
    ("writer.during_write", "writer"),
    ("writer.after_pre_commit", "writer"),
    ("coordinator.after_open", "coordinator"),
    ("coordinator.after_pending", "coordinator"),
    ("coordinator.mid_commit", "coordinator"),
    ("sink.mid_commit", "coordinator"),
    ("coordinator.after_commit", "coordinator"),
]


def _sinks(tmp_path: Path) -> dict[str, ParquetSink]:
    return {"main": ParquetSink(str(tmp_path / "main")),
            "copy": ParquetSink(str(tmp_path / "copy"))}


def _handle(rt: SinkRuntime, victim: str) -> Any:
    actors = rt._actors
    assert actors is not None
    return actors.coordinator if victim == "coordinator" else actors.writers["main"][0]


def _pid(rt: SinkRuntime, victim: str) -> int:
    """The process id of the victim's current incarnation (once Ray restarted it: the
    epochs after a writer's SIGKILL may commit around it while it restarts)."""
    return actor_pid(rt, victim)  # writer 0 of sink main, or the coordinator


def _kill(rt: SinkRuntime, victim: str, how: str) -> None:
    if how == "ray.kill":
        ray.kill(_handle(rt, victim))
    else:
        sigkill(_pid(rt, victim))


def _halves(epoch: int) -> list[Any]:
    """The epoch's rows in two tables: each writer gets one (a small table goes whole to
    one writer, and a writer that gets nothing is not asked to pre-commit)."""
    table = epoch_table(epoch, ROWS)
    return [table.slice(0, ROWS // 2), table.slice(ROWS // 2)]


@dataclass(frozen=True)
class Shared:
    rt: SinkRuntime
    root: Path  # the tables are ``root / "main"`` and ``root / "copy"``


@pytest.fixture(scope="module")
def shared(ray_session: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Shared]:
    """The kill cases' runtime: two Parquet sinks, two writers each."""
    root = tmp_path_factory.mktemp("faults")
    with SinkRuntime(unique_name("faults"), _sinks(root), writers=2, commit_timeout=60,
                     metastore=f"sqlite:///{root / 'meta.db'}", retry_cap=0.5) as rt:
        yield Shared(rt, root)
        disarm_faults(rt.name)


def _run_case(shared: Shared, victim: str, point: str, where: str, how: str) -> None:
    """Epoch E, then the kill at ``point`` of epoch E+1, then epoch E+2: each committed,
    and the tables hold epochs 1..E+2 exactly once."""
    rt, name = shared.rt, shared.rt.name
    first = (rt.status().last_committed_epoch or 0) + 1
    faulted = first + 1
    when: dict[str, Any] = {"epoch": faulted}
    if where == "writer":
        when.update({"writer": 0, "sink": "main"})
    assert rt.write_arrow(_halves(first)).committed
    victim_pid = _pid(rt, victim)
    try:
        if how == "sigkill" and victim == where:
            arm_fault(name, point, action="kill", when=when)
            report = rt.write_arrow(_halves(faulted))
            assert fired(name, point), f"{point} never fired: nothing was killed"
        else:
            arm_fault(name, point, action="sleep", seconds=2.0, when=when)
            thread, box = run_in_thread(lambda: rt.write_arrow(_halves(faulted)))
            wait_fired(name, point)
            _kill(rt, victim, how)
            thread.join(timeout=180)
            assert not thread.is_alive(), "the epoch never finished"
            if "error" in box:
                raise box["error"]
            report = box["result"]
    finally:
        disarm_faults(name)
    assert report.epoch == faulted and report.committed
    after = rt.write_arrow(_halves(faulted + 1))
    assert after.epoch == faulted + 1 and after.committed
    # (a writer ended by ray.kill after its part is re-created by the next epoch)
    assert _pid(rt, victim) != victim_pid, f"the {victim} (pid {victim_pid}) never died"
    for sink in ("main", "copy"):
        assert_exactly(shared.root / sink, list(range(1, faulted + 2)), ROWS)


@pytest.mark.parametrize("how", ["sigkill", "ray.kill"])
@pytest.mark.parametrize(("point", "where"), WRITER_POINTS)
def test_writer_killed(shared: Shared, point: str, where: str, how: str) -> None:
    _run_case(shared, "writer", point, where, how)


@pytest.mark.parametrize("how", ["sigkill", "ray.kill"])
@pytest.mark.parametrize(("point", "where"), COORDINATOR_POINTS)
def test_coordinator_killed(shared: Shared, point: str, where: str, how: str) -> None:
    _run_case(shared, "coordinator", point, where, how)


def test_attempts_are_bounded(tmp_path: Path) -> None:
    """Writers that die on every attempt end in EpochFailedError, nothing visible. (Every
    writer: a retry goes around a writer Ray is still restarting when another is up.)"""
    from raysink import EpochFailedError

    name = "bounded"
    with SinkRuntime(name, ParquetSink(str(tmp_path / "main")), max_attempts=2, writers=2,
                     metastore=f"sqlite:///{tmp_path / 'meta.db'}") as rt:
        rt.write_arrow(_halves(1))
        arm_fault(name, "writer.after_pre_commit", action="kill", times=5,
                  when={"epoch": 2})
        started = time.monotonic()
        with pytest.raises(EpochFailedError) as info:
            rt.write_arrow(_halves(2))
        assert info.value.attempts == 2 and info.value.epoch == 2
        assert time.monotonic() - started < 120
    assert_exactly(tmp_path / "main", [1], ROWS)


def test_a_heal_after_a_failed_attempt_probes_again(tmp_path: Path) -> None:
    """The runtime probed its actors (all well) and keeps that answer ``ping_timeout``
    seconds; then writer 0 is ended for good (``ray.kill``: Ray starts no other) and the
    next ``write_arrow`` fails on it. The heal after that attempt must probe again, find
    the dead writer and replace it, so a later attempt commits. It used to reuse the kept
    "all well": no heal, and every attempt failed on the dead writer within a second
    (three cases of this module, in a CI run at b462ba7)."""
    name = unique_name("heal-probe")
    with SinkRuntime(name, ParquetSink(str(tmp_path / "main")), writers=2, max_attempts=3,
                     ping_timeout=30.0, metastore=f"sqlite:///{tmp_path / 'meta.db'}") as rt:
        assert rt.write_arrow(_halves(1)).committed
        actors = rt._actors
        assert actors is not None
        actors.check_responsive()  # a probe: every actor answers, and the answer is kept
        end_for_good(rt, writer=0)
        report = rt.write_arrow(_halves(2))
        assert report.committed and report.attempts == 2
    assert_exactly(tmp_path / "main", [1, 2], ROWS)
