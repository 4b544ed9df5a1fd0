"""``SinkRuntime.write(df)`` and ``foreach_batch`` into ParquetSink on one RayDP session.

Every result is compared through Spark in both directions (``exceptAll`` each way empty,
counts equal), so duplicates and losses both show. Map columns cannot take part in set
operations, so they are compared as their sorted entry arrays.
"""

from __future__ import annotations

import contextlib
import datetime as dt
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.dataset as ds
import pytest
from pyspark.errors import StreamingQueryException
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T

from raysink import SinkRuntime
from raysink.errors import ConfigError, SchemaMismatchError
from raysink.sinks import ParquetSink
from raysink.testing import arm_fault, disarm_faults, fired
from tests.integration.helpers import end_for_good, writer_owners

pytestmark = pytest.mark.timeout(300)


def _runtime(tmp_path: Path, name: str, **options: Any) -> SinkRuntime:
    sink = options.pop("sink", None) or ParquetSink(str(tmp_path / "table"))
    return SinkRuntime(name, sink, metastore=f"sqlite:///{tmp_path / 'meta.db'}",
                       progress=False, **options)


def _comparable(df: DataFrame) -> DataFrame:
    """``df`` with every map column as its entries sorted by key (set operations refuse
    maps)."""
    columns = [F.array_sort(F.map_entries(F.col(f.name))).alias(f.name)
               if isinstance(f.dataType, T.MapType) else F.col(f.name)
               for f in df.schema.fields]
    return df.select(*columns)


def assert_same_rows(expected: DataFrame, path: Path) -> None:
    """The Parquet directory read by Spark (with ``expected``'s schema) holds exactly
    ``expected``'s rows, duplicates counted."""
    spark = expected.sparkSession
    # pyarrow writes the proleptic Gregorian calendar Spark 3 uses; without this option
    # Spark refuses dates before 1582 in files no Spark wrote
    got = (spark.read.schema(expected.schema).option("datetimeRebaseMode", "CORRECTED")
           .parquet(str(path)))
    left, right = _comparable(expected), _comparable(got)
    assert left.exceptAll(right).count() == 0, "rows of the DataFrame missing in the table"
    assert right.exceptAll(left).count() == 0, "rows in the table not in the DataFrame"
    assert got.count() == expected.count()


def _data_files(path: Path) -> list[str]:
    return [] if not path.exists() else [p.name for p in path.glob("*.parquet")]


# --- every type -----------------------------------------------------------------------

EVERY_TYPE = T.StructType([
    T.StructField("id", T.LongType(), False),
    T.StructField("i8", T.ByteType()),
    T.StructField("i16", T.ShortType()),
    T.StructField("i32", T.IntegerType()),
    T.StructField("f32", T.FloatType()),
    T.StructField("f64", T.DoubleType()),
    T.StructField("dec", T.DecimalType(10, 2)),
    T.StructField("dec38", T.DecimalType(38, 18)),
    T.StructField("s", T.StringType()),
    T.StructField("bin", T.BinaryType()),
    T.StructField("flag", T.BooleanType()),
    T.StructField("day", T.DateType()),
    T.StructField("ts", T.TimestampType()),
    T.StructField("ts_ntz", T.TimestampNTZType()),
    T.StructField("arr", T.ArrayType(T.IntegerType())),
    T.StructField("st", T.StructType([
        T.StructField("a", T.LongType()),
        T.StructField("inner", T.StructType([T.StructField("z", T.StringType())])),
    ])),
    T.StructField("m", T.MapType(T.StringType(), T.DoubleType())),
    T.StructField("arr_st", T.ArrayType(T.StructType([T.StructField("x", T.IntegerType())]))),
])


def _row(i: int) -> tuple[Any, ...]:
    """Row ``i``; every 7th value is null (never the id), extremes on the first rows."""
    def maybe(value: Any, salt: int = 0) -> Any:
        return None if (i + salt) % 7 == 0 else value

    base = dt.datetime(2024, 2, 29, 23, 59, 59, 999_999)
    return (
        i,
        maybe([-128, 127, 0][i % 3], 1),
        maybe(-32768 + i, 2),
        maybe(2**31 - 1 - i, 3),
        maybe(float(i) / 3, 4),
        maybe(-1e300 if i == 1 else i * 1.25, 5),
        maybe(Decimal(f"{i}.{i % 100:02d}"), 6),
        maybe(Decimal(f"{10**19 + i}.{i:018d}"), 0),
        maybe(f"s-{i}-é☃" if i % 2 else "", 1),
        maybe(bytes([i % 256, 0, 255]), 2),
        maybe(i % 2 == 0, 3),
        maybe(dt.date(1, 1, 1) if i == 2 else dt.date(2000, 1, 1) + dt.timedelta(days=i), 4),
        maybe(dt.datetime(1970, 1, 1, tzinfo=dt.timezone.utc) + dt.timedelta(seconds=i * 3601.5),
              5),
        maybe(base - dt.timedelta(microseconds=i * 7), 6),
        maybe([i, None, -i] if i % 3 else [], 0),
        maybe((i, maybe((f"z{i}",), 1)), 2),
        maybe({"a": float(i), "b": None} if i % 4 else {}, 3),
        maybe([(i,), (None,)] if i % 5 else [], 4),
    )


