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
import pytest

from raysink import SinkRuntime
from raysink.coordinator.metastore import open_metastore
from raysink.sinks.base import CommitResult, Sink
from raysink.testing import FailingSink, arm_fault, fired
from tests.integration.helpers import epoch_table, run_in_thread, wait_fired
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


@pytest.fixture(params=KINDS)
def target(request: pytest.FixtureRequest, tmp_path: Path,
           monkeypatch: pytest.MonkeyPatch) -> Target:
    return _target(request.param, request, tmp_path, monkeypatch)


def _runtime(name: str, sinks: Sink | dict[str, Sink], meta: str, **options: Any) -> SinkRuntime:
    options.setdefault("retry_cap", 0.5)
    options.setdefault("commit_timeout", 60)
    return SinkRuntime(name, sinks, metastore=meta, progress=False, **options)


def _commit_again(sink: Sink, epoch: int) -> None:
    """The coordinator's commit of an epoch the target already holds: a no-op."""
    assert sink.commit(epoch, []) is CommitResult.ALREADY
    sink.close()


# ----------------------------------------------------------------------------- exactly once


def test_epochs_replays_and_coordinator_crashes(target: Target, name: str, meta: str) -> None:
    """Epochs 1-2; a replay and a repeated commit change nothing; the coordinator is
    SIGKILLed after PENDING of epoch 3 (before any sink commit) and after the target commit
    of epoch 4 (before COMMITTED): each epoch is in the target once, by one commit."""
    with _runtime(name, target.sink(), meta) as rt:
        for epoch in (1, 2):
            assert rt.write_arrow(epoch_table(epoch, ROWS)).committed
        replay = rt.write_arrow(epoch_table(2, ROWS), epoch=2)
        assert replay.skipped and replay.skipped_sinks == ("main",)
        _commit_again(rt.sinks["main"], 2)
        assert target.commit_epochs(name) == [1, 2]

        arm_fault(name, "coordinator.after_pending", action="kill", when={"epoch": 3})
        third = rt.write_arrow(epoch_table(3, ROWS))
        assert (third.epoch, third.committed) == (3, True)
        assert third.attempts == 1  # decided before the crash: rolled forward, not re-fed

        arm_fault(name, "coordinator.after_commit", action="kill", when={"epoch": 4})
        fourth = rt.write_arrow(epoch_table(4, ROWS))
        assert (fourth.epoch, fourth.committed) == (4, True)
        # recovery saw the marker, of this very decision (``holds_decision``): no second commit
        # (commit_epochs below), and the rows are reported written, not skipped
        assert (fourth.skipped, fourth.skipped_sinks, fourth.rows) == (False, (), ROWS)

        assert rt.write_arrow(epoch_table(5, ROWS)).committed
        status = rt.status()
    assert status.last_committed_epoch == 5 and status.pending_epochs == []
    assert status.sinks["main"].state == "running"
    assert_ids_exact(target.ids(), [1, 2, 3, 4, 5], ROWS)
    assert target.commit_epochs(name) == [1, 2, 3, 4, 5]


# The default run proves this on PostgreSQL; what Delta and Iceberg add (a commit from the
# meta store's manifests by a sink that did not stage them) is the contract's
# (test_sink_contract.py, manifests through JSON into a fresh sink), and a new coordinator
# committing a pending epoch is test_epochs_replays_and_coordinator_crashes for every sink.
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
    with _runtime(name, failing, meta, commit_timeout=3, retry_cap=0.2) as rt:
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


@pytest.mark.parametrize("kind", ["delta", "postgres"])
def test_upsert_keeps_the_last_value_per_key(kind: str, request: pytest.FixtureRequest,
                                             tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             name: str, meta: str) -> None:
    """Three epochs of five batches with repeated keys, two writers routed by the sink's key
    (the default routing key): the table holds the last value of every key."""
    target = _target(kind, request, tmp_path, monkeypatch)
    sink = (target.sink(mode="upsert", key=["id"]) if kind == "delta"
            else target.sink(key=["id"]))
    epochs = [_upsert_batches(e) for e in (1, 2, 3)]
    with _runtime(name, sink, meta, writers=2) as rt:
        assert rt.key == ("id",)
        for tables in epochs:
            assert rt.write_arrow(tables).committed
    assert target.values() == _last_values(epochs)
    assert target.commit_epochs(name) == [1, 2, 3]


