"""Two drivers of one runtime: fenced at start, and at the target when they cannot see
each other.

* A driver elsewhere holds the runtime's lease: a start is refused, naming it, until the
  lease expires (it stopped renewing); then the start takes it over.
* Two drivers starting the same runtime at once in one Ray cluster: exactly one starts,
  the other gets ``RuntimeInUseError`` (with one meta store the lease refuses it; with two,
  the actors' names). Both start checks are passed together on purpose (a barrier after
  the actor-name check), the window in which both used to succeed.
* Two drivers with meta stores of their own (so neither lease sees the other) number the
  same epoch and commit different data as it: the target keeps exactly one of them, and
  the driver whose data did not land reports the epoch skipped with no rows. The other
  driver is played by the test itself: a writer of the same sink stages its rows and its
  ``commit`` runs while this runtime's coordinator is held at a protocol point.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
import ray

from raysink import RuntimeInUseError, SinkRuntime
from raysink.coordinator.metastore import open_metastore
from raysink.driver.lifecycle import ActorSet, coordinator_name
from raysink.sinks import ParquetSink
from raysink.sinks.base import CommitResult
from raysink.testing import arm_fault
from tests.integration.helpers import assert_exactly, epoch_table, run_in_thread, wait_fired
from tests.integration.real_targets import Target, assert_ids_exact, make_target

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.timeout(240)]

ROWS = 200
PAUSE = 4.0  # seconds the runtime's coordinator is held while the other driver commits


# --------------------------------------------------------------------------- starts


@pytest.mark.parametrize("stores", [1, 2])
def test_two_drivers_starting_at_once(tmp_path: Path, name: str, stores: int,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Two threads start one runtime name at the same moment (one meta store, or one each):
    one runtime starts, the other start is refused, and the target holds what the one
    wrote."""
    checked = threading.Barrier(2)
    refuse_if_live = ActorSet.refuse_if_live

    def refuse_then_wait(self: ActorSet) -> None:
        refuse_if_live(self)
        with contextlib.suppress(threading.BrokenBarrierError):
            checked.wait(timeout=30)

    monkeypatch.setattr(ActorSet, "refuse_if_live", refuse_then_wait)
    runtimes = [SinkRuntime(name, ParquetSink(str(tmp_path / "table")), writers=1,
                            metastore=f"sqlite:///{tmp_path / f'meta-{i % stores}.db'}",
                            progress=False) for i in range(2)]

    def start(rt: SinkRuntime) -> SinkRuntime:
        try:
            return rt.start()
        except BaseException:
            checked.abort()  # the other start need not wait for this one
            raise

    boxes = [run_in_thread(lambda rt=rt: start(rt)) for rt in runtimes]  # type: ignore[misc]
    for thread, _ in boxes:
        thread.join(120)
    started = [box["result"] for _, box in boxes if "result" in box]
    refused = [box["error"] for _, box in boxes if "error" in box]
    try:
        assert len(started) == 1 and len(refused) == 1, (started, refused)
        assert isinstance(refused[0], RuntimeInUseError), refused[0]
        assert started[0].write_arrow(epoch_table(1, ROWS)).committed
    finally:
        for rt in started:
            rt.close()
    assert_exactly(tmp_path / "table", [1], ROWS)


def test_a_live_lease_elsewhere_refuses_the_start_until_it_expires(
        tmp_path: Path, name: str, meta: str) -> None:
    """A driver on another machine holds the runtime's lease and renews it: a start is
    refused, naming that driver and until when, before any actor starts. Once it stops
    renewing (killed), the next start waits for the lease to expire and takes it over;
    ``close()`` gives it up."""
    store = open_metastore(meta, name)
    owner = {"host": "elsewhere", "pid": 4242, "ray": "10.0.0.9:6379"}
    renewing = threading.Event()
    renewing.set()

    def renew() -> None:
        while renewing.is_set():
            store.acquire_lease(name, "elsewhere", owner, 2.0)
            time.sleep(0.3)

    store.acquire_lease(name, "elsewhere", owner, 2.0)
    thread = threading.Thread(target=renew, daemon=True)
    thread.start()
    try:
        rt = SinkRuntime(name, ParquetSink(str(tmp_path / "table")), writers=1, metastore=meta,
                         progress=False, lease_timeout=2.0)
        with pytest.raises(RuntimeInUseError, match=r"pid 4242 on host elsewhere \(Ray "
                                                    r"10\.0\.0\.9:6379\) until") as info:
            rt.start()
        assert info.value.holder == owner and info.value.until is not None
        with pytest.raises(ValueError):  # nothing started
            ray.get_actor(coordinator_name(name), namespace="raysink")
    finally:
        renewing.clear()
        thread.join()
    with rt:  # the holder stopped renewing: its lease expires within 2 s, then it is ours
        assert rt.write_arrow(epoch_table(1, ROWS)).committed
        lease = store.lease(name)
        assert lease is not None and lease.live and lease.holder != "elsewhere"
        assert lease.owner["pid"] == os.getpid() and lease.token == 2
    released = store.lease(name)
    store.close()
    assert released is not None and not released.live
    assert_exactly(tmp_path / "table", [1], ROWS)


