"""PostgresSink upserts against a real PostgreSQL (``pg_server``), driven without Ray.

The protocol is driven by hand as in ``test_postgres_sink.py``. Each case compares the
whole table with a Python model of "last row per key within an epoch, later epochs win",
through chunk boundaries (``UPSERT_CHUNK_ROWS`` made small), aborts, a server crash
restart, and a next epoch that has to wait for the previous epoch's prepared transaction.
"""

from __future__ import annotations

import random
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pyarrow as pa
import pytest
from psycopg import sql

from raysink.errors import SchemaMismatchError, SinkUnavailableError
from raysink.sinks.base import Manifest
from raysink.sinks.postgres import PostgresSink, _prepared
from tests.support.postgres import PostgresServer, pg_server
from tests.support.staging import stage_writers

__all__ = ["pg_server"]

METHODS = ["prepared", "staging"]
pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def schema(pg_server: PostgresServer) -> Iterator[str]:
    name = f"u_{uuid.uuid4().hex[:10]}"
    pg_server.execute(f'CREATE SCHEMA "{name}" AUTHORIZATION raysink', dbname="raysink")
    yield name
    for (gid,) in pg_server.execute(
            "SELECT gid FROM pg_prepared_xacts WHERE database = 'raysink'"):
        pg_server.execute(sql.SQL("ROLLBACK PREPARED {}").format(sql.Literal(gid))
                          .as_string(None), dbname="raysink")
    pg_server.execute(f'DROP SCHEMA "{name}" CASCADE', dbname="raysink")


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks of 50 rows: every epoch below crosses several chunk boundaries."""
    monkeypatch.setattr(_prepared, "UPSERT_CHUNK_ROWS", 50)


def _sink(pg: PostgresServer, schema: str, method: str, key: list[str] | None = None,
          runtime: str = "rt") -> PostgresSink:
    return PostgresSink(pg.dsn(), "events", schema=schema, method=method,  # type: ignore[arg-type]
                        key=key or ["id"]).bind(runtime, "main")


def _batches(rng: random.Random, epoch: int, count: int, rows: int,
             keys: int) -> list[pa.RecordBatch]:
    """Batches with keys repeated within a batch and across batches; values name
    ``(epoch, batch, row)``."""
    return [pa.record_batch({
        "id": pa.array([rng.randrange(keys) for _ in range(rows)], pa.int64()),
        "value": pa.array([f"e{epoch}-b{b}-r{i}" for i in range(rows)]),
    }) for b in range(count)]


def _apply(model: dict[int, str], batches: list[pa.RecordBatch]) -> None:
    for batch in batches:
        for key, value in zip(batch.column("id").to_pylist(), batch.column("value").to_pylist(),
                              strict=True):
            model[key] = value


def _stage(sink: PostgresSink, epoch: int, per_writer: dict[int, list[pa.RecordBatch]],
           attempt: int = 0) -> list[Manifest]:
    return stage_writers(sink, epoch, per_writer, attempt)


def _split(batches: list[pa.RecordBatch]) -> dict[int, list[pa.RecordBatch]]:
    """Two writers, routed by key (even ids to writer 0), order kept within each."""
    out: dict[int, list[pa.RecordBatch]] = {0: [], 1: []}
    for batch in batches:
        even = pa.compute.equal(pa.compute.bit_wise_and(batch.column("id"), 1), 0)
        out[0].append(batch.filter(even))
        out[1].append(batch.filter(pa.compute.invert(even)))
    return out


def _table(pg: PostgresServer, schema: str) -> dict[int, str]:
    rows = pg.execute(sql.SQL("SELECT id, value FROM {}").format(
        sql.Identifier(schema, "events")).as_string(None), dbname="raysink")
    assert len(rows) == len({r[0] for r in rows})
    return {int(r[0]): str(r[1]) for r in rows}


@pytest.mark.parametrize("method", METHODS)
def test_last_row_per_key_through_chunks_and_epochs(
        pg_server: PostgresServer, schema: str, method: str, small_chunks: None) -> None:
    rng = random.Random(11)
    sink = _sink(pg_server, schema, method)
    model: dict[int, str] = {}
    for epoch in (1, 2, 3):
        batches = _batches(rng, epoch, count=6, rows=70, keys=150)
        sink.commit(epoch, _stage(sink, epoch, _split(batches)))
        _apply(model, batches)
        assert _table(pg_server, schema) == model
    sink.commit(3, [])  # again: nothing changes
    assert _table(pg_server, schema) == model
    assert sink.committed_epoch() == 3
    sink.close()


@pytest.mark.parametrize("method", METHODS)
def test_an_aborted_epoch_changes_nothing_and_its_retry_wins(
        pg_server: PostgresServer, schema: str, method: str, small_chunks: None) -> None:
    rng = random.Random(5)
    sink = _sink(pg_server, schema, method)
    first = _batches(rng, 1, count=3, rows=60, keys=80)
    sink.commit(1, _stage(sink, 1, _split(first)))
    model: dict[int, str] = {}
    _apply(model, first)
    doomed = _stage(sink, 2, _split(_batches(rng, 2, count=3, rows=60, keys=80)))
    sink.abort(2, doomed)
    sink.abort(2, None)
    assert _table(pg_server, schema) == model
    retry = _batches(rng, 2, count=3, rows=60, keys=80)
    sink.commit(2, _stage(sink, 2, _split(retry), attempt=1))
    _apply(model, retry)
    assert _table(pg_server, schema) == model
    sink.close()


def test_composite_key_and_columns_left_alone(pg_server: PostgresServer, schema: str,
                                              small_chunks: None) -> None:
    """Upserts update only the batch's columns; a column the batch lacks keeps its value."""
    pg_server.execute(sql.SQL(
        "CREATE TABLE {} (tenant text, id bigint, value text, note text DEFAULT 'kept', "
        "PRIMARY KEY (tenant, id))").format(sql.Identifier(schema, "events")).as_string(None),
        dbname="raysink")
    pg_server.execute(sql.SQL("ALTER TABLE {} OWNER TO raysink").format(
        sql.Identifier(schema, "events")).as_string(None), dbname="raysink")
    sink = _sink(pg_server, schema, "prepared", key=["tenant", "id"])
    rows = [("a", i % 30, f"v{i}") for i in range(120)] + [("b", i % 7, f"w{i}")
                                                           for i in range(40)]
    batch = pa.record_batch({"tenant": [r[0] for r in rows],
                             "id": pa.array([r[1] for r in rows], pa.int64()),
                             "value": [r[2] for r in rows]})
    sink.commit(1, _stage(sink, 1, {0: [batch]}))
    pg_server.execute(sql.SQL("UPDATE {} SET note = 'mine' WHERE tenant = 'b'").format(
        sql.Identifier(schema, "events")).as_string(None), dbname="raysink")
    again = pa.record_batch({"tenant": ["b"], "id": pa.array([3], pa.int64()),
                             "value": ["new"]})
    sink.commit(2, _stage(sink, 2, {0: [again]}))
    got = pg_server.execute(sql.SQL("SELECT tenant, id, value, note FROM {}").format(
        sql.Identifier(schema, "events")).as_string(None), dbname="raysink")
    expected: dict[tuple[str, int], str] = {}
    for tenant, ident, value in rows:
        expected[(tenant, ident)] = value
    expected[("b", 3)] = "new"
    assert {(t, i): v for t, i, v, _ in got} == expected
    assert {(t, n) for t, _, _, n in got} == {("a", "kept"), ("b", "mine")}
    sink.close()


