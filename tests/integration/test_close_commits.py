"""``rt.close()`` commits what was decided or raises; a meta store that fails during a
coordinator's recovery heals without a restart (issue 36, items 10 and 7).

The meta store's failure is ``metastore.recover`` armed to ``raise`` (a ``MetaStoreError``
right after the restarted coordinator claimed its generation, as a PostgreSQL failover
gives); the decided epoch is one whose sink commit failed while a ``FailingSink``'s
outage file existed. Before the fixes the restarted coordinator stayed broken for good
(every later write raised its ``MetaStoreError``), and close trusted the empty
``pending_epochs`` of a coordinator that had not recovered and returned with the decided
epoch uncommitted; a stream whose last epoch could not be drained closed without a word.
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import pytest

from raysink import SinkRuntime
from raysink.errors import EpochFailedError, RuntimeUnavailableError
from raysink.testing import FailingSink, ListSink, arm_fault, disarm_faults, fired
from tests.integration.helpers import (
    actor_pid,
    epoch_table,
    run_in_thread,
    sigkill,
    wait_fired,
)
from tests.support.postgres import PostgresServer

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.timeout(120)]

ROWS = 20


def _sink(tmp_path: Path) -> FailingSink:
    return FailingSink(ListSink(tmp_path / "target"), state_dir=tmp_path / "faults",
                       outage_file=tmp_path / "outage")


def _runtime(tmp_path: Path, name: str, **options: float) -> SinkRuntime:
    return SinkRuntime(name, _sink(tmp_path), writers=1, progress=False,
                       metastore=f"sqlite:///{tmp_path / 'meta.db'}", retry_cap=0.3,
                       **{"commit_timeout": 5.0, **options})


def _assert_target_holds(tmp_path: Path, epochs: list[int]) -> None:
    """The target holds every row of ``epochs`` once, and nothing else."""
    ids = Counter(ListSink(tmp_path / "target").read().column("id").to_pylist())
    expected = Counter(e * 1_000_000 + i for e in epochs for i in range(ROWS))
    assert ids == expected, (f"missing {sorted(expected - ids)[:5]}, extra "
                             f"{sorted(ids - expected)[:5]}")


def test_a_meta_store_error_during_recovery_is_retried_and_the_runtime_heals(
        tmp_path: Path, name: str) -> None:
    """The coordinator restarted and its recovery failed on the meta store four times:
    it tries again with backoff, and the next epochs commit without a manual restart."""
    with _runtime(tmp_path, name) as rt:
        assert rt.write_arrow(epoch_table(1, ROWS)).committed
        arm_fault(name, "metastore.recover", action="raise", times=4)
        sigkill(actor_pid(rt))  # Ray restarts it: a claim, then a failing recovery
        for epoch in (2, 3):
            assert rt.write_arrow(epoch_table(epoch, ROWS)).committed
        assert fired(name, "metastore.recover")
        assert rt.status().error is None
    _assert_target_holds(tmp_path, [1, 2, 3])


def test_a_postgres_failover_right_after_the_coordinators_claim_heals(
        pg_server: PostgresServer, tmp_path: Path, name: str) -> None:
    """The real meta store: the coordinator is restarted, claims its generation, and
    PostgreSQL goes down (a crash) before the recovery reads it; it is back 3 s later.
    The recovery retries until it answers and the next epochs commit, with no restart."""
    sink = ListSink(tmp_path / "target")
    with SinkRuntime(name, sink, writers=1, metastore=pg_server.dsn(), retry_cap=0.3,
                     commit_timeout=10.0, progress=False) as rt:
        assert rt.write_arrow(epoch_table(1, ROWS)).committed
        arm_fault(name, "metastore.recover", action="sleep", seconds=2.0)
        sigkill(actor_pid(rt))
        asking, _ = run_in_thread(rt.status)  # a call starts the restarted one's recovery
        wait_fired(name, "metastore.recover")  # claimed; the recovery holds 2 s
        pg_server.stop("immediate")
        try:
            time.sleep(3.0)  # the recovery's first reads fail meanwhile
        finally:
            pg_server.start()
        asking.join(timeout=60)
        for epoch in (2, 3):
            assert rt.write_arrow(epoch_table(epoch, ROWS)).committed
        assert rt.status().error is None
    _assert_target_holds(tmp_path, [1, 2, 3])


def test_close_right_after_a_coordinator_restart_commits_the_decided_epoch(
        tmp_path: Path, name: str) -> None:
    """Epoch 2 is decided, its commit held by the target's outage; the coordinator is
    restarted and its recovery fails twice on the meta store; the outage ends and the
    runtime closes at once: close waits for the recovery and commits epoch 2."""
    rt = _runtime(tmp_path, name).start()
    try:
        assert rt.write_arrow(epoch_table(1, ROWS)).committed
        (tmp_path / "outage").touch()
        assert not rt.write_arrow(epoch_table(2, ROWS)).committed  # decided, not visible
        arm_fault(name, "metastore.recover", action="raise", times=2)
        sigkill(actor_pid(rt))
        (tmp_path / "outage").unlink()
    finally:
        rt.close()
    assert fired(name, "metastore.recover")
    _assert_target_holds(tmp_path, [1, 2])


def test_close_raises_when_the_coordinator_cannot_recover_in_time(
        tmp_path: Path, name: str) -> None:
    """The meta store keeps failing the restarted coordinator's recovery: close cannot
    know the decided epochs are committed, so it raises naming the meta store's error
    (and still ends the actors: the runtime starts again, and commits epoch 2)."""
    rt = _runtime(tmp_path, name, commit_timeout=2.0).start()
    assert rt.write_arrow(epoch_table(1, ROWS)).committed
    (tmp_path / "outage").touch()
    assert not rt.write_arrow(epoch_table(2, ROWS)).committed
    arm_fault(name, "metastore.recover", action="raise", times=10_000)
    sigkill(actor_pid(rt))
    (tmp_path / "outage").unlink()
    with pytest.raises(RuntimeUnavailableError, match=r"has not recovered.*injected meta store"):
        rt.close()
    disarm_faults(name)
    with _runtime(tmp_path, name):
        pass  # its close commits the decided epoch
    _assert_target_holds(tmp_path, [1, 2])


def test_close_raises_when_the_stream_cannot_drain(tmp_path: Path, name: str) -> None:
    """The stream's last epoch fails at its seal and the coordinator cannot reopen the
    stream after it (every open fails): close raises ``EpochFailedError`` (after ending
    the actors) instead of returning as if the stream had been drained."""
    rt = _runtime(tmp_path, name, checkpoint_interval=60.0).start()
    feed = rt.stream(poll_interval=0.1)
    feed.write(epoch_table(1, ROWS))
    arm_fault(name, "writer.after_pre_commit", action="raise")
    arm_fault(name, "coordinator.after_open", action="raise", times=10_000)
    with pytest.raises(EpochFailedError, match="could not be drained"):
        rt.close()
    assert ListSink(tmp_path / "target").committed_epochs() == []
