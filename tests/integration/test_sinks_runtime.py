"""Delta, Iceberg and PostgreSQL sinks through ``SinkRuntime`` with real actors.

Every case reads the real target back (``deltalake``, ``pyiceberg``, SQL) and compares it
with the input row by row; commits are counted from the target's own log (Delta ``txn``
actions, Iceberg snapshot summaries, PostgreSQL progress rows), so a second commit of an
epoch would show. Runtime names are unique per test: fault arms are files keyed by name.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet
import pytest

from raysink import SinkRuntime
from raysink.coordinator.metastore import open_metastore
from raysink.sinks.base import CommitResult, Sink
from raysink.testing import FailingSink, arm_fault, fired
from tests.integration.helpers import (
    closes_with_epoch_pending,
    epoch_table,
    run_in_thread,
    wait_fired,
)
from tests.integration.real_targets import (
    DeltaTarget,
    IcebergTarget,
    PostgresTarget,
    Target,
    assert_ids_exact,
)
from tests.support.postgres import PostgresServer

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.timeout(180)]

ROWS = 300
KINDS = ["delta", "iceberg", "postgres"]


def _target(kind: str, request: pytest.FixtureRequest, tmp_path: Path,
            monkeypatch: pytest.MonkeyPatch) -> Target:
    if kind == "delta":
        return DeltaTarget(tmp_path / "delta")
    if kind == "iceberg":
        monkeypatch.chdir(tmp_path)  # the default catalog lives under <cwd>/.raysink
        return IcebergTarget(tmp_path)
    return PostgresTarget(request.getfixturevalue("pg_server"),
                          request.getfixturevalue("schema"))


def _runtime(name: str, sinks: Sink | dict[str, Sink], meta: str, **options: Any) -> SinkRuntime:
    options.setdefault("retry_cap", 0.5)
    options.setdefault("commit_timeout", 60)
    return SinkRuntime(name, sinks, metastore=meta, progress=False, **options)


def _commit_again(sink: Sink, epoch: int) -> None:
    """The coordinator's commit of an epoch the target already holds: a no-op."""
    assert sink.commit(epoch, []) is CommitResult.ALREADY
    sink.close()


# ----------------------------------------------------------------------------- exactly once