def test_crash_restart_after_prepared_upserts(pg_server: PostgresServer, schema: str,
                                              small_chunks: None) -> None:
    """The writers' UNLOGGED stages are emptied by the crash; the prepared upserts are not."""
    rng = random.Random(2)
    sink = _sink(pg_server, schema, "prepared")
    model: dict[int, str] = {}
    first = _batches(rng, 1, count=4, rows=80, keys=200)
    sink.commit(1, _stage(sink, 1, _split(first)))
    _apply(model, first)
    second = _batches(rng, 2, count=4, rows=80, keys=200)
    manifests = _stage(sink, 2, _split(second))
    pg_server.restart(mode="immediate")
    sink.commit(2, manifests)
    _apply(model, second)
    assert _table(pg_server, schema) == model
    third = _batches(rng, 3, count=4, rows=80, keys=200)
    sink.commit(3, _stage(sink, 3, _split(third)))  # the stages still work
    _apply(model, third)
    assert _table(pg_server, schema) == model
    sink.close()


def _waiting_on_a_lock(pg: PostgresServer, schema: str) -> bool:
    rows = pg.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = 'raysink' AND "
        "wait_event_type = 'Lock' AND state = 'active'")
    return int(rows[0][0]) > 0


def test_next_epoch_waits_for_the_prepared_one_then_wins(
        pg_server: PostgresServer, schema: str) -> None:
    """Epoch 1 is prepared, not committed; the same writer's epoch 2 (same keys) waits for
    it instead of failing or deadlocking, and overwrites it once it is committed."""
    sink = _sink(pg_server, schema, "prepared")
    ids = pa.array(range(100), pa.int64())
    first = _stage(sink, 1, {0: [pa.record_batch({"id": ids, "value": ["one"] * 100})]})
    box: dict[str, Any] = {}

    def second_epoch() -> None:
        try:
            box["manifests"] = _stage(sink, 2, {0: [pa.record_batch(
                {"id": ids, "value": ["two"] * 100})]})
        except BaseException as exc:  # surfaced below
            box["error"] = exc

    thread = threading.Thread(target=second_epoch, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not _waiting_on_a_lock(pg_server, schema):
        assert time.monotonic() < deadline, "epoch 2 never waited for epoch 1"
        assert thread.is_alive(), f"epoch 2 went through while epoch 1 held its keys: {box}"
        time.sleep(0.05)
    sink.commit(1, first)
    thread.join(timeout=60)
    assert not thread.is_alive() and "error" not in box, box.get("error")
    assert set(_table(pg_server, schema).values()) == {"one"}
    sink.commit(2, box["manifests"])
    assert _table(pg_server, schema) == dict.fromkeys(range(100), "two")
    sink.close()


def test_keys_postgres_calls_equal_in_one_chunk(pg_server: PostgresServer,
                                                 schema: str) -> None:
    """Float keys: NaN and NaN, 0.0 and -0.0 are one key each for PostgreSQL; the last row
    of each lands, in one statement, without a cardinality error."""
    sink = PostgresSink(pg_server.dsn(), "events", schema=schema,
                        key=["k"]).bind("rt", "main")
    batch = pa.record_batch({"k": pa.array([float("nan"), 0.0, float("nan"), -0.0, 2.5]),
                             "v": pa.array([1, 2, 3, 4, 5], pa.int64())})
    sink.commit(1, _stage(sink, 1, {0: [batch]}))
    got = pg_server.execute(sql.SQL("SELECT k::text, v FROM {} ORDER BY v").format(
        sql.Identifier(schema, "events")).as_string(None), dbname="raysink")
    assert got == [("NaN", 3), ("0", 4), ("2.5", 5)] or got == [("NaN", 3), ("-0", 4),
                                                                  ("2.5", 5)]
    sink.close()


def test_null_keys_in_a_later_batch_write_nothing_of_the_epoch(
        pg_server: PostgresServer, schema: str, small_chunks: None) -> None:
    sink = _sink(pg_server, schema, "prepared")
    writer = sink.create_writer(0)
    writer.open()
    writer.write(pa.record_batch({"id": pa.array(range(120), pa.int64()),
                                  "value": ["x"] * 120}))  # two chunks sent already
    with pytest.raises(SchemaMismatchError, match="null"):
        writer.write(pa.record_batch({"id": pa.array([1, None], pa.int64()),
                                      "value": ["y", "z"]}))
    manifest = writer.pre_commit(1, 0)
    writer.close()
    sink.commit(1, [manifest])
    assert _table(pg_server, schema) == {}
    sink.close()


def test_a_lost_connection_never_commits_part_of_an_epoch(
        pg_server: PostgresServer, schema: str, small_chunks: None) -> None:
    """Chunks already upserted go with the broken transaction: a flush (the actor's timer
    calls it) sends nothing, and ``pre_commit`` fails rather than prepare the rest."""
    sink = _sink(pg_server, schema, "prepared")
    writer = sink.create_writer(0)
    writer.open()
    writer.write(pa.record_batch({"id": pa.array(range(120), pa.int64()),
                                  "value": ["x"] * 120}))  # two chunks sent, 20 rows wait
    pg_server.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE "
                      "datname = 'raysink' AND usename = 'raysink' AND pid <> "
                      "pg_backend_pid()")
    writer.flush()
    with pytest.raises(SinkUnavailableError):
        writer.pre_commit(1, 0)
    writer.rollback(1, 0)  # reconnects: the runtime rolls the attempt back, then retries
    writer.write(pa.record_batch({"id": pa.array(range(120), pa.int64()),
                                  "value": ["y"] * 120}))
    manifest = writer.pre_commit(1, 1)
    writer.close()
    sink.commit(1, [manifest])
    assert _table(pg_server, schema) == dict.fromkeys(range(120), "y")
    sink.close()
