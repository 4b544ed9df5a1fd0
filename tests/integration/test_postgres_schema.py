"""PostgresSink schema evolution against a real PostgreSQL (``pg_server``), without Ray.

Both commit methods: a column added (one writer saw it, one did not), an integer widened,
a narrower type cast up, upserts with a new column, refusals naming the column, a crash
inside the commit of a schema-changing epoch (old schema and no rows of the epoch, then
all of them once), abort and rollback leaving no stage table, a manifest naming a foreign
table refused, and a next epoch's open writer transaction that does not block the commit
of a schema change (why writers never touch the target with ``add_columns``).
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

import pyarrow as pa
import pytest
from psycopg import sql

from raysink._faults import InjectedFault
from raysink.errors import MetaStoreError, SchemaMismatchError
from raysink.sinks.base import CommitResult, Manifest
from raysink.sinks.postgres import PostgresSink
from raysink.testing import arm_fault, disarm_faults
from tests.support.postgres import PostgresServer
from tests.support.staging import stage_writers

METHODS = ["prepared", "staging"]
pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def runtime() -> Iterator[str]:
    name = f"pgs-{uuid.uuid4().hex[:8]}"
    yield name
    disarm_faults(name)


class Table:
    """The test schema's ``events`` table: its sink, its rows and its column types."""

    def __init__(self, pg: PostgresServer, schema: str, runtime: str) -> None:
        self.pg, self.schema, self.runtime = pg, schema, runtime

    def sink(self, **options: Any) -> PostgresSink:
        return PostgresSink(self.pg.dsn(), "events", schema=self.schema,
                            **options).bind(self.runtime, "main")

    def query(self, query: sql.Composable, params: Any = None) -> list[tuple[Any, ...]]:
        return self.pg.execute(query.as_string(None), params, dbname="raysink")

    def rows(self) -> list[tuple[Any, ...]]:
        return self.query(sql.SQL("SELECT * FROM {} ORDER BY id").format(
            sql.Identifier(self.schema, "events")))

    def types(self) -> dict[str, str]:
        found = self.query(sql.SQL(
            "SELECT column_name, data_type FROM information_schema.columns WHERE "
            "table_schema = {} AND table_name = 'events' ORDER BY ordinal_position").format(
                sql.Literal(self.schema)))
        return {str(n): str(t) for n, t in found}

    def stages(self) -> list[str]:
        found = self.query(sql.SQL(
            "SELECT relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE nspname = {} AND relname LIKE '\\_raysink\\_ev\\_%'").format(
                sql.Literal(self.schema)))
        return [str(r[0]) for r in found]


@pytest.fixture
def table(pg_server: PostgresServer, schema: str, runtime: str) -> Table:
    return Table(pg_server, schema, runtime)


def rows(ids: Sequence[int], **extra: pa.Array) -> pa.RecordBatch:
    columns: dict[str, pa.Array] = {"id": pa.array(ids, pa.int64()),
                                    "value": pa.array([f"v{i}" for i in ids])}
    columns.update(extra)
    return pa.record_batch(columns)


def stage(sink: PostgresSink, epoch: int, *per_writer: Sequence[pa.RecordBatch],
          attempt: int = 0) -> list[Manifest]:
    return stage_writers(sink, epoch, per_writer, attempt)


def write(sink: PostgresSink, epoch: int, *per_writer: Sequence[pa.RecordBatch]
          ) -> CommitResult:
    return sink.commit(epoch, stage(sink, epoch, *per_writer))


@pytest.mark.parametrize("method", METHODS)
def test_add_a_column_two_writers_disagreeing(table: Table, method: str) -> None:
    sink = table.sink(method=method, schema_evolution="add_columns")
    write(sink, 1, [rows([1, 2])])
    # writer 0 saw the new column, writer 1 did not: the union, nulls for writer 1's rows
    write(sink, 2, [rows([3], extra=pa.array([30], pa.int64()))], [rows([4])])
    write(sink, 3, [rows([5])])
    assert table.types() == {"id": "bigint", "value": "text", "extra": "bigint"}
    assert table.rows() == [(1, "v1", None), (2, "v2", None), (3, "v3", 30), (4, "v4", None),
                            (5, "v5", None)]
    assert table.stages() == []


