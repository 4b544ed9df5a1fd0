"""Partitioned Iceberg tables through IcebergSink, without Ray: Iceberg's transforms
computed in Arrow (the bucket hash against the spec's test vectors, every transform
against pyiceberg's own per-value implementation), rows landing in their partitions of
real tables (each file's recorded partition checked against its rows, scans pruned by
row filters), nulls, an existing table with an evolved spec, a spec that changes between
the writers' staging and the commit, and exactly once over a partitioned table.
"""

from __future__ import annotations

import datetime as dt
import uuid
from decimal import Decimal
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

pytest.importorskip("pyiceberg")

from pyiceberg.catalog import load_catalog
from pyiceberg.expressions import EqualTo, GreaterThanOrEqual, IsNull, StartsWith
from pyiceberg.transforms import parse_transform
from pyiceberg.types import (
    BinaryType,
    DateType,
    DecimalType,
    IntegerType,
    LongType,
    StringType,
    TimestampType,
    TimestamptzType,
)

from raysink.errors import ConfigError, SchemaMismatchError
from raysink.sinks.base import CommitResult
from raysink.sinks.iceberg import IcebergSink
from raysink.sinks.iceberg._transforms import apply_transform, hash_values
from tests.support.staging import stage_writers as stage

IDENT = "ns.events"
UTC = dt.timezone.utc


def catalog_props(root: Path) -> dict[str, str]:
    return {"type": "sql", "uri": f"sqlite:///{root / 'catalog.db'}",
            "warehouse": f"file://{root / 'warehouse'}"}


def sink_at(root: Path, **options: Any) -> IcebergSink:
    return IcebergSink(IDENT, catalog=catalog_props(root), **options).bind("rt", "main")


def table(root: Path) -> Any:
    return load_catalog("raysink", **catalog_props(root)).load_table(IDENT)


# --------------------------------------------------------------------------- transforms


@pytest.mark.parametrize(("arr", "expected"), [
    (pa.array([34], pa.int32()), 2017239379),
    (pa.array([34], pa.int64()), 2017239379),
    (pa.array([Decimal("14.20")], pa.decimal128(9, 2)), -500754589),
    (pa.array([dt.date(2017, 11, 16)], pa.date32()), -653330422),
    (pa.array([dt.time(22, 31, 8)], pa.time64("us")), -662762989),
    (pa.array([dt.datetime(2017, 11, 16, 22, 31, 8)], pa.timestamp("us")), -2047944441),
    (pa.array([dt.datetime(2017, 11, 16, 22, 31, 8, tzinfo=UTC)],
              pa.timestamp("us", tz="America/Los_Angeles")), -2047944441),
    (pa.array(["iceberg"]), 1210000089),
    (pa.array([uuid.UUID("f79c3e09-677c-4bbd-a479-3f349cb785e7").bytes], pa.binary(16)),
     1488055340),
    (pa.array([b"\x00\x01\x02\x03"], pa.binary()), -188683207),
])
def test_bucket_hash_matches_the_spec_test_vectors(arr: pa.Array, expected: int) -> None:
    """The Iceberg spec's Appendix B: murmur3_32 x86, seed 0, per type."""
    assert hash_values(arr).to_pylist() == [expected]


def _sample(kind: str) -> tuple[pa.Array, Any]:
    """Values of one Arrow type, nulls and negatives among them, and their Iceberg type."""
    stamps = [dt.datetime(1969, 12, 31, 23, 59, 59, 999_999), dt.datetime(1970, 1, 1),
              dt.datetime(2024, 2, 29, 13, 5, 1), dt.datetime(1900, 3, 1, 0, 30), None,
              dt.datetime(2038, 1, 19, 3, 14, 8)]
    samples: dict[str, tuple[pa.Array, Any]] = {
        "int": (pa.array([0, 1, -1, 7, -13, None, 2**31 - 1], pa.int32()), IntegerType()),
        "long": (pa.array([0, -1, 10**15, -(10**15) - 3, None, 99], pa.int64()), LongType()),
        "string": (pa.array(["iceberg", "", "ée€x", None, "abcdefgh"]), StringType()),
        "binary": (pa.array([b"\x00\x01\x02\x03", b"", None, b"\xff" * 9]), BinaryType()),
        "date": (pa.array([dt.date(1969, 12, 31), dt.date(1970, 1, 1), dt.date(2024, 2, 29),
                           None, dt.date(1583, 1, 1)], pa.date32()), DateType()),
        "timestamp": (pa.array(stamps, pa.timestamp("us")), TimestampType()),
        "timestamptz": (pa.array([s and s.replace(tzinfo=UTC) for s in stamps],
                                 pa.timestamp("us", tz="Europe/Paris")), TimestamptzType()),
        "decimal": (pa.array([Decimal("14.20"), Decimal("-0.05"), Decimal("0.00"), None,
                              Decimal("-128.00"), Decimal("10.65")], pa.decimal128(9, 2)),
                    DecimalType(9, 2)),
    }
    return samples[kind]


