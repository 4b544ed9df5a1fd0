"""Schema evolution without Ray: the rules (``raysink._schema``) and every file-based sink
on a real local table (Parquet directory, Delta table, Iceberg table in a SQLite catalog,
``ListSink``), driven by hand (writers, then the coordinator's ``commit``).

Each case stages epochs through real writers and reads the table back the way a reader
does (``pyarrow.dataset`` with the directory's schema, ``deltalake``, ``pyiceberg``,
``ListSink.read``). PostgreSQL's cases are in ``tests/integration/test_postgres_schema.py``
(they need the test server); the coordinator's agreement of writers' schemas is in
``tests/unit/test_epochs.py``; the runtime and a crash between PENDING and the commit in
``tests/integration/test_schema_runtime.py``.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.dataset as ds
import pytest

from raysink import _schema
from raysink._faults import InjectedFault
from raysink.errors import ConfigError, SchemaMismatchError
from raysink.sinks.base import CommitResult, Sink
from raysink.sinks.delta import DeltaSink
from raysink.sinks.iceberg import IcebergSink
from raysink.sinks.parquet import ParquetSink
from raysink.testing import ListSink, arm_fault, disarm_faults
from tests.support.staging import stage_writers as stage

# --------------------------------------------------------------------------- the rules


@pytest.mark.parametrize(("old", "new", "expected"), [
    (pa.int32(), pa.int64(), True),            # a wider integer of the same sign
    (pa.int64(), pa.int32(), False),           # narrower
    (pa.uint32(), pa.int64(), True),           # unsigned into a wider signed
    (pa.uint32(), pa.int32(), False),          # unsigned into a signed of the same width
    (pa.int32(), pa.uint64(), False),          # signed into unsigned loses negatives
    (pa.float32(), pa.float64(), True),        # a wider float
    (pa.int32(), pa.float64(), False),         # int to float is not a widening here
    (pa.decimal128(10, 2), pa.decimal128(20, 2), True),  # more precision, same scale
    (pa.decimal128(10, 2), pa.decimal128(20, 3), False),  # another scale
    (pa.large_string(), pa.string(), True),    # the same values, another layout
    (pa.dictionary(pa.int32(), pa.string()), pa.string(), True),
    (pa.string(), pa.int64(), False),          # another kind
])
def test_lossless(old: pa.DataType, new: pa.DataType, expected: bool) -> None:
    assert _schema.lossless(old, new) is expected


def test_union_keeps_first_seen_order_and_widens() -> None:
    a = pa.schema([pa.field("id", pa.int32(), nullable=False), ("v", pa.string())])
    b = pa.schema([pa.field("id", pa.int64(), nullable=False), ("extra", pa.float32())])
    union = _schema.union([a, b])
    assert union.names == ["id", "v", "extra"]
    assert union.field("id").type == pa.int64() and not union.field("id").nullable
    # a column one schema lacks is nullable in the union
    assert union.field("v").nullable and union.field("extra").nullable
    # a signed and an unsigned integer meet in the narrowest signed type holding both
    assert _schema.union([pa.schema([("n", pa.int8())]),
                          pa.schema([("n", pa.uint16())])]).field("n").type == pa.int32()


def test_union_without_a_common_type_names_the_column() -> None:
    with pytest.raises(SchemaMismatchError, match=r"'n'.*cast it") as info:
        _schema.union([pa.schema([("n", pa.int64())]), pa.schema([("n", pa.string())])])
    assert info.value.column == "n"


_WIDENING = _schema.Rules(target="the test target", widen=lambda old, new: True)
_FIXED = _schema.Rules(target="the test target", refuses_widening="it cannot")


def test_evolve_adds_widens_and_keeps_narrower_types() -> None:
    current = pa.schema([pa.field("id", pa.int64(), nullable=False), ("n", pa.int32()),
                         ("f", pa.float64())])
    incoming = pa.schema([("id", pa.int32()), ("n", pa.int64()), ("f", pa.float32()),
                          pa.field("extra", pa.string(), nullable=False)])
    evolution = _schema.evolve(current, incoming, _WIDENING)
    assert evolution.added == ("extra",) and evolution.widened == ("n",)
    assert evolution.schema.names == ["id", "n", "f", "extra"]
    assert evolution.schema.field("id").type == pa.int64()  # narrower data is cast up
    assert evolution.schema.field("f").type == pa.float64()
    assert evolution.schema.field("extra").nullable  # an added column is nullable
    same = _schema.evolve(current, current, _FIXED)
    assert not same.changed and same.schema.equals(current)


@pytest.mark.parametrize(("incoming", "rules", "message"), [
    # a widening the target cannot apply: says why and what to cast to
    (pa.schema([("n", pa.int64())]), _FIXED, r"'n'.*wider.*it cannot; cast the column to int32"),
    # not a widening at all
    (pa.schema([("n", pa.string())]), _WIDENING, r"'n' is string.*not a lossless.*cast the "
                                                  r"column to int32"),
    # a not-nullable column left out
    (pa.schema([("other", pa.int32())]), _WIDENING, r"'m' is missing.*not nullable"),
])
def test_evolve_refusals_name_the_column(incoming: pa.Schema, rules: _schema.Rules,
                                         message: str) -> None:
    current = pa.schema([("n", pa.int32()), pa.field("m", pa.int32(), nullable=False)])
    if "m" not in message:
        incoming = incoming.append(pa.field("m", pa.int32()))
    with pytest.raises(SchemaMismatchError, match=message) as info:
        _schema.evolve(current, incoming, rules, where={"sink": "main", "epoch": 3})
    assert info.value.column in ("n", "m") and info.value.epoch == 3


@pytest.mark.parametrize("value", ["merge", "ADD_COLUMNS", None, True])
def test_the_option_is_checked(value: Any) -> None:
    with pytest.raises(ConfigError, match="'fail' or 'add_columns'"):
        _schema.check_evolution_option("ParquetSink", value)


def test_every_sink_takes_the_option(tmp_path: Path) -> None:
    sinks = [ParquetSink(tmp_path / "p", schema_evolution="add_columns"),
             DeltaSink(str(tmp_path / "d"), schema_evolution="add_columns"),
             IcebergSink("ns.t", catalog=_catalog(tmp_path), schema_evolution="add_columns"),
             ListSink(tmp_path / "l", schema_evolution="add_columns")]
    assert {s.schema_evolution for s in sinks} == {"add_columns"}
    assert ParquetSink(tmp_path / "p").schema_evolution == "fail"  # the default
    for cls, args in [(ParquetSink, (tmp_path / "p",)), (DeltaSink, (str(tmp_path / "d"),)),
                      (ListSink, (tmp_path / "l",))]:
        with pytest.raises(ConfigError, match="schema_evolution"):
            cls(*args, schema_evolution="merge")


# --------------------------------------------------------------------------- the sinks


def _catalog(root: Path) -> dict[str, str]:
    return {"type": "sql", "uri": f"sqlite:///{root / 'catalog.db'}",
            "warehouse": f"file://{root / 'warehouse'}"}


class Local:
    """One local table of one kind: its sink, and what a reader of it sees."""

    def __init__(self, kind: str, root: Path, runtime: str) -> None:
        self.kind, self.root, self.runtime = kind, root, runtime

    def sink(self, **options: Any) -> Sink:
        path = self.root / "table"
        built: Sink
        if self.kind == "parquet":
            built = ParquetSink(path, **options)
        elif self.kind == "delta":
            built = DeltaSink(str(path), **options)
        elif self.kind == "iceberg":
            built = IcebergSink("ns.events", catalog=_catalog(self.root), **options)
        else:
            built = ListSink(path, **options)
        return built.bind(self.runtime, "main")

    def read(self) -> pa.Table:
        """Everything a reader sees, sorted by id, in the table's own schema."""
        path = self.root / "table"
        if self.kind == "parquet":
            schema = ParquetSink(path).table_schema()
            table = ds.dataset(str(path), schema=schema, format="parquet").to_table()
        elif self.kind == "delta":
            from deltalake import DeltaTable

            table = DeltaTable(str(path)).to_pyarrow_table()
        elif self.kind == "iceberg":
            from pyiceberg.catalog import load_catalog

            loaded = load_catalog("raysink", **_catalog(self.root)).load_table("ns.events")
            table = loaded.scan().to_arrow()
        else:
            table = ListSink(path).read()
        return table.sort_by("id")

    def types(self) -> dict[str, pa.DataType]:
        return {f.name: _schema.canonical(f.type) for f in self.read().schema}