@pytest.mark.timeout(480)  # five earlier cases' work, of 180 s each at most
def test_epochs_replays_coordinator_crashes_and_status_running_paused_dropped(
        request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        name: str, meta: str) -> None:
    """One runtime, a sink of every kind. Epochs 1-2; a replay and a repeated commit change
    nothing; the coordinator is SIGKILLed after PENDING of epoch 3 (before any sink
    commit), after one sink's target commit of epochs 4-6 (before COMMITTED: Delta's in
    epoch 4, Iceberg's in 5, PostgreSQL's in 6; the other sinks' commits of the epoch may or
    may not have landed), and once one sink recorded epoch 7 committed and the others had
    not (sinks commit on their own: whichever recorded first). Each epoch is in every
    target once, by one commit.

    The status: every sink running while open; PAUSED in the meta store after close; a
    sink dropped on purpose (Iceberg) shows as dropped and the others carry on."""
    targets = {kind: _target(kind, request, tmp_path, monkeypatch) for kind in KINDS}
    with _runtime(name, {kind: t.sink() for kind, t in targets.items()}, meta) as rt:
        for epoch in (1, 2):
            assert rt.write_arrow(epoch_table(epoch, ROWS)).committed
        replay = rt.write_arrow(epoch_table(2, ROWS), epoch=2)
        assert replay.skipped and sorted(replay.skipped_sinks) == sorted(KINDS)
        for kind, target in targets.items():
            _commit_again(rt.sinks[kind], 2)
            assert target.commit_epochs(name, kind) == [1, 2], kind

        arm_fault(name, "coordinator.after_pending", action="kill", when={"epoch": 3})
        third = rt.write_arrow(epoch_table(3, ROWS))
        assert (third.epoch, third.committed) == (3, True)
        assert third.attempts == 1  # decided before the crash: rolled forward, not re-fed

        for epoch, kind in zip((4, 5, 6), KINDS, strict=True):
            arm_fault(name, "coordinator.after_commit", action="kill",
                      when={"epoch": epoch, "sink": kind})
            report = rt.write_arrow(epoch_table(epoch, ROWS))
            assert fired(name, "coordinator.after_commit"), kind
            assert (report.epoch, report.committed) == (epoch, True)
            # recovery saw the marker, of this very decision (``holds_decision``): no second
            # commit (commit_epochs below), and the rows are reported written, not skipped
            assert (report.skipped, report.skipped_sinks, report.rows) == (False, (), ROWS)

        arm_fault(name, "coordinator.mid_commit", action="kill", when={"epoch": 7})
        seventh = rt.write_arrow(epoch_table(7, ROWS))
        assert fired(name, "coordinator.mid_commit")
        assert (seventh.epoch, seventh.committed) == (7, True)

        assert rt.write_arrow(epoch_table(8, ROWS)).committed
        status = rt.status()
    epochs = list(range(1, 9))
    assert status.last_committed_epoch == 8 and status.pending_epochs == []
    for kind, target in targets.items():
        assert status.sinks[kind].state == "running", kind
        assert status.sinks[kind].last_committed_epoch == 8, kind
        assert_ids_exact(target.ids(), epochs, ROWS)
        assert target.commit_epochs(name, kind) == epochs, kind

    store = open_metastore(meta, name)
    try:
        paused = store.sink_statuses(name)
    finally:
        store.close()
    assert {n: s.state for n, s in paused.items()} == dict.fromkeys(KINDS, "paused")

    kept = {kind: target for kind, target in targets.items() if kind != "iceberg"}
    with _runtime(name, {kind: t.sink() for kind, t in kept.items()}, meta,
                  drop_sinks=["iceberg"]) as rt:
        assert rt.write_arrow(epoch_table(9, ROWS)).committed
        after = rt.status()
    assert after.sinks["iceberg"].state == "dropped"
    for kind, target in kept.items():
        assert after.sinks[kind].state == "running", kind
        assert "paused" in [h["state"] for h in after.sinks[kind].history], kind
        assert_ids_exact(target.ids(), [*epochs, 9], ROWS)
    assert_ids_exact(targets["iceberg"].ids(), epochs, ROWS)


# The default run proves this on PostgreSQL; what Delta and Iceberg add (a commit from the
# meta store's manifests by a sink that did not stage them) is the contract's
# (test_sink_contract.py, manifests through JSON into a fresh sink), and a new coordinator
# committing a pending epoch is the first test of this module (a sink of each kind in one
# runtime).
@pytest.mark.parametrize("kind", ["postgres", pytest.param("delta", marks=pytest.mark.slow),
                                  pytest.param("iceberg", marks=pytest.mark.slow)])