def _internal(value: Any) -> Any:
    """A Python value as pyiceberg's transforms take it (days, microseconds)."""
    if isinstance(value, dt.datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=UTC)
        return (value - dt.datetime(1970, 1, 1, tzinfo=UTC)) // dt.timedelta(microseconds=1)
    if isinstance(value, dt.date):
        return (value - dt.date(1970, 1, 1)).days
    return value


@pytest.mark.parametrize(("transform", "kinds"), [
    ("identity", ["int", "long", "string", "binary", "date", "timestamp", "decimal"]),
    ("bucket[16]", ["int", "long", "string", "binary", "date", "timestamp", "timestamptz",
                    "decimal"]),
    ("truncate[3]", ["int", "long", "string", "binary"]),
    ("truncate[50]", ["decimal"]),
    ("year", ["date", "timestamp", "timestamptz"]),
    ("month", ["date", "timestamp", "timestamptz"]),
    ("day", ["date", "timestamp", "timestamptz"]),
    ("hour", ["timestamp", "timestamptz"]),
])
def test_arrow_transforms_agree_with_pyicebergs_per_value_ones(
        transform: str, kinds: list[str]) -> None:
    for kind in kinds:
        arr, iceberg_type = _sample(kind)
        reference = parse_transform(transform).transform(iceberg_type)
        expected = [reference(_internal(v)) for v in arr.to_pylist()]
        got = apply_transform(transform, arr).to_pylist()
        if kind == "decimal" and transform != "bucket[16]":
            got = [None if g is None else Decimal(g) for g in got]
        assert got == expected, (transform, kind)


def test_transform_on_a_column_it_does_not_apply_to_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="day"):
        apply_transform("day", pa.array(["x"]))
    with pytest.raises(ConfigError, match="bucket"):
        apply_transform("bucket[4]", pa.array([1.5]))
    with pytest.raises(ConfigError, match="partition_by entries"):
        IcebergSink(IDENT, partition_by=[("ts",)])  # type: ignore[list-item]
    with pytest.raises(ConfigError, match="unknown Iceberg partition transform"):
        IcebergSink(IDENT, partition_by=[("ts", "week")])
    with pytest.raises(ConfigError, match="unknown Iceberg partition transform"):
        IcebergSink(IDENT, partition_by=[("id", "bucket[0]")])


# --------------------------------------------------------------------------- real tables


def events(ids: list[int], *, nulls: bool = False) -> pa.RecordBatch:
    base = dt.datetime(2024, 3, 30, 22, tzinfo=UTC)
    rows = {
        "id": pa.array(ids, pa.int64()),
        "ts": pa.array([base + dt.timedelta(hours=5 * i) for i in ids], pa.timestamp("us", "UTC")),
        "d": pa.array([dt.date(2023, 11, 1) + dt.timedelta(days=20 * i) for i in ids]),
        "region": pa.array([["eu", "us", "apac"][i % 3] for i in ids]),
        "name": pa.array([f"{'abc'[i % 3]}{'xyz'[i % 2]}-{i}" for i in ids]),
        "amount": pa.array([Decimal(i % 4) / 4 - 1 for i in ids], pa.decimal128(9, 2)),
    }
    if nulls:
        for column in ("ts", "d", "region", "name"):
            values = rows[column].to_pylist()
            rows[column] = pa.array([None if i % 4 == 0 else v for i, v in zip(ids, values,
                                                                                strict=True)],
                                    rows[column].type)
    return pa.record_batch(rows)


def _check_files(t: Any) -> int:
    """Every data file's recorded partition is what its spec gives each of its rows;
    returns the number of data files."""
    schema, specs = t.schema(), t.specs()
    entries = t.inspect.files().to_pylist()
    for data_file in entries:
        spec = specs[data_file["spec_id"]]
        rows = pq.ParquetFile(data_file["file_path"].removeprefix("file://")).read().to_pylist()
        recorded = data_file["partition"]
        for field in spec.fields:
            source = schema.find_field(field.source_id)
            transform = field.transform.transform(source.field_type)
            values = {transform(_internal(row[source.name])) for row in rows}
            want = recorded[field.name]
            want = _internal(want) if isinstance(want, dt.date | dt.datetime) else want
            assert values == {want}, (field.name, values, want)
    return len(entries)


