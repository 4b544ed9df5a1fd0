"""``heal`` on one node: a dead actor is replaced by a new incarnation; one that is only
slow to answer a ping, on a node whose raylet answers, is left alone (a busy or
restarting actor: replacing it would fail an epoch its producers cannot feed again).

A writer Ray is restarting after a SIGKILL mid-epoch (held in its restart by a ``sleep``
at ``writer.start``): the retry of an epoch without a routing key goes around it; a keyed
retry waits for it instead of sending calls that Ray fails once the writer is back.

With node labels for the coordinator, a standby coordinator takes over a lost one (and a
new coordinator is started when the standby is gone too)."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import pytest
import ray

from raysink import Placement, SinkRuntime
from raysink.driver.remote import find_coordinator
from raysink.testing import arm_fault, fired
from tests.integration.helpers import epoch_table
from tests.integration.real_targets import ParquetTarget, assert_ids_exact

pytestmark = pytest.mark.usefixtures("ray_session")

ROWS = 100


@ray.remote(num_cpus=0)
class _Slow:
    """Stands for a writer too busy to answer a ping in time."""

    def ping(self) -> int:
        time.sleep(3.0)
        return 0


def test_a_slow_actor_is_left_alone_and_a_dead_one_replaced(tmp_path: Path,
                                                            name: str) -> None:
    target = ParquetTarget(tmp_path / "table")
    with SinkRuntime(name, target.sink(), writers=2, progress=False, ping_timeout=0.5,
                     metastore=f"sqlite:///{tmp_path / 'meta.db'}") as rt:
        assert rt.write_arrow(epoch_table(1, ROWS)).committed
        actors = rt._actors
        assert actors is not None
        writers = actors.writers["main"]
        busy, writers[0] = writers[0], _Slow.remote()
        try:
            actors.check_responsive()  # no RuntimeUnavailableError: slow is not lost
            assert actors.heal(timeout=10) == []
        finally:
            writers[0] = busy
        ray.kill(writers[1], no_restart=True)
        time.sleep(0.6)  # a probe's result is reused for ping_timeout seconds
        with pytest.raises(Exception, match="did not answer a ping"):
            actors.check_responsive()
        replaced = actors.heal(timeout=30)
        assert len(replaced) == 1 and replaced[0].startswith(f"{name}.main.writer-1")
        assert rt.write_arrow(epoch_table(2, ROWS)).committed
    assert_ids_exact(target.ids(), [1, 2], ROWS)


def _halves(epoch: int) -> list[Any]:
    """Two tables, one per writer (a small table would go whole to one writer)."""
    table = epoch_table(epoch, ROWS)
    return [table.slice(0, ROWS // 2), table.slice(ROWS // 2)]


def _writers_of(target: ParquetTarget, epoch: int) -> set[int]:
    """The writers whose files hold ``epoch``'s committed rows (``-w<k>`` in the names)."""
    pattern = re.compile(rf"e{epoch:012d}-a\d{{4}}-w(\d{{4}})-")
    return {int(m.group(1)) for f in target.path.glob("*.parquet")
            if (m := pattern.search(f.name))}


def _kill_writer_0_held_in_restart(name: str, epoch: int, seconds: float) -> None:
    """Writer 0 SIGKILLs itself mid-write of ``epoch``; Ray's restart of it then sleeps
    ``seconds`` in its constructor."""
    arm_fault(name, "writer.start", action="sleep", seconds=seconds,
              when={"writer": 0, "sink": "main"})
    arm_fault(name, "writer.during_write", action="kill",
              when={"epoch": epoch, "writer": 0, "sink": "main"})


def test_an_unkeyed_retry_goes_around_a_writer_ray_is_restarting(tmp_path: Path,
                                                                 name: str) -> None:
    """Before: the retry's writes went to writer 0 while Ray restarted it, and Ray failed
    them once it was back (another attempt lost, every attempt when the restart is slow)."""
    target = ParquetTarget(tmp_path / "table")
    with SinkRuntime(name, target.sink(), writers=2, progress=False,
                     metastore=f"sqlite:///{tmp_path / 'meta.db'}") as rt:
        for epoch in (1, 2):
            assert rt.write_arrow(_halves(epoch)).committed
        _kill_writer_0_held_in_restart(name, 3, seconds=8.0)
        report = rt.write_arrow(_halves(3))
        assert fired(name, "writer.during_write")
        assert report.committed and report.attempts == 2
        assert _writers_of(target, 3) == {1}, "the retry did not go around writer 0"
        assert rt.write_arrow(_halves(4)).committed
    assert_ids_exact(target.ids(), [1, 2, 3, 4], ROWS)


def test_a_keyed_retry_waits_for_a_writer_ray_is_restarting(tmp_path: Path,
                                                            name: str) -> None:
    """Rows of a key belong to one writer: the retry waits until writer 0 answers, then
    feeds it. Before: its calls failed while Ray restarted it, and a restart slower than
    the attempts failed the epoch (EpochFailedError)."""
    target = ParquetTarget(tmp_path / "table")
    with SinkRuntime(name, target.sink(), writers=2, progress=False, key=["id"],
                     metastore=f"sqlite:///{tmp_path / 'meta.db'}") as rt:
        assert rt.write_arrow(epoch_table(1, ROWS)).committed
        _kill_writer_0_held_in_restart(name, 2, seconds=4.0)
        report = rt.write_arrow(epoch_table(2, ROWS))
        assert fired(name, "writer.during_write") and fired(name, "writer.start")
        assert report.committed and report.attempts == 2
        assert _writers_of(target, 2) == {0, 1}
    assert_ids_exact(target.ids(), [1, 2], ROWS)


def _actor_id(handle: Any) -> bytes:
    assert handle is not None
    return bytes(handle._actor_id.binary())


def test_a_standby_coordinator_takes_over(tmp_path: Path, name: str) -> None:
    """Labels pin the coordinator (here: this node's id), so a standby waits beside it: a
    coordinator killed with its epoch PENDING is followed by the standby (which rolls the
    epoch forward, a standby of its own behind it); with that standby gone as well, a new
    coordinator is started. A stream's producer looking the coordinator up by name
    (``find_coordinator``) finds the standby once it took over, never before (before: a
    standby's name was not looked at, so a producer found no coordinator)."""
    target = ParquetTarget(tmp_path / "table")
    here = {"ray.io/node-id": ray.get_runtime_context().get_node_id()}
    with SinkRuntime(name, target.sink(), writers=2, progress=False,
                     placement=Placement(coordinator=here),
                     metastore=f"sqlite:///{tmp_path / 'meta.db'}") as rt:
        assert rt.write_arrow(_halves(1)).committed
        actors = rt._actors
        assert actors is not None and actors._standby is not None
        standby = actors._standby[2]
        assert ray.get(standby.ping.remote(), timeout=120) == 0  # up, not yet the coordinator
        assert _actor_id(find_coordinator(name)) == _actor_id(actors.coordinator)
        arm_fault(name, "coordinator.after_pending", action="kill", when={"epoch": 2})
        assert rt.write_arrow(_halves(2)).committed
        assert actors.coordinator is standby
        assert _actor_id(find_coordinator(name)) == _actor_id(standby)
        assert actors._standby is not None and actors._standby[2] is not standby
        ray.kill(actors._standby[2], no_restart=True)
        arm_fault(name, "coordinator.after_pending", action="kill", when={"epoch": 3})
        assert rt.write_arrow(_halves(3)).committed
        assert actors.coordinator is not standby
        assert "-standby" not in actors._names[("", -1)]  # a coordinator started anew
    assert_ids_exact(target.ids(), [1, 2, 3], ROWS)