@pytest.mark.parametrize("method", METHODS)
def test_the_first_epoch_creates_the_table_from_the_union(table: Table, method: str) -> None:
    sink = table.sink(method=method, schema_evolution="add_columns")
    # one writer's batches change schema within the epoch, another's lack a column
    write(sink, 1, [rows([1]), rows([2], extra=pa.array([True]))], [rows([3])])
    assert table.types() == {"id": "bigint", "value": "text", "extra": "boolean"}
    assert table.rows() == [(1, "v1", None), (2, "v2", True), (3, "v3", None)]


@pytest.mark.parametrize("method", METHODS)
def test_widen_an_integer_and_cast_a_narrower_one_up(table: Table, method: str) -> None:
    sink = table.sink(method=method, schema_evolution="add_columns")
    write(sink, 1, [rows([1], n=pa.array([1], pa.int32()), big=pa.array([7], pa.int64()))])
    assert table.types()["n"] == "integer"
    write(sink, 2, [rows([2], n=pa.array([2**40], pa.int64()), big=pa.array([8], pa.int16()))])
    assert table.types() == {"id": "bigint", "value": "text", "n": "bigint", "big": "bigint"}
    assert table.rows() == [(1, "v1", 1, 7), (2, "v2", 2**40, 8)]


@pytest.mark.parametrize("method", METHODS)
def test_upserts_with_a_new_column(table: Table, method: str) -> None:
    sink = table.sink(method=method, key=["id"], schema_evolution="add_columns")
    write(sink, 1, [rows([1, 2, 3])])
    newer = rows([2, 3, 2], extra=pa.array([20, 30, 21]))
    write(sink, 2, [newer], [rows([4])])
    # the last row per key wins; keys the epoch did not touch keep their values
    assert table.rows() == [(1, "v1", None), (2, "v2", 21), (3, "v3", 30), (4, "v4", None)]
    write(sink, 3, [rows([3])])  # a row without the column leaves it as it was
    assert table.rows()[2] == (3, "v3", 30)


@pytest.mark.parametrize(("evolution", "batch", "message", "column"), [
    # a new column without add_columns: say what to change
    ("fail", rows([2], extra=pa.array([1])), r"'extra' is not in.*schema_evolution="
                                             r"'add_columns'", "extra"),
    # text into an integer column: no widening
    ("add_columns", rows([2], n=pa.array(["x"])), r"'n' is string \(text\).*integer.*cast",
     "n"),
    # a float into an integer column: no lossless widening either
    ("add_columns", rows([2], n=pa.array([1.5])), r"'n' is double.*integer.*cast", "n"),
])
def test_refused_changes_name_the_column(table: Table, evolution: str, batch: pa.RecordBatch,
                                         message: str, column: str) -> None:
    sink = table.sink(schema_evolution=evolution)
    write(sink, 1, [rows([1], n=pa.array([1], pa.int32()))] if column == "n" else [rows([1])])
    with pytest.raises(SchemaMismatchError, match=message) as info:
        write(sink, 2, [batch])
    assert info.value.column == column
    assert [r[0] for r in table.rows()] == [1]
    assert table.stages() == []