@pytest.fixture(scope="module")
def every_type(spark: SparkSession) -> DataFrame:
    rows = [_row(i) for i in range(300)]
    return spark.createDataFrame(rows, EVERY_TYPE).repartition(3)


def test_every_type_round_trips_through_spark(spark: SparkSession, every_type: DataFrame,
                                              tmp_path: Path) -> None:
    with _runtime(tmp_path, "sw-types") as rt:
        report = rt.write(every_type)
    assert report.committed and not report.skipped and report.epoch == 1
    assert report.rows == 300
    assert_same_rows(every_type, tmp_path / "table")


def test_empty_dataframes_are_empty_epochs(every_type: DataFrame, tmp_path: Path) -> None:
    """Each kind of empty DataFrame is an epoch of its own, committed with zero rows."""
    spark = every_type.sparkSession
    empties = [
        # rows filtered away inside the partitions: 3 partitions, all empty
        every_type.where("id < 0"),
        # an empty RDD: zero partitions (RayDP's own conversion throws on it)
        spark.createDataFrame(spark.sparkContext.emptyRDD(), every_type.schema),
    ]
    with _runtime(tmp_path, "sw-empty") as rt:
        first = rt.write(every_type.where("id < 10"))
        reports = [rt.write(empty) for empty in empties]
        after = rt.write(every_type.where("id >= 290"))
    assert first.epoch == 1 and after.epoch == 4
    assert [(r.epoch, r.rows) for r in reports] == [(2, 0), (3, 0)]
    assert all(r.committed for r in reports)
    assert_same_rows(every_type.where("id < 10").union(every_type.where("id >= 290")),
                     tmp_path / "table")


# --- keyed ----------------------------------------------------------------------------


def test_keyed_rows_land_on_one_writer_each(spark: SparkSession, tmp_path: Path) -> None:
    df = spark.range(0, 6000, 1, 4).selectExpr(
        "id", "concat('c', CAST(id % 53 AS STRING)) AS customer", "id * 1.5 AS amount")
    # the same customers by write_arrow: a key lands on one writer whatever way it came
    local = pa.table({"id": pa.array(range(12_000, 12_530), pa.int64()),
                      "customer": [f"c{i % 53}" for i in range(530)],
                      "amount": pa.array([Decimal("1.5")] * 530, pa.decimal128(23, 1))})
    with _runtime(tmp_path, "sw-keyed", writers=3, key=["customer"]) as rt:
        rt.write(df)
        rt.write(df.selectExpr("id + 6000 AS id", "customer", "amount"))
        rt.write_arrow(local)
    owners = writer_owners(tmp_path / "table")
    assert len(owners) == 53
    assert all(len(w) == 1 for w in owners.values()), owners
    assert len(set().union(*owners.values())) == 3  # every writer got some keys
    local_df = spark.range(12_000, 12_530, 1, 1).selectExpr(
        "id", "concat('c', CAST((id - 12000) % 53 AS STRING)) AS customer",
        "CAST(1.5 AS DECIMAL(23, 1)) AS amount")
    assert_same_rows(df.union(df.selectExpr("id + 6000 AS id", "customer", "amount"))
                     .union(local_df), tmp_path / "table")


# --- a writer killed in the middle of a Spark epoch -----------------------------------


