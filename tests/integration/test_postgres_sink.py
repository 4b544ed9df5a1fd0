"""PostgresSink against a real PostgreSQL (``pg_server``), driven without Ray.

Each test gets its own schema, so progress rows of ``bind("rt", "main")`` never collide.
The protocol is driven by hand: ``create_writer(k)``, ``open``, ``write``, ``pre_commit``,
then the coordinator side ``commit``/``abort``. What every sink shares (commit twice,
abort, markers, empty epochs, rollback, a crash inside commit) is in
``test_sink_contract.py``; here: concurrent and crashed servers, upserts, deleted tables and
progress rows, every refusal of ``validate()`` (authentication, reachability, privileges,
columns, ``max_prepared_transactions=0``), identifiers and types.
"""

from __future__ import annotations

import datetime as dt
import decimal
import json
import pickle
import socket
import sys
import threading
from collections.abc import Sequence
from typing import Any

import psycopg
import pyarrow as pa
import pytest
from psycopg import sql

from raysink.errors import ConfigError, DataLossError, SchemaMismatchError, SinkUnavailableError
from raysink.sinks.base import Manifest
from raysink.sinks.postgres import PostgresSink, arrow_to_postgres_type
from tests.support.postgres import PostgresServer
from tests.support.staging import stage_writers

METHODS = ["prepared", "staging"]
pytestmark = pytest.mark.timeout(120)


def make_sink(pg: PostgresServer, schema: str, table: str = "events", *,
              runtime: str = "rt", **options: Any) -> PostgresSink:
    return PostgresSink(pg.dsn(), table, schema=schema, **options).bind(runtime, "main")


def batch(ids: Sequence[int | None], values: Sequence[Any] | None = None) -> pa.RecordBatch:
    vals = list(values) if values is not None else [f"v{i}" for i in ids]
    return pa.record_batch({"id": pa.array(ids, pa.int64()), "value": pa.array(vals, pa.string())})


def stage_epoch(sink: PostgresSink, epoch: int, per_writer: dict[int, list[pa.RecordBatch]],
                attempt: int = 0) -> list[Manifest]:
    return stage_writers(sink, epoch, per_writer, attempt)


def rows(pg: PostgresServer, schema: str, table: str = "events",
         order: str = "id") -> list[tuple[Any, ...]]:
    query = sql.SQL("SELECT * FROM {} ORDER BY {}").format(
        sql.Identifier(schema, table), sql.Identifier(order))
    return pg.execute(query.as_string(None), dbname="raysink")


def count(pg: PostgresServer, schema: str, table: str = "events") -> int:
    query = sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(schema, table))
    return int(pg.execute(query.as_string(None), dbname="raysink")[0][0])


# ----------------------------------------------------------------------------- commit


@pytest.mark.parametrize("method", METHODS)
def test_two_stale_instances_commit_rows_once(
    pg_server: PostgresServer, schema: str, method: str
) -> None:
    sink = make_sink(pg_server, schema, method=method)
    manifests = stage_epoch(sink, 1, {0: [batch(range(100))], 1: [batch(range(100, 150))]})
    twins = [pickle.loads(pickle.dumps(sink)) for _ in range(2)]
    errors: list[BaseException] = []

    def commit(s: PostgresSink) -> None:
        try:
            s.commit(1, manifests)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=commit, args=(s,)) for s in twins]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert count(pg_server, schema) == 150
    for s in twins:
        s.close()


@pytest.mark.parametrize("method", METHODS)
def test_crash_restart_after_pre_commit_loses_nothing(
    pg_server: PostgresServer, schema: str, method: str
) -> None:
    sink = make_sink(pg_server, schema, method=method)
    assert sink.committed_epoch() is None  # caches a connection that the crash breaks
    manifests = stage_epoch(sink, 1, {0: [batch(range(500))], 1: [batch(range(500, 800))]})
    pg_server.restart(mode="immediate")
    sink.commit(1, manifests)
    assert count(pg_server, schema) == 800
    assert sink.committed_epoch() == 1
    sink.close()