KINDS = ["parquet", "delta", "iceberg", "list"]
# the targets that widen a column they hold (Delta: delta-rs cannot write the type-widening
# feature; Parquet: Spark cannot read one column in two types; ListSink: keeps epochs apart)
WIDENS = {"iceberg"}


@pytest.fixture(params=KINDS)
def local(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Local]:
    runtime = f"se-{uuid.uuid4().hex[:8]}"
    yield Local(request.param, tmp_path, runtime)
    disarm_faults(runtime)


def rows(ids: Sequence[int], **extra: pa.Array) -> pa.RecordBatch:
    columns: dict[str, pa.Array] = {"id": pa.array(ids, pa.int64()),
                                    "v": pa.array([f"v{i}" for i in ids])}
    columns.update(extra)
    return pa.record_batch(columns)




def write(sink: Sink, epoch: int, *per_writer: Sequence[pa.RecordBatch]) -> CommitResult:
    return sink.commit(epoch, stage(sink, epoch, per_writer))


def test_add_a_column(local: Local) -> None:
    sink = local.sink(schema_evolution="add_columns")
    write(sink, 1, [rows([1, 2])])
    write(sink, 2, [rows([3], extra=pa.array([30], pa.int64()))])
    write(sink, 3, [rows([4])])  # an epoch without the column: nulls there
    got = local.read()
    assert got.column_names == ["id", "v", "extra"]
    assert got.column("extra").to_pylist() == [None, None, 30, None]
    assert got.column("v").to_pylist() == ["v1", "v2", "v3", "v4"]


