"""Spark reads what raysink writes: a Delta table and an Iceberg table written by
``DeltaSink`` and ``IcebergSink`` (2 writers, ``schema_evolution="add_columns"``), read back
through Delta's and Iceberg's own Spark connectors (``tests/spark/packages.py``, cached by
``make setup``) and compared row by row with what was written and with what deltalake and
pyiceberg read.

Three epochs each; in epoch 2 one writer's rows bring a new column (the other writer's
lack it: nulls), and into Iceberg the same rows carry wider types (int to long, float to
double, a decimal's precision). The Delta table is partitioned by a date with null
partition values, and holds strings longer than the sink's statistics keep, lists and
structs; Spark's filters on it go through Delta's data skipping on the statistics raysink
wrote. The Iceberg table is partitioned (bucket of the id, truncate of a string with
nulls) and read through Iceberg's JDBC catalog over raysink's SQLite catalog, the
catalog raysink commits to.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Iterator, Sequence
from decimal import Decimal
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pyspark.sql import DataFrame, Row, SparkSession

from raysink import SinkRuntime
from raysink.sinks import DeltaSink, IcebergSink

pytestmark = pytest.mark.timeout(600)

# one task for Delta's log replay, not 50: the tables are small
SPARK_CONFIGS = {"spark.databricks.delta.snapshotPartitions": "1"}

ROWS = 60  # rows per writer per epoch
_T0 = dt.datetime(2024, 3, 1, tzinfo=dt.timezone.utc)


def _ids(epoch: int, part: int) -> list[int]:
    return [epoch * 1000 + part * ROWS + i for i in range(ROWS)]


def _with_extra(table: pa.Table, dtype: pa.DataType, make: Callable[[int], Any]) -> pa.Table:
    ids = table.column("id").to_pylist()
    return table.append_column(pa.field("extra", dtype), pa.array(map(make, ids), dtype))


# --- rows as both sides see them -------------------------------------------------------


def _plain(value: Any) -> Any:
    """A value in one comparable form: structs as tuples, binaries as bytes, timestamps
    aware in UTC (PySpark collects them naive, in the local zone)."""
    if isinstance(value, Row):
        return tuple(_plain(v) for v in value)
    if isinstance(value, dict):
        return tuple(_plain(v) for v in value.values())
    if isinstance(value, list):
        return tuple(_plain(v) for v in value)
    if isinstance(value, bytearray | bytes):
        return bytes(value)
    if isinstance(value, dt.datetime):
        return value.astimezone(dt.timezone.utc)
    return value


def _rows(records: Sequence[dict[str, Any]], columns: Sequence[str]) -> list[tuple[Any, ...]]:
    return sorted((tuple(_plain(r[c]) for c in columns) for r in records), key=lambda r: r[0])


def _spark_rows(df: DataFrame, columns: Sequence[str]) -> list[tuple[Any, ...]]:
    return _rows([row.asDict(recursive=False) for row in df.collect()], columns)


def _arrow_rows(table: pa.Table, columns: Sequence[str]) -> list[tuple[Any, ...]]:
    return _rows(table.to_pylist(), columns)


def _written(parts: Sequence[pa.Table], schema: pa.Schema) -> pa.Table:
    """The parts as one table of the final schema: missing columns null, types cast up."""
    aligned = []
    for part in parts:
        columns = [part.column(f.name).cast(f.type) if f.name in part.column_names
                   else pa.nulls(part.num_rows, f.type) for f in schema]
        aligned.append(pa.table(columns, schema=schema))
    return pa.concat_tables(aligned)


def _runtime(name: str, tmp_path: Path, sink: Any) -> SinkRuntime:
    return SinkRuntime(name, sink, writers=2, metastore=f"sqlite:///{tmp_path / 'meta.db'}",
                       progress=False)


# --- Delta ------------------------------------------------------------------------------

DELTA_SCHEMA = pa.schema([
    pa.field("id", pa.int64(), nullable=False),
    pa.field("s", pa.string()),
    pa.field("n", pa.int32()),
    pa.field("f", pa.float64()),
    pa.field("dec", pa.decimal128(10, 2)),
    pa.field("day", pa.date32()),
    pa.field("ts", pa.timestamp("us", tz="UTC")),
    pa.field("flag", pa.bool_()),
    pa.field("bin", pa.binary()),
    pa.field("tags", pa.list_(pa.string())),
    pa.field("point", pa.struct([("x", pa.int64()), ("y", pa.float64())])),
])


def _delta_part(epoch: int, part: int) -> pa.Table:
    """One writer's rows: nulls here and there, a partition date that is null for some
    rows; in epoch 1 strings longer than the statistics keep (so only the later files
    carry a string range)."""
    ids = _ids(epoch, part)
    return pa.table({
        "id": ids,
        "s": [None if i % 7 == 0 else f"long-{'x' * 40}-{i}" if epoch == 1 and i % 3 == 0
              else f"s{i}" for i in ids],
        "n": [(i % 50) - 25 for i in ids],
        "f": [i / 8 for i in ids],
        "dec": [Decimal(f"{i}.{i % 100:02d}") for i in ids],
        "day": [None if i % 11 == 0 else dt.date(2024, 1, 1 + i % 3) for i in ids],
        "ts": [_T0 + dt.timedelta(seconds=i, microseconds=i % 997) for i in ids],
        "flag": [None if i % 5 == 0 else i % 2 == 0 for i in ids],
        "bin": [bytes([i % 256, 0, 255]) for i in ids],
        "tags": [[f"t{i % 4}"] * (i % 3) if i % 13 else None for i in ids],
        "point": [{"x": i, "y": -i / 4} if i % 17 else None for i in ids],
    }, schema=DELTA_SCHEMA)


def _delta_epochs() -> dict[int, list[pa.Table]]:
    extra = pa.int64()
    return {
        1: [_delta_part(1, 0), _delta_part(1, 1)],
        2: [_delta_part(2, 0), _with_extra(_delta_part(2, 1), extra, lambda i: i * 10)],
        3: [_with_extra(_delta_part(3, p), extra, lambda i: -i) for p in (0, 1)],
    }


def test_delta_spark_reads_the_table_raysink_wrote(spark: SparkSession, tmp_path: Path,
                                                   name: str) -> None:
    path = tmp_path / "delta"
    sink = DeltaSink(str(path), partition_by=["day"], schema_evolution="add_columns")
    epochs = _delta_epochs()
    with _runtime(name, tmp_path, sink) as rt:
        for epoch, parts in epochs.items():
            assert rt.write_arrow(parts, epoch=epoch).committed

    final = DELTA_SCHEMA.append(pa.field("extra", pa.int64()))
    written = _written([p for parts in epochs.values() for p in parts], final)
    columns = final.names
    want = _arrow_rows(written, columns)

    from deltalake import DeltaTable

    table = DeltaTable(str(path))
    assert _arrow_rows(table.to_pyarrow_table(), columns) == want  # deltalake's reader

    df = spark.read.format("delta").load(str(path))
    assert sorted(df.columns) == sorted(columns)
    assert _spark_rows(df, columns) == want
    nullable = {f.name: f.nullable for f in table.schema().fields}
    assert {f.name: f.nullable for f in df.schema.fields} == nullable

    # Spark's snapshot of the newest version holds the checksum file raysink wrote (its
    # protocol and metadata come from it, sparing two jobs: raysink.sinks.delta._checksum),
    # and Spark's own check of it against the state it replays from the log passes
    delta_log = spark._jvm.org.apache.spark.sql.delta.DeltaLog  # type: ignore[attr-defined]
    snapshot = delta_log.forTable(spark._jsparkSession, str(path)).unsafeVolatileSnapshot()
    assert snapshot.version() == table.version()
    assert snapshot.checksumOpt().isDefined()
    assert snapshot.validateChecksum(getattr(snapshot, "validateChecksum$default$1")())

    # Spark's filters skip files by the statistics raysink wrote, and prune partitions:
    # a wrong minimum or maximum would lose rows here (every file has a range of n, the
    # files without epoch 1's long strings one of s)
    actions = pa.table(table.get_add_actions(flatten=True))
    assert actions.column("min.n").null_count == 0
    assert 0 < actions.column("min.s").null_count < actions.num_rows
    picked = df.where("(id BETWEEN 2050 AND 2075) OR s = 's3001' OR n = -25 OR day IS NULL")
    assert _spark_rows(picked, columns) == [
        r for r in want
        if 2050 <= r[0] <= 2075 or r[1] == "s3001" or r[2] == -25 or r[5] is None]


# --- Iceberg ----------------------------------------------------------------------------

ICEBERG_SCHEMA = pa.schema([
    pa.field("id", pa.int64(), nullable=False),
    pa.field("n", pa.int32()),
    pa.field("f", pa.float32()),
    pa.field("dec", pa.decimal128(9, 2)),
    pa.field("s", pa.string()),
    pa.field("ts", pa.timestamp("us", tz="UTC")),
    pa.field("day", pa.date32()),
])
# what epoch 2's second writer and epoch 3 send: wider types and a new column
WIDER = {"n": pa.int64(), "f": pa.float64(), "dec": pa.decimal128(18, 2)}


def _iceberg_part(epoch: int, part: int, wider: bool) -> pa.Table:
    ids = _ids(epoch, part)
    table = pa.table({
        "id": ids,
        "n": [None if i % 9 == 0 else (i % 40) - 20 for i in ids],
        "f": [i / 4 for i in ids],
        "dec": [Decimal(f"{i % 10_000}.{i % 100:02d}") for i in ids],
        "s": [None if i % 6 == 0 else f"s{i}" for i in ids],
        "ts": [_T0 + dt.timedelta(minutes=i) for i in ids],
        "day": [dt.date(2024, 2, 1 + i % 28) for i in ids],
    }, schema=ICEBERG_SCHEMA)
    if not wider:
        return table
    for column, dtype in WIDER.items():
        index = table.schema.get_field_index(column)
        table = table.set_column(index, pa.field(column, dtype), table.column(column).cast(dtype))
    return _with_extra(table, pa.string(), lambda i: f"extra-{i}")


def _iceberg_epochs() -> dict[int, list[pa.Table]]:
    return {
        1: [_iceberg_part(1, 0, False), _iceberg_part(1, 1, False)],
        2: [_iceberg_part(2, 0, False), _iceberg_part(2, 1, True)],
        3: [_iceberg_part(3, 0, True), _iceberg_part(3, 1, True)],
    }


@pytest.fixture
def iceberg_catalog(spark: SparkSession, tmp_path: Path) -> Iterator[dict[str, str]]:
    """raysink's default catalog kind (pyiceberg's SQL catalog on SQLite) under
    ``tmp_path``, and the same catalog in Spark through Iceberg's JDBC catalog: a catalog
    of the same name (the SQL catalog keeps it in every row) over the same SQLite file."""
    name = f"rb_{tmp_path.name[-8:].replace('-', '_')}"
    props = {"type": "sql", "uri": f"sqlite:///{tmp_path / 'catalog.db'}",
             "warehouse": f"file://{tmp_path / 'warehouse'}"}
    spark_conf = {
        f"spark.sql.catalog.{name}": "org.apache.iceberg.spark.SparkCatalog",
        f"spark.sql.catalog.{name}.type": "jdbc",
        f"spark.sql.catalog.{name}.uri": f"jdbc:sqlite:{tmp_path / 'catalog.db'}",
        f"spark.sql.catalog.{name}.warehouse": props["warehouse"],
    }
    for key, value in spark_conf.items():
        spark.conf.set(key, value)
    yield {"name": name, **props}
    for key in spark_conf:
        spark.conf.unset(key)


def test_iceberg_spark_reads_the_table_raysink_wrote(spark: SparkSession, tmp_path: Path,
                                                     name: str,
                                                     iceberg_catalog: dict[str, str]) -> None:
    catalog = dict(iceberg_catalog)
    catalog_name = catalog.pop("name")
    sink = IcebergSink("ns.events", catalog=catalog, catalog_name=catalog_name,
                       schema_evolution="add_columns",
                       partition_by=[("id", "bucket[2]"), ("s", "truncate[1]")])
    epochs = _iceberg_epochs()
    with _runtime(name, tmp_path, sink) as rt:
        for epoch, parts in epochs.items():
            assert rt.write_arrow(parts, epoch=epoch).committed

    final = pa.schema([ICEBERG_SCHEMA.field(n).with_type(WIDER.get(n, ICEBERG_SCHEMA.field(
        n).type)) for n in ICEBERG_SCHEMA.names]).append(pa.field("extra", pa.string()))
    columns = final.names
    want = _arrow_rows(_written([p for parts in epochs.values() for p in parts], final),
                       columns)

    from pyiceberg.catalog import load_catalog

    table = load_catalog(catalog_name, **catalog).load_table("ns.events")
    assert _arrow_rows(table.scan().to_arrow(), columns) == want  # pyiceberg's reader

    df = spark.table(f"{catalog_name}.ns.events")
    assert df.columns == columns
    types = {f.name: f.dataType.simpleString() for f in df.schema.fields}
    assert types == {"id": "bigint", "n": "bigint", "f": "double", "dec": "decimal(18,2)",
                     "s": "string", "ts": "timestamp", "day": "date", "extra": "string"}
    assert [f.name for f in df.schema.fields if not f.nullable] == ["id"]
    assert _spark_rows(df, columns) == want
    # Iceberg prunes files by the column bounds the data files were added with, those of
    # epoch 1 (and of epoch 2's first writer) in the narrower types: a bound misread after
    # the widening would lose rows
    files = table.inspect.files()
    assert all(bounds for bounds in files.column("lower_bounds").to_pylist())
    picked = df.where("n = -20 OR f = 500.25 OR dec = 2005.05 OR extra = 'extra-3001'")
    assert _spark_rows(picked, columns) == [
        r for r in want if r[1] == -20 or r[2] == 500.25 or r[3] == Decimal("2005.05")
        or r[7] == "extra-3001"]
    # the table is partitioned (bucket, truncate; nulls among the truncated strings): Spark
    # prunes by the partitions raysink recorded, with Iceberg's bucket hash as Java computes
    # it: ids of bucket 0 (by pyiceberg's reference transform) in files recorded in another
    # bucket would be lost
    from pyiceberg.transforms import BucketTransform
    from pyiceberg.types import LongType

    bucket = BucketTransform(2).transform(LongType())
    assert len({(p["id_bucket_2"], p["s_trunc_1"])
                for p in files.column("partition").to_pylist()}) == 4
    some = [r[0] for r in want[::29] if bucket(r[0]) == 0]
    assert _spark_rows(df.where(f"id IN ({', '.join(map(str, some))}) OR s IS NULL"),
                       columns) == [r for r in want if r[0] in some or r[4] is None]
    # the same table from its metadata file alone (no catalog): the same rows
    by_file = spark.read.format("iceberg").load(table.metadata_location)
    assert _spark_rows(by_file, columns) == want


def test_spark_vacuum_never_reaches_an_epoch_staged_and_pending(spark: SparkSession,
                                                                tmp_path: Path) -> None:
    """A maintained Delta sink stages under ``_raysink/``, which Spark's ``VACUUM`` skips:
    at zero retention it would delete a stray file of the table directory, never the
    files of an epoch still pending; after it, the epoch commits and Spark reads it."""
    from tests.support.staging import stage_writers

    path = tmp_path / "delta"
    sink = DeltaSink(str(path)).bind("vacuum", "main")
    first = pa.table({"id": pa.array([1, 2], pa.int64())})
    second = pa.table({"id": pa.array([3, 4], pa.int64())})
    sink.commit(1, stage_writers(sink, 1, [first.to_batches()]))
    pending = stage_writers(sink, 2, [second.to_batches()])
    staged = [str(f["path"]) for m in pending for f in m["files"]]
    assert staged and all(p.startswith("_raysink/") for p in staged), staged
    pq.write_table(first, path / "stray.parquet")  # untracked: VACUUM's to delete

    # VACUUM lists the table directory in a Spark job of
    # spark.sql.sources.parallelPartitionDiscovery.parallelism tasks (10,000 by default:
    # 416 s on two cores for a table of four files)
    settings = {"spark.databricks.delta.retentionDurationCheck.enabled": "false",
                "spark.sql.sources.parallelPartitionDiscovery.parallelism": "2"}
    for key, value in settings.items():
        spark.conf.set(key, value)
    try:
        listed = [r[0] for r in spark.sql(
            f"VACUUM delta.`{path}` RETAIN 0 HOURS DRY RUN").collect()]
        spark.sql(f"VACUUM delta.`{path}` RETAIN 0 HOURS").collect()
    finally:
        for key in settings:
            spark.conf.unset(key)
    assert any(p.endswith("/stray.parquet") for p in listed), listed
    assert not any("/_raysink/" in p for p in listed), listed
    assert all((path / p).exists() for p in staged)
    sink.commit(2, pending)
    got = spark.read.format("delta").load(str(path)).select("id").collect()
    assert sorted(r.id for r in got) == [1, 2, 3, 4]