def _planned(t: Any, row_filter: Any) -> tuple[int, list[int]]:
    scan = t.scan(row_filter=row_filter)
    return len(list(scan.plan_files())), sorted(scan.to_arrow().column("id").to_pylist())


SPECS = {
    "day, identity, bucket, truncate": [("ts", "day"), "region", ("id", "bucket[4]"),
                                        ("name", "truncate[1]")],
    "hour, month": [("ts", "hour"), ("d", "month")],
    "year": [("d", "year")],
    "identity of date, timestamp, decimal; bucket of decimal": [
        "d", ("ts", "identity"), "amount", ("amount", "bucket[3]")],
}


@pytest.mark.parametrize("spec", list(SPECS))
def test_rows_land_in_their_partitions_and_scans_prune(tmp_path: Path, spec: str) -> None:
    sink = sink_at(tmp_path, partition_by=SPECS[spec], max_file_rows=5)
    first, second = list(range(0, 24)), list(range(24, 40))
    assert sink.commit(1, stage(sink, 1, [[events(first[:12])], [events(first[12:])]])) \
        is CommitResult.COMMITTED
    assert sink.commit(2, stage(sink, 2, [[events(second)]])) is CommitResult.COMMITTED
    t = table(tmp_path)
    assert [(f.source_id, str(f.transform)) for f in t.spec().fields] == [
        (t.schema().find_field(e if isinstance(e, str) else e[0]).field_id,
         "identity" if isinstance(e, str) else e[1]) for e in SPECS[spec]]
    files = _check_files(t)
    assert sorted(t.scan().to_arrow().column("id").to_pylist()) == first + second
    everything = list(range(40))
    if spec.startswith("day"):
        n, ids = _planned(t, EqualTo("region", "eu"))
        assert ids == [i for i in everything if i % 3 == 0] and n < files
        n, ids = _planned(t, EqualTo("id", 7))
        assert ids == [7] and n < files / 3
        n, ids = _planned(t, StartsWith("name", "b"))
        assert ids == [i for i in everything if i % 3 == 1] and n < files
    elif spec.startswith("hour"):
        cut = dt.datetime(2024, 3, 31, 12, tzinfo=UTC)  # id 3 is at 13:00
        n, ids = _planned(t, GreaterThanOrEqual("ts", cut.isoformat()))
        assert ids == everything[3:] and n < files
    elif spec.startswith("identity"):
        n, ids = _planned(t, EqualTo("amount", Decimal("-0.25")))
        assert ids == [i for i in everything if i % 4 == 3] and n < files
        n, ids = _planned(t, EqualTo("d", "2023-11-21"))
        assert ids == [1] and n == 1
    else:
        n, ids = _planned(t, GreaterThanOrEqual("d", "2025-01-01"))
        assert ids == [i for i in everything if dt.date(2023, 11, 1)
                       + dt.timedelta(days=20 * i) >= dt.date(2025, 1, 1)] and n < files
    # max_file_rows holds per partition, and no partition holds a file of another
    assert all(r <= 5 for r in t.inspect.files().column("record_count").to_pylist())


def test_nulls_in_partition_columns_have_a_null_partition(tmp_path: Path) -> None:
    sink = sink_at(tmp_path, partition_by=SPECS["day, identity, bucket, truncate"])
    sink.commit(1, stage(sink, 1, [[events(list(range(12)), nulls=True)]]))
    t = table(tmp_path)
    _check_files(t)
    nulls = [p for p in t.inspect.files().column("partition").to_pylist()
             if p["region"] is None]
    assert nulls and all(p["ts_day"] is None and p["name_trunc_1"] is None for p in nulls)
    n, ids = _planned(t, IsNull("region"))
    assert ids == [0, 4, 8] and n == len(nulls)


def test_an_existing_table_with_an_evolved_spec_gets_files_of_its_current_spec(
        tmp_path: Path) -> None:
    catalog = load_catalog("raysink", **catalog_props(tmp_path))
    catalog.create_namespace("ns")
    t = catalog.create_table(IDENT, schema=events([0]).schema)
    with t.update_spec() as update:
        update.add_identity("region")
    t = catalog.load_table(IDENT)
    t.append(pa.Table.from_batches([events([0, 1, 2])]))  # pyiceberg's own write, spec 1
    with t.update_spec() as update:
        update.remove_field("region")
        update.add_field("ts", "day", "day")
        update.add_field("id", "bucket[8]", "shard")
    sink = sink_at(tmp_path, partition_by=["region"])  # the table's own spec wins
    sink.validate()
    sink.commit(1, stage(sink, 1, [[events(list(range(3, 20)))]]))
    t = table(tmp_path)
    spec_ids = t.inspect.files().column("spec_id").to_pylist()
    assert sorted(set(spec_ids)) == [1, 2] and spec_ids.count(1) == 3
    _check_files(t)
    n, ids = _planned(t, EqualTo("id", 11))
    assert ids == [11] and n < len(spec_ids) / 4
    assert sorted(t.scan().to_arrow().column("id").to_pylist()) == list(range(20))