# --------------------------------------------------------------------------- the target


def _commit_elsewhere(target: Target, name: str, epoch: int, table: pa.Table,
                      options: dict[str, Any]) -> CommitResult:
    """Another driver of the runtime, with a meta store of its own, stages ``table`` with a
    writer of its own and commits it as ``epoch`` (attempt 5: staged names of its own)."""
    sink = target.sink(**options).bind(name, "main")
    writer = sink.create_writer(0)
    writer.open()
    for batch in table.to_batches():
        writer.write(batch)
    manifest = writer.pre_commit(epoch, 5)
    writer.close()
    try:
        return sink.commit(epoch, [manifest])
    finally:
        sink.close()


def _two_decisions(rt: SinkRuntime, target: Target, epoch: int, point: str,
                   options: dict[str, Any]) -> bool:
    """``epoch`` decided by ``rt`` and, with other rows (ids of ``epoch * 10``), by another
    driver that commits while ``rt``'s coordinator is held at ``point``: only the driver
    whose rows landed says so. Whether the other driver's rows landed."""
    arm_fault(rt.name, point, action="sleep", seconds=PAUSE, when={"epoch": epoch})
    thread, box = run_in_thread(lambda: rt.write_arrow(epoch_table(epoch, ROWS)))
    wait_fired(rt.name, point)
    result = _commit_elsewhere(target, rt.name, epoch, epoch_table(epoch * 10, ROWS), options)
    thread.join(120)
    report = box["result"]
    assert result in (CommitResult.COMMITTED, CommitResult.ALREADY)
    elsewhere = result is CommitResult.COMMITTED  # whose rows the epoch holds
    assert report.epoch == epoch and report.committed
    assert (report.skipped, report.rows, report.skipped_sinks) == (
        (True, 0, ("main",)) if elsewhere else (False, ROWS, ()))
    return elsewhere


# (target kind, sink options, where this runtime's coordinator is held for epoch 2)
CASES = [
    # held inside its commit (before the Delta commit): the app transaction decides
    ("delta", {}, "sink.mid_commit"),
    # held inside its commit (before the snapshot): the catalog's compare-and-swap decides
    ("iceberg", {}, "sink.mid_commit"),
    # held after COMMIT PREPARED of its writers, before the epoch's progress row
    ("postgres", {"method": "prepared"}, "sink.mid_commit"),
    # held inside its one transaction, the epoch's progress row inserted: the other waits
    ("postgres", {"method": "staging"}, "sink.mid_commit"),
]


@pytest.mark.parametrize(("kind", "options", "point"), CASES,
                         ids=[f"{k}-{o.get('method', '')}-{p.split('.')[1]}".replace("--", "-")
                              for k, o, p in CASES])
def test_two_decisions_of_one_epoch(kind: str, options: dict[str, Any], point: str,
                                    name: str, meta: str, tmp_path: Path,
                                    request: pytest.FixtureRequest,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Epoch 2 is decided by this runtime and, with other rows, by another driver with a
    meta store of its own; the other commits while this runtime's coordinator is held at
    ``point``. The target holds exactly one of the two, and only the driver whose rows
    landed says so: the other reports the epoch skipped, with no rows. (Parquet:
    ``test_two_decisions_of_one_epoch_in_parquet``.)"""
    target = make_target(kind, tmp_path, request, monkeypatch)
    with SinkRuntime(name, target.sink(**options), writers=1, metastore=meta,
                     progress=False, retry_cap=0.5) as rt:
        assert rt.write_arrow(epoch_table(1, ROWS)).committed
        elsewhere = _two_decisions(rt, target, 2, point, options)
    assert_ids_exact(target.ids(), [1, 20] if elsewhere else [1, 2], ROWS)
    assert target.commit_epochs(name) == [1, 2]


def test_two_decisions_of_one_epoch_in_parquet(name: str, meta: str, tmp_path: Path,
                                               request: pytest.FixtureRequest,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """``test_two_decisions_of_one_epoch`` for Parquet, both cases in one runtime: epoch 2
    held before its commit (the other commits first, this one is skipped by the marker),
    epoch 3 held inside it (files moved, commit log entry not written: one must win)."""
    target = make_target("parquet", tmp_path, request, monkeypatch)
    with SinkRuntime(name, target.sink(), writers=1, metastore=meta, progress=False,
                     retry_cap=0.5) as rt:
        assert rt.write_arrow(epoch_table(1, ROWS)).committed
        landed = [1]
        for epoch, point in ((2, "coordinator.after_pending"), (3, "sink.mid_commit")):
            elsewhere = _two_decisions(rt, target, epoch, point, {})
            landed.append(epoch * 10 if elsewhere else epoch)
            assert_ids_exact(target.ids(), landed, ROWS)
            assert target.commit_epochs(name) == list(range(1, epoch + 1))