def test_writer_killed_mid_epoch_is_refed(spark: SparkSession, tmp_path: Path) -> None:
    name = "sw-writerkill"
    first = spark.range(0, 4000, 1, 4).selectExpr("id", "CAST(id AS STRING) AS s")
    second = spark.range(4000, 20000, 1, 8).selectExpr("id", "CAST(id AS STRING) AS s")
    disarm_faults(name)
    try:
        with _runtime(tmp_path, name, writers=2) as rt:
            rt.write(first)
            # writer 0 of "main" dies by SIGKILL after applying its first partition of epoch 2
            arm_fault(name, "writer.during_write", action="kill",
                      when={"epoch": 2, "writer": 0, "sink": "main"})
            report = rt.write(second)
            assert fired(name, "writer.during_write")
            assert report.epoch == 2 and report.committed and report.attempts == 2
            assert report.rows == 16000
            third = rt.write(first.selectExpr("id + 20000 AS id", "s"))
            assert third.epoch == 3 and third.committed
    finally:
        disarm_faults(name)
    assert_same_rows(first.union(second).union(first.selectExpr("id + 20000 AS id", "s")),
                     tmp_path / "table")


def test_a_writer_ended_for_good_after_a_probe_is_replaced(spark: SparkSession,
                                                           tmp_path: Path) -> None:
    """``write(df)`` and ``foreach_batch``: the runtime probed its actors (all well; the
    answer is kept ``ping_timeout`` seconds), then a writer is ended for good
    (``ray.kill``: Ray starts no other). The failed attempt's heal must probe again and
    replace it, so the write commits at its second attempt, and so does the query's first
    micro-batch. Before 94f0600 the heal reused the kept answer: every attempt failed on
    the dead writer (as ``write_arrow`` did in test_faults)."""
    first = spark.range(0, 3000, 1, 3).selectExpr("id", "CAST(id AS STRING) AS s")
    second = spark.range(3000, 6000, 1, 3).selectExpr("id", "CAST(id AS STRING) AS s")
    options: dict[str, Any] = {"writers": 2, "ping_timeout": 30.0, "max_attempts": 3}
    for part in ("df", "query"):
        (tmp_path / part).mkdir()
    with _runtime(tmp_path / "df", "sw-df-endforgood", **options) as rt:
        assert rt.write(first).committed
        _probe_then_end_for_good(rt, writer=0)
        report = rt.write(second)
        assert report.committed and report.attempts == 2
    assert_same_rows(first.union(second), tmp_path / "df" / "table")

    source = tmp_path / "in"
    for index in range(2):
        _feed_file(source, index, 100)
    with _runtime(tmp_path / "query", "sw-fb-endforgood", **options) as rt:
        _probe_then_end_for_good(rt, writer=1)
        query = _run_query(spark, rt, source, tmp_path / "checkpoint")
        assert query.exception() is None
        assert rt.status().last_committed_epoch == 2
    got = ds.dataset(str(tmp_path / "query" / "table")).to_table()
    assert sorted(got["id"].to_pylist()) == [*range(0, 100), *range(1000, 1100)]


def _probe_then_end_for_good(rt: SinkRuntime, *, writer: int) -> None:
    assert rt._actors is not None
    rt._actors.check_responsive()  # every actor answers, and the answer is kept
    end_for_good(rt, writer=writer)


# --- bad input ------------------------------------------------------------------------


@pytest.mark.parametrize("column", [
    # CalendarIntervalType: Spark has no Arrow form for it
    "make_interval(0, 1, 0, 2, 0, 0, 0) AS v",
    # YearMonthIntervalType: an Arrow month interval, which no file format holds
    "INTERVAL '1' YEAR AS v",
    # nested inside a struct
    "named_struct('x', id, 'y', make_interval(0, 0, 0, 1, 0, 0, 0)) AS v",
])
def test_unstorable_column_type_writes_nothing(spark: SparkSession, tmp_path: Path,
                                               column: str) -> None:
    df = spark.range(0, 10, 1, 2).selectExpr("id", column)
    with _runtime(tmp_path, "sw-badtype") as rt:
        with pytest.raises(SchemaMismatchError, match="no sink can store"):
            rt.write(df)
        assert rt.status().last_committed_epoch is None
        report = rt.write(df.select("id"))  # the same epoch, storable, goes through
    assert report.epoch == 1 and report.committed
    assert_same_rows(df.select("id"), tmp_path / "table")


def test_sink_schema_disagreeing_with_the_dataframe(spark: SparkSession,
                                                    tmp_path: Path) -> None:
    df = spark.range(0, 500, 1, 3).selectExpr("id", "CAST(id AS STRING) AS s")
    wrong = pa.schema([("id", pa.int64()), ("s", pa.int32())])
    sink = ParquetSink(str(tmp_path / "table"), schema=wrong)
    with _runtime(tmp_path, "sw-sinkschema", sink=sink) as rt:
        with pytest.raises(SchemaMismatchError):
            rt.write(df)
        assert rt.status().last_committed_epoch is None
    assert _data_files(tmp_path / "table") == []
    commits = tmp_path / "table" / "_raysink" / "commits"
    assert not commits.exists() or not list(commits.iterdir())