def test_a_spec_changed_between_staging_and_commit_is_split_again(tmp_path: Path) -> None:
    """The writers split by the table's spec at their first batch; the spec evolves
    before the commit, which then adds their files in the current one: a file of one
    partition as it is, one spanning several rewritten per partition."""
    sink = sink_at(tmp_path, partition_by=[("ts", "day")])
    sink.commit(1, stage(sink, 1, [[events([0, 1])]]))
    manifests = stage(sink, 2, [[events(list(range(2, 30)))]])
    with table(tmp_path).update_spec() as update:
        update.add_identity("region")
    staged = [f["path"] for m in manifests for f in m["files"]]
    assert sink.commit(2, manifests) is CommitResult.COMMITTED
    assert sink.commit(2, manifests) is CommitResult.ALREADY
    t = table(tmp_path)
    _check_files(t)
    referenced = set(t.inspect.files().column("file_path").to_pylist())
    gone = [p for p in staged if p not in referenced]
    assert gone and not any(Path(p.removeprefix("file://")).exists() for p in gone)
    assert sorted(t.scan().to_arrow().column("id").to_pylist()) == list(range(30))
    n, ids = _planned(t, EqualTo("region", "us"))
    assert ids == [i for i in range(30) if i % 3 == 1] and n < len(referenced)


def test_partitioned_commits_are_exactly_once_and_aborts_remove_staged_files(
        tmp_path: Path) -> None:
    sink = sink_at(tmp_path, partition_by=[("id", "bucket[3]")])
    manifests = stage(sink, 1, [[events(list(range(9)))], [events(list(range(9, 12)))]])
    assert sink.commit(1, manifests) is CommitResult.COMMITTED
    assert sink_at(tmp_path, partition_by=[("id", "bucket[3]")]).commit(1, manifests) \
        is CommitResult.ALREADY
    aborted = stage(sink, 2, [[events(list(range(100, 110)))]])
    sink.abort(2, aborted)
    assert not any(Path(f["path"].removeprefix("file://")).exists()
                   for m in aborted for f in m["files"])
    assert sink.committed_epoch() == 1
    assert sorted(table(tmp_path).scan().to_arrow().column("id").to_pylist()) == list(range(12))


def test_a_partition_column_missing_or_of_the_wrong_type_fails_the_write(
        tmp_path: Path) -> None:
    sink = sink_at(tmp_path, partition_by=[("ts", "day")])
    with pytest.raises(SchemaMismatchError, match="ts"):
        sink.create_writer(0).write(events([1]).drop_columns(["ts"]))
    bad = sink_at(tmp_path, partition_by=[("region", "day")])
    with pytest.raises(ConfigError, match="day"):
        bad.create_writer(0).write(events([1]))


def test_a_split_at_commit_interrupted_before_the_table_commit_is_written_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The commit splits a file staged under an older spec, then dies before its table
    commit (a coordinator crash): the commit run again writes the same files again (names
    derived from the staged file's), so the table holds each row once and no stray split
    file is left in the epoch's staging directory."""
    from raysink.sinks.iceberg import _sink as sink_module

    sink = sink_at(tmp_path, partition_by=[("ts", "day")])
    sink.commit(1, stage(sink, 1, [[events([0])]]))
    manifests = stage(sink, 2, [[events(list(range(1, 20)))]])
    with table(tmp_path).update_spec() as update:
        update.add_identity("region")
    real = sink_module.epoch_data_files

    def crash_after_the_split(*args: Any, **kwargs: Any) -> Any:
        real(*args, **kwargs)
        raise RuntimeError("killed")

    monkeypatch.setattr(sink_module, "epoch_data_files", crash_after_the_split)
    with pytest.raises(RuntimeError, match="killed"):
        sink.commit(2, manifests)
    monkeypatch.setattr(sink_module, "epoch_data_files", real)
    assert sink.committed_epoch() == 1
    assert sink.commit(2, manifests) is CommitResult.COMMITTED
    t = table(tmp_path)
    assert sorted(t.scan().to_arrow().column("id").to_pylist()) == list(range(20))
    referenced = set(t.inspect.files().column("file_path").to_pylist())
    staged_dir = Path(manifests[0]["files"][0]["path"].removeprefix("file://")).parent
    assert {f"file://{p}" for p in staged_dir.iterdir()} <= referenced