@pytest.mark.parametrize("method", METHODS)
def test_a_crash_inside_the_commit_of_a_schema_change(table: Table, method: str) -> None:
    """``sink.mid_commit`` raises: the table keeps its schema and none of the epoch's rows;
    the re-run adds the column with every row, once; a third run finds it done."""
    sink = table.sink(method=method, schema_evolution="add_columns")
    write(sink, 1, [rows([1])])
    manifests = stage(sink, 2, [rows([2], extra=pa.array([20]))], [rows([3])])
    arm_fault(table.runtime, "sink.mid_commit", action="raise", when={"epoch": 2})
    with pytest.raises(InjectedFault):
        sink.commit(2, manifests)
    assert table.types() == {"id": "bigint", "value": "text"}
    assert table.rows() == [(1, "v1")]
    assert sink.commit(2, manifests) is CommitResult.COMMITTED
    assert sink.commit(2, manifests) is CommitResult.ALREADY
    assert table.rows() == [(1, "v1", None), (2, "v2", 20), (3, "v3", None)]
    assert table.stages() == []


@pytest.mark.parametrize("method", METHODS)
def test_abort_and_rollback_leave_no_stage(table: Table, method: str) -> None:
    sink = table.sink(method=method, schema_evolution="add_columns")
    write(sink, 1, [rows([1])])
    manifests = stage(sink, 2, [rows([2], extra=pa.array([20]))])
    assert table.stages() == ([] if method == "prepared" else [manifests[0]["evolving"]])
    sink.abort(2, None)
    sink.abort(2, None)
    writer = sink.create_writer(0)
    writer.open()
    writer.write(rows([3], extra=pa.array([30])))
    writer.pre_commit(3, 0)
    writer.rollback(3, 0)
    writer.rollback(3, 0)
    writer.close()
    assert table.stages() == [] and table.rows() == [(1, "v1")]
    assert table.types() == {"id": "bigint", "value": "text"}


def test_a_manifest_naming_another_table_is_refused(table: Table) -> None:
    sink = table.sink(method="staging", schema_evolution="add_columns")
    write(sink, 1, [rows([1])])
    hostile: Manifest = {"writer": 0, "rows": 1, "evolving": "events", "schema": None}
    with pytest.raises(MetaStoreError, match="not a stage table"):
        sink.commit(2, [hostile])
    assert table.rows() == [(1, "v1")]


def test_an_open_writer_of_the_next_epoch_does_not_block_the_schema_change(
        table: Table) -> None:
    """The commit's ``ALTER TABLE`` needs the target to itself; a writer of the next epoch
    already writing (its transaction open until its own commit) never holds the target."""
    sink = table.sink(method="prepared", schema_evolution="add_columns")
    write(sink, 1, [rows([1])])
    manifests = stage(sink, 2, [rows([2], extra=pa.array([20]))])
    nxt = sink.create_writer(1)
    nxt.open()
    nxt.write(rows([3]))  # epoch 3's transaction stays open
    done = threading.Event()
    thread = threading.Thread(target=lambda: (sink.commit(2, manifests), done.set()))
    thread.start()
    thread.join(timeout=30)
    assert done.is_set(), "the schema change waited for the next epoch's writer"
    third = nxt.pre_commit(3, 0)
    nxt.close()
    sink.commit(3, [third])
    assert table.rows() == [(1, "v1", None), (2, "v2", 20), (3, "v3", None)]


@pytest.mark.parametrize(("batch", "message"), [
    # a NOT NULL column (no default) left out
    (pa.record_batch({"id": pa.array([2], pa.int64()), "extra": pa.array([1])}),
     r"'value' is missing.*not nullable"),
    # a NOT NULL column holding a null
    (pa.record_batch({"id": pa.array([2], pa.int64()), "value": pa.array([None], pa.string())}),
     r"'value' holds 1 null.*NOT NULL"),
])
def test_not_null_columns_are_checked_at_the_write(table: Table, batch: pa.RecordBatch,
                                                   message: str) -> None:
    table.query(sql.SQL("CREATE TABLE {} (id bigint, value text NOT NULL)").format(
        sql.Identifier(table.schema, "events")))
    sink = table.sink(schema_evolution="add_columns")
    writer = sink.create_writer(0)
    writer.open()
    with pytest.raises(SchemaMismatchError, match=message) as info:
        writer.write(batch)
    assert info.value.column == "value"
    writer.close()
    assert table.stages() == [] and table.rows() == []