@pytest.fixture(scope="module")
def refusing(spark: SparkSession,
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[SinkRuntime]:
    """One runtime for the tests whose calls it refuses before any epoch starts: each
    checks that nothing was committed, so they can share it."""
    with _runtime(tmp_path_factory.mktemp("refusing"), "sw-refusing") as rt:
        yield rt


@pytest.mark.parametrize("thing", [
    pa.table({"id": [1, 2]}),  # Arrow data belongs in write_arrow
    [("a", 1)],  # plain rows
    None,
])
def test_write_without_a_dataframe_is_config_error(refusing: SinkRuntime, thing: Any) -> None:
    with pytest.raises(ConfigError, match="Spark DataFrame"):
        refusing.write(thing)
    with pytest.raises(ConfigError, match="Spark DataFrame"):
        refusing.foreach_batch(thing, 0)
    assert refusing.status().last_committed_epoch is None


def test_foreach_batch_outside_a_stream_is_config_error(spark: SparkSession,
                                                        refusing: SinkRuntime) -> None:
    with pytest.raises(ConfigError, match=r"writeStream\.foreachBatch"):
        refusing.foreach_batch(spark.range(3), 0)
    assert refusing.status().last_committed_epoch is None


# --- streaming: the runtime is bound to one query -------------------------------------


def _feed_file(directory: Path, index: int, rows: int) -> None:
    import pyarrow.parquet as pq

    directory.mkdir(parents=True, exist_ok=True)
    ids = pa.array(range(index * 1000, index * 1000 + rows), pa.int64())
    pq.write_table(pa.table({"id": ids, "s": pa.array([f"r{i}" for i in ids.to_pylist()])}),
                   directory / f"part-{index:04d}.parquet")


def _run_query(spark: SparkSession, rt: SinkRuntime, source: Path, checkpoint: Path) -> Any:
    query = (spark.readStream.schema("id long, s string").option("maxFilesPerTrigger", 1)
             .parquet(str(source)).writeStream.foreachBatch(rt.foreach_batch)
             .option("checkpointLocation", str(checkpoint))
             .trigger(availableNow=True).start())
    with contextlib.suppress(StreamingQueryException):  # a failed query: see exception()
        query.awaitTermination(timeout=240)
    return query


def test_a_second_query_needs_epoch_offset(spark: SparkSession, tmp_path: Path) -> None:
    first_in, second_in = tmp_path / "in-1", tmp_path / "in-2"
    for index in range(2):
        _feed_file(first_in, index, 100)
    _feed_file(second_in, 7, 50)
    with _runtime(tmp_path, "sw-rebind") as rt:
        query = _run_query(spark, rt, first_in, tmp_path / "ck-1")
        assert query.exception() is None
        assert rt.status().last_committed_epoch == 2
        # another query (new checkpoint location): its batch 0 would be "epoch 1, skipped"
        other = _run_query(spark, rt, second_in, tmp_path / "ck-2")
        assert other.exception() is not None and "ConfigError" in str(other.exception())
        assert rt.status().last_committed_epoch == 2
    table = spark.read.schema("id long, s string").parquet(str(tmp_path / "table"))
    assert sorted(r.id for r in table.collect()) == list(range(100)) + list(range(1000, 1100))
    with _runtime(tmp_path, "sw-rebind", epoch_offset=2) as rt:
        query = _run_query(spark, rt, second_in, tmp_path / "ck-2")
        assert query.exception() is None
        assert rt.status().last_committed_epoch == 3  # batch 0 + 1 + offset 2
    expected = spark.read.schema("id long, s string").parquet(str(first_in), str(second_in))
    assert_same_rows(expected, tmp_path / "table")


def test_a_new_query_with_a_fresh_metastore_loses_nothing(spark: SparkSession,
                                                          tmp_path: Path) -> None:
    """A query wrote 2 micro-batches; a new query (new checkpoint location, batch ids from
    0, as many batches) over the same table with a fresh meta store (the default one of a
    job started in another directory). Bound at offset 0 its batches were all reported
    skipped and none reached the table while Spark moved on. Now the query fails with a
    ``ConfigError`` naming both ways on and writes nothing; with ``epoch_offset=2`` it
    writes every row once."""
    first_in, second_in = tmp_path / "in-1", tmp_path / "in-2"
    for index in range(2):
        _feed_file(first_in, index, 100)
        _feed_file(second_in, 10 + index, 250)
    with _runtime(tmp_path, "sw-fresh") as rt:
        assert _run_query(spark, rt, first_in, tmp_path / "ck-1").exception() is None
        assert rt.status().last_committed_epoch == 2
    fresh = {"metastore": f"sqlite:///{tmp_path / 'elsewhere.db'}"}
    with SinkRuntime("sw-fresh", ParquetSink(str(tmp_path / "table")), progress=False,
                     **fresh) as rt:
        failed = _run_query(spark, rt, second_in, tmp_path / "ck-2").exception()
        assert failed is not None and "ConfigError" in str(failed), failed
        assert "metastore=" in str(failed) and "epoch_offset=2" in str(failed), failed
    table = spark.read.schema("id long, s string").parquet(str(tmp_path / "table"))
    assert table.count() == 200  # nothing of the refused query
    with SinkRuntime("sw-fresh", ParquetSink(str(tmp_path / "table")), progress=False,
                     epoch_offset=2, **fresh) as rt:
        assert _run_query(spark, rt, second_in, tmp_path / "ck-2").exception() is None
        assert rt.status().last_committed_epoch == 4
    expected = spark.read.schema("id long, s string").parquet(str(first_in), str(second_in))
    assert expected.count() == 700
    assert_same_rows(expected, tmp_path / "table")


# --- schema evolution: a DataFrame adding a column ------------------------------------


def _evolved_rows(spark: SparkSession, path: Path) -> list[tuple[Any, ...]]:
    """The Parquet directory read by Spark with schema merging, as ``(id, s, extra)``."""
    got = spark.read.option("mergeSchema", "true").parquet(str(path))
    assert got.columns == ["id", "s", "extra"]
    return sorted((r.id, r.s, r.extra) for r in got.collect())


def _expected_rows(ranges: list[tuple[int, int, bool]]) -> list[tuple[Any, ...]]:
    return sorted((i, str(i), i * 2 if extra else None)
                  for start, stop, extra in ranges for i in range(start, stop))


def test_write_a_dataframe_adding_a_column(spark: SparkSession, tmp_path: Path) -> None:
    """``write(df)`` twice, the second DataFrame with a new column: the Parquet directory
    (``add_columns``) takes it; read back through Spark with schema merging and through the
    library (``pyarrow.dataset`` in the directory's schema)."""
    sink = ParquetSink(str(tmp_path / "table"), schema_evolution="add_columns")
    base = spark.range(0, 100, 1, 2).selectExpr("id", "CAST(id AS STRING) AS s")
    with _runtime(tmp_path, "sw-evolve", sink=sink) as rt:
        assert rt.write(base.where("id < 50")).committed
        assert rt.write(base.where("id >= 50").selectExpr("*", "id * 2 AS extra")).committed
    want = _expected_rows([(0, 50, False), (50, 100, True)])
    assert _evolved_rows(spark, tmp_path / "table") == want
    table = ds.dataset(str(tmp_path / "table"), schema=sink.table_schema()).to_table()
    assert sorted(zip(*(table.column(c).to_pylist() for c in ("id", "s", "extra")),
                      strict=True)) == want


def test_foreach_batch_adding_a_column(spark: SparkSession, tmp_path: Path) -> None:
    """A stream whose second micro-batch carries a new column (the batch function adds
    it): the table evolves with that batch's epoch."""
    source = tmp_path / "in"
    for index in range(2):
        _feed_file(source, index, 20)
    sink = ParquetSink(str(tmp_path / "table"), schema_evolution="add_columns")
    with _runtime(tmp_path, "sw-evolve-stream", sink=sink) as rt:
        def batch(df: DataFrame, batch_id: int) -> None:
            rt.foreach_batch(df.selectExpr("*", "id * 2 AS extra") if batch_id else df,
                             batch_id)

        query = (spark.readStream.schema("id long, s string").option("maxFilesPerTrigger", 1)
                 .parquet(str(source)).writeStream.foreachBatch(batch)
                 .option("checkpointLocation", str(tmp_path / "ck"))
                 .trigger(availableNow=True).start())
        query.awaitTermination(timeout=240)
        assert query.exception() is None
        assert rt.status().last_committed_epoch == 2
    got = _evolved_rows(spark, tmp_path / "table")
    assert got == sorted((i, f"r{i}", i * 2 if i >= 1000 else None)
                         for i in [*range(20), *range(1000, 1020)])