# (ListSink keeps its epochs apart: without add_columns it checks no epoch against another)
@pytest.mark.parametrize("local", ["parquet", "delta", "iceberg"], indirect=True)
def test_an_added_column_is_refused_by_default(local: Local) -> None:
    sink = local.sink()
    write(sink, 1, [rows([1])])
    with pytest.raises(SchemaMismatchError, match="'extra' is not in") as info:
        write(sink, 2, [rows([2], extra=pa.array([20]))])
    assert info.value.column == "extra"
    assert "schema_evolution='add_columns'" in str(info.value)
    assert local.read().column("id").to_pylist() == [1]


def test_two_writers_disagree_and_the_union_is_committed(local: Local) -> None:
    """One writer saw the new column, one did not: the union, with nulls."""
    sink = local.sink(schema_evolution="add_columns")
    write(sink, 1, [rows([1])])
    write(sink, 2, [rows([2])], [rows([3], extra=pa.array([1.5], pa.float64()))])
    got = local.read()
    assert got.column("id").to_pylist() == [1, 2, 3]
    assert got.column("extra").to_pylist() == [None, None, 1.5]


def test_one_writer_changes_schema_within_an_epoch(local: Local) -> None:
    sink = local.sink(schema_evolution="add_columns")
    write(sink, 1, [rows([1]), rows([2], extra=pa.array(["x"]))])
    got = local.read()
    assert got.column("extra").to_pylist() == [None, "x"]


def test_a_narrower_type_is_cast_up(local: Local) -> None:
    sink = local.sink(schema_evolution="add_columns")
    write(sink, 1, [rows([1], n=pa.array([10], pa.int64()))])
    write(sink, 2, [rows([2], n=pa.array([20], pa.int32()))])
    got = local.read()
    assert got.column("n").to_pylist() == [10, 20]
    if local.kind != "list":
        assert local.types()["n"] == pa.int64()


def test_a_type_is_widened_where_the_target_allows_it(local: Local) -> None:
    sink = local.sink(schema_evolution="add_columns")
    write(sink, 1, [rows([1], n=pa.array([1], pa.int32()), f=pa.array([0.5], pa.float32()))])
    wider = [rows([2], n=pa.array([2**40], pa.int64()), f=pa.array([0.25], pa.float64()))]
    if local.kind in WIDENS or local.kind == "list":
        write(sink, 2, wider)
        got = local.read()
        assert got.column("n").to_pylist() == [1, 2**40]
        if local.kind == "iceberg":
            assert local.types()["n"] == pa.int64() and local.types()["f"] == pa.float64()
        return
    with pytest.raises(SchemaMismatchError, match=r"'n'.*cast the column to int32") as info:
        write(sink, 2, wider)
    assert info.value.column == "n"
    assert local.read().column("id").to_pylist() == [1]