@pytest.mark.parametrize("method", METHODS)
def test_upsert_keeps_last_value_per_key(
    pg_server: PostgresServer, schema: str, method: str
) -> None:
    sink = make_sink(pg_server, schema, method=method, key=["id"])
    e1 = stage_epoch(sink, 1, {
        0: [batch([1, 2, 1], ["a", "b", "c"]), batch([2, 1], ["d", "e"])],  # 1->e, 2->d
        1: [batch([10, 10, 11], ["x", "y", "z"])],                          # 10->y, 11->z
    })
    sink.commit(1, e1)
    e2 = stage_epoch(sink, 2, {0: [batch([1, 3], ["f", "g"])], 1: [batch([11], ["w"])]})
    sink.commit(2, e2)
    sink.commit(2, e2)
    assert rows(pg_server, schema) == [(1, "f"), (2, "d"), (3, "g"), (10, "y"), (11, "w")]
    sink.close()


def test_pre_commit_twice_returns_the_same_manifest(
    pg_server: PostgresServer, schema: str
) -> None:
    sink = make_sink(pg_server, schema, method="staging")
    writer = sink.create_writer(0)
    writer.open()
    writer.write(batch([1]))
    first = writer.pre_commit(1, 0)
    assert writer.pre_commit(1, 0) == first
    writer.close()
    sink.commit(1, [first])
    assert count(pg_server, schema) == 1
    sink.close()


# ----------------------------------------------------------------------------- markers


def test_progress_table_deleted_gives_the_coordinator_the_facts(
    pg_server: PostgresServer, schema: str
) -> None:
    sink = make_sink(pg_server, schema)
    sink.commit(1, stage_epoch(sink, 1, {0: [batch([1])]}))
    pg_server.execute(f'DROP TABLE "{schema}"._raysink_progress', dbname="raysink")
    assert sink.committed_epoch() is None
    assert sink.target_exists()
    sink.recreate_marker(1)
    sink.recreate_marker(1)
    assert sink.committed_epoch() == 1
    sink.close()


def test_target_deleted_after_commits_is_data_loss(pg_server: PostgresServer, schema: str) -> None:
    sink = make_sink(pg_server, schema)
    sink.commit(1, stage_epoch(sink, 1, {0: [batch([1])]}))
    pg_server.execute(f'DROP TABLE "{schema}".events', dbname="raysink")
    assert not sink.target_exists()
    writer = sink.create_writer(0)
    with pytest.raises(DataLossError, match="deleted after raysink committed"):
        writer.open()
    assert not sink.target_exists()  # never silently re-created
    sink.close()


def test_target_that_never_received_data_is_created(
    pg_server: PostgresServer, schema: str
) -> None:
    arrow_schema = pa.schema([("id", pa.int64()), ("value", pa.string())])
    sink = make_sink(pg_server, schema, arrow_schema=arrow_schema)
    writer = sink.create_writer(0)
    writer.open()
    assert sink.target_exists()
    pg_server.execute(f'DROP TABLE "{schema}".events', dbname="raysink")
    writer.close()
    writer = sink.create_writer(0)
    writer.open()  # no progress rows yet: re-created
    assert sink.target_exists()
    writer.close()
    sink.close()


# ----------------------------------------------------------------------------- validate


def test_wrong_password_is_unavailable_and_redacted(
    pg_server: PostgresServer, schema: str
) -> None:
    secret = "hunter2-wrong-secret"
    sink = PostgresSink(pg_server.dsn(password=secret), "events", schema=schema).bind("rt", "m")
    with pytest.raises(SinkUnavailableError, match="authentication failed for user 'raysink'") \
            as info:
        sink.validate()
    good = pg_server.password("raysink")
    for text in (str(info.value), repr(info.value), repr(sink), json.dumps(sink.describe())):
        assert secret not in text and good not in text
    ok = make_sink(pg_server, schema)
    assert good not in repr(ok) and good not in json.dumps(ok.describe())


def test_unreachable_host_is_unavailable(schema: str) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sink = PostgresSink(f"postgresql://raysink:pw-secret@127.0.0.1:{port}/raysink",
                        "events", connect_timeout=2).bind("rt", "main")
    with pytest.raises(SinkUnavailableError, match="unreachable") as info:
        sink.validate()
    assert "pw-secret" not in str(info.value)