def test_fresh_runtime_recovers_a_pending_epoch(kind: str, name: str, meta: str,
                                                tmp_path: Path, request: pytest.FixtureRequest,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Epoch 3 is decided but every commit fails (the sink stalls, the status says why);
    the runtime is closed with it pending. A new runtime of the same name and meta store
    commits it once, then writes on."""
    target = _target(kind, request, tmp_path, monkeypatch)
    with _runtime(name, target.sink(), meta) as rt:
        for epoch in (1, 2):
            assert rt.write_arrow(epoch_table(epoch, ROWS)).committed
    failing = FailingSink(target.sink(), state_dir=tmp_path / "failing",
                          fail_commit_times=1_000_000)
    with closes_with_epoch_pending(), _runtime(name, failing, meta, commit_timeout=3,
                                               retry_cap=0.2) as rt:
        third = rt.write_arrow(epoch_table(3, ROWS))
        assert (third.epoch, third.committed) == (3, False)  # durable, not yet visible
        stalled = rt.status()
    sink = stalled.sinks["main"]
    assert stalled.pending_epochs == [3] and sink.state == "stalled"
    assert (sink.last_error or "").startswith("InjectedSinkFailure"), sink.last_error
    assert "stalled" in [h["state"] for h in sink.history]
    assert_ids_exact(target.ids(), [1, 2], ROWS)

    with _runtime(name, target.sink(), meta) as rt:
        fourth = rt.write_arrow(epoch_table(4, ROWS))
        assert (fourth.epoch, fourth.committed) == (4, True)
        status = rt.status()
    assert status.last_committed_epoch == 4 and status.sinks["main"].state == "running"
    assert_ids_exact(target.ids(), [1, 2, 3, 4], ROWS)
    assert target.commit_epochs(name) == [1, 2, 3, 4]


def test_partitioned_iceberg_through_a_coordinator_crash_after_its_commit(
        name: str, meta: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A partitioned Iceberg table (``bucket[4]`` of the id, created by the first commit)
    through ``rt.write_arrow``: the coordinator is SIGKILLed after the table commit of
    epoch 2 (before COMMITTED). Each epoch is in the table once, by one commit, every data
    file in its bucket. (A kill inside the sink's commit, before the table commit, is
    the same recovery as for an unpartitioned table: the epoch is committed again.)"""
    from pyiceberg.transforms import BucketTransform
    from pyiceberg.types import LongType

    monkeypatch.chdir(tmp_path)
    target = IcebergTarget(tmp_path)
    with _runtime(name, target.sink(partition_by=[("id", "bucket[4]")]), meta) as rt:
        assert rt.write_arrow(epoch_table(1, ROWS)).committed
        arm_fault(name, "coordinator.after_commit", action="kill", when={"epoch": 2})
        report = rt.write_arrow(epoch_table(2, ROWS))
        assert fired(name, "coordinator.after_commit")
        assert (report.committed, report.skipped) == (True, False)
        assert rt.write_arrow(epoch_table(3, ROWS)).committed
    assert_ids_exact(target.ids(), [1, 2, 3], ROWS)
    assert target.commit_epochs(name) == [1, 2, 3]
    bucket = BucketTransform(4).transform(LongType())
    table = target._load()
    assert table is not None
    for path, partition in zip(table.inspect.files().column("file_path").to_pylist(),
                               table.inspect.files().column("partition").to_pylist(),
                               strict=True):
        ids = pa.parquet.read_table(path.removeprefix("file://")).column("id").to_pylist()
        assert {bucket(i) for i in ids} == {partition["id_bucket_4"]}


# ----------------------------------------------------------------------------- upserts


def _upsert_batches(epoch: int, batches: int = 5, rows: int = 120) -> list[pa.Table]:
    """Overlapping key ranges, each key repeated within a batch, across batches and across
    epochs; the value names ``(epoch, batch, row)`` so the winner is checkable."""
    tables = []
    for b in range(batches):
        start = (epoch * 37 + b * 23) % 200
        ids = [(start + i // 2 * 3) % 200 for i in range(rows)]
        tables.append(pa.table({"id": pa.array(ids, pa.int64()),
                                "value": [f"e{epoch}-b{b}-r{i}" for i in range(rows)]}))
    return tables


def _last_values(epochs: list[list[pa.Table]]) -> dict[int, str]:
    expected: dict[int, str] = {}
    for tables in epochs:
        for table in tables:
            for key, value in zip(table.column("id").to_pylist(),
                                  table.column("value").to_pylist(), strict=True):
                expected[key] = value
    return expected


# a crash in each of epochs 2-5, one point each, on one runtime that survived the ones before
_UPSERT_CRASHES: list[tuple[str, str]] = [
    # a writer dies while its upsert transaction is open, nothing prepared
    ("writer.during_write", "kill"),
    # a writer dies after PREPARE, before its commit request: the attempt is aborted and
    # its prepared transaction, which holds the keys, rolled back before the retry
    ("writer.after_pre_commit", "kill"),
    # the coordinator dies with the epoch PENDING: recovery commits the prepared upserts
    ("coordinator.after_pending", "kill"),
    # the commit fails between COMMIT PREPARED and the epoch row: retried, counted once
    ("sink.mid_commit", "raise"),
]


def test_upserts_keep_the_last_value_per_key_through_each_crash_point(
        pg_server: PostgresServer, schema: str, tmp_path: Path, name: str, meta: str) -> None:
    """Six epochs of five batches with repeated keys, within and across batches and epochs,
    two writers routed by the sinks' key (the default routing key), into a Delta and a
    PostgreSQL upsert sink of one runtime; epochs 2-5 each crash at one point of the
    PostgreSQL sink's path (its prepared upserts) or the coordinator's. Each table holds the
    last value of every key, each epoch by one commit."""
    delta, pg = DeltaTarget(tmp_path / "delta"), PostgresTarget(pg_server, schema)
    sinks = {"lake": delta.sink(mode="upsert", key=["id"]), "db": pg.sink(key=["id"])}
    epochs = [_upsert_batches(e) for e in range(1, len(_UPSERT_CRASHES) + 3)]
    with _runtime(name, sinks, meta, writers=2) as rt:
        assert rt.key == ("id",)
        assert rt.write_arrow(epochs[0]).committed
        for epoch, (point, action) in enumerate(_UPSERT_CRASHES, start=2):
            when: dict[str, Any] = {"epoch": epoch}
            if not point.startswith("coordinator."):
                when["sink"] = "db"
            if point.startswith("writer."):
                when["writer"] = 0
            arm_fault(name, point, action=action, when=when)  # type: ignore[arg-type]
            assert rt.write_arrow(epochs[epoch - 1]).committed, point
            assert fired(name, point), point
        assert rt.write_arrow(epochs[-1]).committed
    numbers = list(range(1, len(epochs) + 1))
    for target, sink in ((delta, "lake"), (pg, "db")):
        assert target.values() == _last_values(epochs), sink
        assert target.commit_epochs(name, sink) == numbers, sink


# ----------------------------------------------------------------------------- PostgreSQL


# each PostgreSQL sink's way of staging an epoch, one table each in one runtime
_METHODS: dict[str, dict[str, Any]] = {
    "prepared": {"method": "prepared"},
    "staging": {"method": "staging"},
    # upserts: the writers' UNLOGGED stages are emptied by the crash, the prepared
    # transactions are not
    "upsert": {"method": "prepared", "key": ["id"]},
}


def test_postgres_restart_between_pre_commit_and_commit(
        pg_server: PostgresServer, schema: str, name: str, meta: str) -> None:
    """PostgreSQL crash-restarts (``-m immediate``) while epoch 2 is PENDING and not yet
    committed: the prepared, staged and prepared upsert rows of the runtime's three
    PostgreSQL sinks survive and commit once."""
    targets = {sink: PostgresTarget(pg_server, schema, f"events_{sink}") for sink in _METHODS}
    sinks = {sink: targets[sink].sink(**options) for sink, options in _METHODS.items()}
    with _runtime(name, sinks, meta) as rt:
        assert rt.write_arrow(epoch_table(1, ROWS)).committed
        arm_fault(name, "coordinator.after_pending", action="sleep", seconds=3.0,
                  when={"epoch": 2})
        thread, box = run_in_thread(lambda: rt.write_arrow(epoch_table(2, ROWS)))
        wait_fired(name, "coordinator.after_pending")
        pg_server.restart(mode="immediate")
        thread.join(timeout=120)
        assert not thread.is_alive() and "error" not in box, box.get("error")
        assert box["result"].committed
        assert rt.write_arrow(epoch_table(3, ROWS)).committed  # writers reconnect
    for sink, target in targets.items():
        assert_ids_exact(target.ids(), [1, 2, 3], ROWS)
        assert target.commit_epochs(name, sink) == [1, 2, 3], sink