@pytest.mark.parametrize(("point", "action"), [
    # a writer dies while its upsert transaction is open, nothing prepared
    ("writer.during_write", "kill"),
    # a writer dies after PREPARE, before its commit request: the attempt is aborted and
    # its prepared transaction, which holds the keys, rolled back before the retry
    ("writer.after_pre_commit", "kill"),
    # the coordinator dies with the epoch PENDING: recovery commits the prepared upserts
    ("coordinator.after_pending", "kill"),
    # the commit fails between COMMIT PREPARED and the epoch row: retried, counted once
    ("sink.mid_commit", "raise"),
])
def test_postgres_upserts_at_each_crash_point(pg_server: PostgresServer, schema: str,
                                              name: str, meta: str, point: str,
                                              action: str) -> None:
    """Prepared upserts (two writers routed by key, keys repeated within and across epochs)
    with a crash in epoch 2: every key holds its last value and each epoch committed once."""
    target = PostgresTarget(pg_server, schema)
    epochs = [_upsert_batches(e) for e in (1, 2, 3)]
    when: dict[str, Any] = {"epoch": 2}
    if point.startswith("writer."):
        when["writer"] = 0
    with _runtime(name, target.sink(key=["id"]), meta, writers=2) as rt:
        assert rt.write_arrow(epochs[0]).committed
        arm_fault(name, point, action=action, when=when)  # type: ignore[arg-type]
        assert rt.write_arrow(epochs[1]).committed
        assert fired(name, point)
        assert rt.write_arrow(epochs[2]).committed
    assert target.values() == _last_values(epochs)
    assert target.commit_epochs(name) == [1, 2, 3]


# ----------------------------------------------------------------------------- PostgreSQL


@pytest.mark.parametrize(("method", "key"), [
    ("prepared", None),
    ("staging", None),
    # upserts: the writers' UNLOGGED stages are emptied by the crash, the prepared
    # transactions are not
    ("prepared", ["id"]),
])
def test_postgres_restart_between_pre_commit_and_commit(
        pg_server: PostgresServer, schema: str, name: str, meta: str, method: str,
        key: list[str] | None) -> None:
    """PostgreSQL crash-restarts (``-m immediate``) while epoch 2 is PENDING and not yet
    committed: the prepared or staged rows survive and commit once."""
    target = PostgresTarget(pg_server, schema)
    with _runtime(name, target.sink(method=method, key=key), meta) as rt:
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
    assert_ids_exact(target.ids(), [1, 2, 3], ROWS)
    assert target.commit_epochs(name) == [1, 2, 3]


def test_coordinator_killed_between_delta_and_postgres_commits(
        pg_server: PostgresServer, schema: str, tmp_path: Path, name: str, meta: str) -> None:
    """One runtime, two sinks: the coordinator dies once one of them committed epoch 3 and
    the other had not (sinks commit on their own: whichever recorded first). After
    recovery both hold epochs 1-4, each once."""
    delta, pg = DeltaTarget(tmp_path / "delta"), PostgresTarget(pg_server, schema)
    sinks = {"lake": delta.sink(), "db": pg.sink()}
    with _runtime(name, sinks, meta) as rt:
        for epoch in (1, 2):
            assert rt.write_arrow(epoch_table(epoch, ROWS)).committed
        arm_fault(name, "coordinator.mid_commit", action="kill", when={"epoch": 3})
        third = rt.write_arrow(epoch_table(3, ROWS))
        assert (third.epoch, third.committed) == (3, True)
        assert rt.write_arrow(epoch_table(4, ROWS)).committed
    for target, sink in ((delta, "lake"), (pg, "db")):
        assert_ids_exact(target.ids(), [1, 2, 3, 4], ROWS)
        assert target.commit_epochs(name, sink) == [1, 2, 3, 4]


# ----------------------------------------------------------------------------- status


def test_status_running_paused_and_dropped(tmp_path: Path, name: str, meta: str) -> None:
    """Running while open; PAUSED in the meta store after close; a sink dropped on purpose
    shows as dropped and the others carry on."""
    lake, other = DeltaTarget(tmp_path / "lake"), DeltaTarget(tmp_path / "other")
    with _runtime(name, {"lake": lake.sink(), "other": other.sink()}, meta) as rt:
        assert rt.write_arrow(epoch_table(1, ROWS)).committed
        running = rt.status()
    assert {n: s.state for n, s in running.sinks.items()} == {"lake": "running",
                                                               "other": "running"}
    assert running.sinks["lake"].last_committed_epoch == 1

    store = open_metastore(meta, name)
    try:
        paused = store.sink_statuses(name)
    finally:
        store.close()
    assert {n: s.state for n, s in paused.items()} == {"lake": "paused", "other": "paused"}

    with _runtime(name, {"lake": lake.sink()}, meta, drop_sinks=["other"]) as rt:
        assert rt.write_arrow(epoch_table(2, ROWS)).committed
        after = rt.status()
    assert after.sinks["other"].state == "dropped"
    assert after.sinks["lake"].state == "running"
    assert "paused" in [h["state"] for h in after.sinks["lake"].history]
    assert_ids_exact(lake.ids(), [1, 2], ROWS)
    assert_ids_exact(other.ids(), [1], ROWS)