_USAGE = "GRANT USAGE ON SCHEMA {schema} TO reader"
_INSERT = "GRANT INSERT ON {schema}.events TO reader"


@pytest.mark.parametrize(("grants", "user", "options", "match"), [
    # the schema does not exist
    ([], "raysink", {"schema": "nowhere"}, "schema 'nowhere' does not exist; create it first"),
    # a role without USAGE on the schema
    ([], "reader", {}, "lacks the USAGE privilege on schema"),
    # the table exists; the role may not INSERT into it
    ([_USAGE], "reader", {}, "lacks the INSERT privilege on table"),
    # INSERT granted, but no CREATE for raysink's progress table
    ([_USAGE, _INSERT], "reader", {}, "CREATE privilege on schema .*_raysink_progress"),
    # an upsert reads and updates rows too: SELECT is missing
    ([_USAGE, _INSERT], "reader", {"key": ["id"]}, "lacks the SELECT privilege on table"),
    # no table, and no CREATE to make it
    ([_USAGE], "reader", {"table": "absent"}, "CREATE privilege on schema .*the target table"),
    # no table, and create_table=False
    ([], "raysink", {"table": "absent", "create_table": False},
     "absent does not exist and create_table=False"),
])
def test_validate_refusals(pg_server: PostgresServer, schema: str, grants: list[str], user: str,
                           options: dict[str, Any], match: str) -> None:
    pg_server.execute(f'CREATE TABLE "{schema}".events (id bigint, value text)', dbname="raysink")
    for grant in grants:
        pg_server.execute(grant.format(schema=f'"{schema}"'), dbname="raysink")
    options = {"schema": schema, **options}
    table = options.pop("table", "events")
    sink = PostgresSink(pg_server.dsn(user=user), table, **options).bind("rt", "main")
    with pytest.raises(SinkUnavailableError, match=match):
        sink.validate()


def test_prepared_is_refused_where_the_server_disables_prepared_transactions() -> None:
    server = PostgresServer(settings={"max_prepared_transactions": "0"})
    try:
        server.start()
        dsn = server.dsn(server.superuser, dbname="postgres")
        with pytest.raises(SinkUnavailableError,
                           match=r"max_prepared_transactions > 0 .*or use method='staging'"):
            PostgresSink(dsn, "events", method="prepared").bind("rt", "main").validate()
        PostgresSink(dsn, "events", method="staging").bind("rt", "main").validate()
    finally:
        server.cleanup()


def test_table_whose_columns_disagree(pg_server: PostgresServer, schema: str) -> None:
    pg_server.execute(f'CREATE TABLE "{schema}".events (id bigint, name text)', dbname="raysink")
    pg_server.execute(f'ALTER TABLE "{schema}".events OWNER TO raysink', dbname="raysink")
    arrow_schema = pa.schema([("id", pa.int64()), ("value", pa.float64())])
    sink = make_sink(pg_server, schema, arrow_schema=arrow_schema)
    with pytest.raises(SchemaMismatchError, match="value"):
        sink.validate()
    wrong_type = make_sink(pg_server, schema,
                           arrow_schema=pa.schema([("id", pa.int64()), ("name", pa.bool_())]))
    with pytest.raises(SchemaMismatchError, match="name is text"):
        wrong_type.validate()
    writer = make_sink(pg_server, schema).create_writer(0)
    writer.open()
    with pytest.raises(SchemaMismatchError, match="not in the table"):
        writer.write(batch([1]))
    writer.close()


def test_validate_creates_nothing(pg_server: PostgresServer, schema: str) -> None:
    def relations() -> list[tuple[Any, ...]]:
        return pg_server.execute("SELECT oid, relname FROM pg_class ORDER BY oid",
                                 dbname="raysink")

    before = relations()
    for method in METHODS:
        for key in (None, ["id"]):
            make_sink(pg_server, schema, method=method, key=key,
                      arrow_schema=pa.schema([("id", pa.int64())])).validate()
    assert relations() == before


# ----------------------------------------------------------------------------- data