def test_a_change_that_is_no_widening_is_refused(local: Local) -> None:
    sink = local.sink(schema_evolution="add_columns")
    write(sink, 1, [rows([1], n=pa.array([1], pa.int64()))])
    with pytest.raises(SchemaMismatchError, match=r"'n'.*cast") as info:
        write(sink, 2, [rows([2], n=pa.array(["two"]))])
    assert info.value.column == "n"
    assert local.read().column("id").to_pylist() == [1]


def test_a_crash_inside_the_commit_of_a_schema_change(local: Local) -> None:
    """A crash at ``sink.mid_commit`` of an epoch adding a column: the atomic targets show
    the old schema and none of the epoch's rows; the re-run commits the new schema with
    every row, once; a third run finds it done."""
    sink = local.sink(schema_evolution="add_columns")
    write(sink, 1, [rows([1])])
    manifests = stage(sink, 2, [[rows([2], extra=pa.array([20]))], [rows([3])]])
    arm_fault(local.runtime, "sink.mid_commit", action="raise", when={"epoch": 2})
    with pytest.raises(InjectedFault):
        sink.commit(2, manifests)
    if local.kind != "parquet":  # a Parquet directory shows files one rename at a time
        before = local.read()
        assert before.column_names == ["id", "v"] and before.column("id").to_pylist() == [1]
    assert sink.commit(2, manifests) is CommitResult.COMMITTED
    assert sink.commit(2, manifests) is CommitResult.ALREADY
    got = local.read()
    assert got.column("id").to_pylist() == [1, 2, 3]
    assert got.column("extra").to_pylist() == [None, 20, None]


@pytest.mark.parametrize("local", ["parquet", "delta", "iceberg"], indirect=True)
def test_the_change_is_recorded_with_the_rows_in_one_commit(local: Local) -> None:
    """Delta: one log entry carries the new schema (metaData), the files and the marker;
    Iceberg: one snapshot for the epoch, written in the new schema; Parquet: the epoch's
    commit log entry records the directory's new schema."""
    sink = local.sink(schema_evolution="add_columns")
    write(sink, 1, [rows([1])])
    write(sink, 2, [rows([2], extra=pa.array([20]))], [rows([3])])
    path = local.root / "table"
    if local.kind == "delta":
        import json

        entries = sorted((path / "_delta_log").glob("*.json"))
        assert len(entries) == 2
        actions = [json.loads(line) for line in entries[-1].read_text().splitlines()]
        kinds = {next(iter(a)) for a in actions}
        assert {"metaData", "add", "txn"} <= kinds
        assert "extra" in next(a for a in actions if "metaData" in a)["metaData"]["schemaString"]
    elif local.kind == "iceberg":
        from pyiceberg.catalog import load_catalog

        table = load_catalog("raysink", **_catalog(local.root)).load_table("ns.events")
        ours = [s for s in table.snapshots()
                if s.summary is not None and s.summary.get("raysink.epoch") == "2"]
        assert len(ours) == 1
        assert "extra" in table.schemas()[ours[0].schema_id].column_names
    else:
        assert isinstance(sink, ParquetSink)
        schema = sink.table_schema()
        assert schema is not None and schema.names == ["id", "v", "extra"]


def test_delta_upserts_with_a_new_column(tmp_path: Path) -> None:
    sink = DeltaSink(str(tmp_path / "t"), mode="upsert", key=["id"],
                     schema_evolution="add_columns").bind("rt", "main")
    write(sink, 1, [rows([1, 2, 3])])
    write(sink, 2, [rows([2, 3, 2], extra=pa.array([20, 30, 21]))], [rows([4])])
    from deltalake import DeltaTable

    got = DeltaTable(str(tmp_path / "t")).to_pyarrow_table().sort_by("id")
    assert got.column("id").to_pylist() == [1, 2, 3, 4]
    assert got.column("extra").to_pylist() == [None, 21, 30, None]  # the last row per key