@pytest.mark.parametrize("method", METHODS)
def test_null_key_values_write_nothing(
    pg_server: PostgresServer, schema: str, method: str
) -> None:
    sink = make_sink(pg_server, schema, method=method, key=["id"])
    writer = sink.create_writer(0)
    writer.open()
    writer.write(batch([1, 2]))
    with pytest.raises(SchemaMismatchError, match="null"):
        writer.write(batch([3, None]))
    writer.rollback(1, 0)
    writer.close()
    sink.abort(1, None)
    assert count(pg_server, schema) == 0


@pytest.mark.parametrize("method", METHODS)
def test_hostile_identifiers_do_not_inject(
    pg_server: PostgresServer, schema: str, method: str
) -> None:
    pg_server.execute(f'CREATE TABLE "{schema}".victim (x int)', dbname="raysink")
    table = 'ev"; DROP TABLE victim; --'
    column = "va'l\"; DROP TABLE victim; --"
    sink = make_sink(pg_server, schema, table, method=method, key=["id"]).bind(
        "rt'; --", 'ma"in')
    data = pa.record_batch({"id": pa.array([1, 1]), column: pa.array(["a'b", 'c";d'])})
    sink.validate()
    sink.commit(1, stage_epoch(sink, 1, {0: [data]}))
    assert rows(pg_server, schema, table) == [(1, 'c";d')]
    assert count(pg_server, schema, "victim") == 0  # still there
    assert sink.committed_epoch() == 1
    sink.close()


def test_types_round_trip(pg_server: PostgresServer, schema: str) -> None:
    now = dt.datetime(2024, 5, 6, 7, 8, 9, 123456)
    data = pa.record_batch({
        "i8": pa.array([1, None], pa.int8()), "u64": pa.array([2**64 - 1, 0], pa.uint64()),
        "f": pa.array([1.5, float("nan")]), "d": pa.array([decimal.Decimal("1.25"), None],
                                                         pa.decimal128(6, 2)),
        "s": pa.array(["", None]), "b": pa.array([b"\x00\xff", None]),
        "ok": pa.array([True, False]), "day": pa.array([dt.date(2024, 1, 2), None]),
        "ts": pa.array([now, None], pa.timestamp("us")),
        "tz": pa.array([now, None], pa.timestamp("us", "UTC")),
        "nested": pa.array([{"a": [1, 2]}, None]), "tags": pa.array([["x"], []]),
        "cat": pa.array(["p", "q"]).dictionary_encode(),
    })
    sink = make_sink(pg_server, schema, "typed")
    sink.commit(1, stage_epoch(sink, 1, {0: [data]}))
    got = rows(pg_server, schema, "typed", order="ok")
    assert got[1] == (1, decimal.Decimal(2**64 - 1), 1.5, decimal.Decimal("1.25"), "",
                      b"\x00\xff", True, dt.date(2024, 1, 2), now,
                      now.replace(tzinfo=dt.timezone.utc), {"a": [1, 2]}, ["x"], "p")
    assert got[0][0] is None and got[0][4] is None and got[0][11] == []
    sink.close()


@pytest.mark.parametrize(("dtype", "pg_type"), [
    (pa.int32(), "integer"),                        # plain ints
    (pa.float32(), "real"),                         # floats
    (pa.decimal128(10, 3), "numeric(10,3)"),        # decimals keep precision and scale
    (pa.large_string(), "text"),                    # any string
    (pa.timestamp("ns", "Europe/Paris"), "timestamptz"),  # zoned timestamps
    (pa.list_(pa.int64()), "jsonb"),                # nested as JSON
])
def test_arrow_type_mapping(dtype: pa.DataType, pg_type: str) -> None:
    assert arrow_to_postgres_type("c", dtype) == pg_type


def test_unstorable_type_names_column_and_type() -> None:
    with pytest.raises(SchemaMismatchError, match=r"'span'.*duration"):
        arrow_to_postgres_type("span", pa.duration("s"))


def test_missing_psycopg_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "psycopg", None)
    with pytest.raises(ConfigError, match=r"pip install 'raysink\[postgres\]'"):
        PostgresSink("postgresql://x@127.0.0.1/x", "t")


def test_psycopg_is_the_real_one() -> None:
    assert psycopg.__version__.startswith("3.")
