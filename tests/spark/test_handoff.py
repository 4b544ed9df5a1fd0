"""The Spark handoff and init_spark, on one RayDP session for the module (the ``spark``
fixture of ``tests/spark/conftest.py``)."""

from __future__ import annotations

import datetime as dt
import os
import sys
import time
from decimal import Decimal
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
import ray
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import types as T
from pyspark.sql.pandas.types import from_arrow_schema

from raysink.errors import ConfigError, SinkUnavailableError
from raysink.spark import SparkPartitions, active_spark, init_spark
from raysink.spark.session import JAVA_17_OPTIONS, _check_pyspark_python, spark_configs

pytestmark = pytest.mark.timeout(300)


# --- every type -----------------------------------------------------------------------

_SCHEMA = T.StructType([
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
    T.StructField("nothing", T.NullType()),
])

# Spark type -> the Arrow type the handoff delivers (the report's mapping table).
_EXPECTED_ARROW = {
    "id": pa.int64(),
    "i8": pa.int8(),
    "i16": pa.int16(),
    "i32": pa.int32(),
    "f32": pa.float32(),
    "f64": pa.float64(),
    "dec": pa.decimal128(10, 2),
    "dec38": pa.decimal128(38, 18),
    "s": pa.string(),
    "bin": pa.binary(),
    "flag": pa.bool_(),
    "day": pa.date32(),
    "ts": pa.timestamp("us", tz="UTC"),
    "ts_ntz": pa.timestamp("us"),
    "arr": pa.list_(pa.field("element", pa.int32())),
    "st": pa.struct([("a", pa.int64()), ("inner", pa.struct([("z", pa.string())]))]),
    "m": pa.map_(pa.field("key", pa.string(), False), pa.field("value", pa.float64())),
    "arr_st": pa.list_(pa.field("element", pa.struct([("x", pa.int32())]))),
    "nothing": pa.null(),
}

_UTC = dt.timezone.utc


def _row(i: int) -> tuple[Any, ...]:
    """Row ``i``; every third row has nulls wherever the type allows."""
    if i % 3 == 2:
        return (i, *([None] * (len(_SCHEMA.fields) - 1)))
    return (
        i, (i % 256) - 128, -i * 300, i * 70_000, i / 4, i * 1e10 + 0.5,
        Decimal(i * 101) / 100, Decimal(f"{i}.000000000000000001"),
        f"row {i} ✓", bytes([i % 256, 0, 255]), i % 2 == 0,
        dt.date(1969, 12, 31) + dt.timedelta(days=i * 40),
        dt.datetime(1969, 12, 31, 23, 59, 59, 999_999, tzinfo=_UTC) + dt.timedelta(hours=i * 7),
        dt.datetime(2024, 2, 29, 12, 30) + dt.timedelta(seconds=i),
        [i, None, -i], (i, (f"z{i}",)), {"k": float(i), "n": None}, [(i,), None], None,
    )


@pytest.fixture(scope="module")
def every_type(spark: SparkSession) -> DataFrame:
    return spark.createDataFrame([_row(i) for i in range(60)], _SCHEMA).repartition(3)


def _fetch_all(parts: SparkPartitions) -> list[pa.Table]:
    tables: dict[int, pa.Table] = {}
    for index, ref in parts.as_ready():
        tables[index] = ray.get(ref)
    assert sorted(tables) == list(range(parts.num_partitions))
    return [tables[index] for index in range(parts.num_partitions)]


def _spark_rows(df: DataFrame) -> list[dict[str, Any]]:
    """Spark's own rows as Python values, comparable with Arrow's ``to_pylist``."""
    rows = [row.asDict(recursive=True) for row in df.collect()]
    for row in rows:
        # collect() gives TimestampType as naive local time; compare instants.
        if row["ts"] is not None:
            row["ts"] = row["ts"].astimezone(_UTC)
        if row["bin"] is not None:
            row["bin"] = bytes(row["bin"])
    return sorted(rows, key=lambda row: row["id"])


def _spark_types(schema: pa.Schema) -> str:
    """The Spark types Arrow's schema maps back to (nullability aside)."""
    return from_arrow_schema(schema, prefer_timestamp_ntz=True).simpleString()


def _arrow_rows(tables: list[pa.Table]) -> list[dict[str, Any]]:
    rows = pa.concat_tables(tables).to_pylist()
    for row in rows:
        if row["m"] is not None:
            row["m"] = dict(row["m"])
    return sorted(rows, key=lambda row: row["id"])


def test_every_type_round_trips_into_arrow(every_type: DataFrame) -> None:
    with SparkPartitions.open(every_type) as parts:
        assert parts.num_partitions == 3
        tables = _fetch_all(parts)
        assert {f.name: f.type for f in parts.schema} == _EXPECTED_ARROW
        assert all(table.schema.equals(parts.schema) for table in tables)
        assert parts.schema.metadata is None
    arrow_rows, spark_rows = _arrow_rows(tables), _spark_rows(every_type)
    # Both directions: nothing of Spark's data is missing from Arrow, and Arrow holds
    # nothing Spark does not (same multiset of rows, same values).
    assert len(arrow_rows) == len(spark_rows) == 60
    assert arrow_rows == spark_rows
    # ... and the Arrow types map back to Spark's own types.
    assert _spark_types(parts.schema) == _SCHEMA.simpleString()
    assert [f.nullable for f in parts.schema] == [f.nullable for f in _SCHEMA.fields]


def test_zoned_timestamps_arrive_in_utc_whatever_the_session_zone(
    spark: SparkSession, every_type: DataFrame
) -> None:
    spark.conf.set("spark.sql.session.timeZone", "America/New_York")
    try:
        with SparkPartitions.open(every_type.select("id", "ts")) as parts:
            assert parts.schema.field("ts").type == pa.timestamp("us", tz="UTC")
            got = pa.concat_tables(_fetch_all(parts)).sort_by("id")
    finally:
        spark.conf.set("spark.sql.session.timeZone", "UTC")
    expected = [row["ts"] for row in _spark_rows(every_type)]
    assert got.column("ts").to_pylist() == expected


# --- empty DataFrames -----------------------------------------------------------------


def test_zero_rows_in_some_partitions(spark: SparkSession) -> None:
    df = spark.range(0, 30, 1, 3).where("id > 1000")
    with SparkPartitions.open(df) as parts:
        assert parts.num_partitions == 3
        tables = _fetch_all(parts)
    assert [table.num_rows for table in tables] == [0, 0, 0]
    assert all(table.schema.equals(parts.schema) for table in tables)
    assert parts.schema == pa.schema([pa.field("id", pa.int64(), nullable=False)])


@pytest.mark.parametrize(
    "build",
    [
        # spark.range(0): RayDP's own conversion throws on it
        lambda spark: spark.range(0),
        # an empty RDD, as an empty first micro-batch may be
        lambda spark: spark.createDataFrame(spark.sparkContext.emptyRDD(), "a int, b string"),
    ],
    ids=["range0", "empty-rdd"],
)
def test_zero_partitions_is_an_empty_list_with_a_schema(spark: SparkSession, build: Any) -> None:
    df = build(spark)
    with SparkPartitions.open(df) as parts:
        assert parts.num_partitions == 0
        assert parts.refs() == []
        assert parts.pulls() == []
        assert list(parts.as_ready()) == []
        assert _spark_types(parts.schema) == df.schema.simpleString()


# --- release, ownership ---------------------------------------------------------------


def test_fetching_twice_gives_the_same_partitions_and_release_is_idempotent(
        spark: SparkSession) -> None:
    df = spark.range(0, 1000, 1, 4).selectExpr("id", "CAST(id AS STRING) AS s")
    parts = SparkPartitions.open(df)
    first = ray.get(parts.refs())
    again = ray.get(parts.refs())
    assert [t.equals(a) for t, a in zip(first, again, strict=True)] == [True] * 4
    assert sum(table.num_rows for table in first) == 1000
    parts.release()
    parts.release()
    assert parts.released
    with pytest.raises(ConfigError, match="released"):
        parts.refs()
    with pytest.raises(ConfigError, match="released"):
        parts.pulls()


@ray.remote(max_restarts=0)
class _Consumer:
    def rows(self, refs: list[ray.ObjectRef[pa.Table]]) -> int:
        return sum(table.num_rows for table in ray.get(refs))

    def crash(self) -> None:
        os._exit(1)

    def pull(self, items: list[Any]) -> list[pa.Table]:
        return [item.pull() for item in items]


def test_refs_survive_a_consumer_crash(spark: SparkSession) -> None:
    with SparkPartitions.open(spark.range(0, 500, 1, 2)) as parts:
        refs = parts.refs()
        consumer = _Consumer.remote()  # type: ignore[attr-defined]
        assert ray.get(consumer.rows.remote(refs)) == 500  # refs nested in a list
        consumer.crash.remote()
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(consumer.rows.remote(refs))
        assert sum(table.num_rows for table in ray.get(refs)) == 500  # owned here


def test_pulls_in_another_process_give_exactly_what_refs_give(every_type: DataFrame) -> None:
    # what a writer actor does with the items rt.write(df) sends it: read each partition
    # from the executors itself, decode, normalise
    with SparkPartitions.open(every_type) as parts:
        items = parts.pulls(runtime="test-pulls")
        assert [item.index for item in items] == [0, 1, 2]  # type: ignore[attr-defined]
        consumer = _Consumer.remote()  # type: ignore[attr-defined]
        pulled = ray.get(consumer.pull.remote(items))
        again = ray.get(consumer.pull.remote(items))  # a pull can run again (a re-fed attempt)
        fetched = ray.get(parts.refs())
    assert len(pulled) == 3
    for got, other, ref_table in zip(pulled, again, fetched, strict=True):
        assert got.schema.equals(parts.schema) and got.equals(ref_table) and got.equals(other)
    assert _arrow_rows(pulled) == _spark_rows(every_type)


def test_pulls_need_an_opened_dataframe(ray_session: None) -> None:
    parts = SparkPartitions(schema=pa.schema([("id", pa.int64())]), num_partitions=2,
                            fetch=ray.put)
    with pytest.raises(ConfigError, match=r"SparkPartitions\.open"):
        parts.pulls()


# --- fetch timeout (the seam: a fetch that never finishes) --------------------------------


@ray.remote(num_cpus=0)
def _never(seconds: float) -> pa.Table:
    time.sleep(seconds)
    return pa.table({"id": [0]})


def test_fetch_that_never_finishes_raises_sink_unavailable(ray_session: None) -> None:
    ready = pa.table({"id": pa.array([1, 2], pa.int64())})
    stuck: list[ray.ObjectRef[pa.Table]] = []

    def fetch(index: int) -> ray.ObjectRef[pa.Table]:
        if index == 0:
            return ray.put(ready)
        stuck.append(_never.remote(600))
        return stuck[-1]

    parts = SparkPartitions(schema=ready.schema, num_partitions=2, fetch=fetch, fetch_timeout=1.0)
    got = parts.as_ready()
    index, ref = next(got)
    assert index == 0 and ray.get(ref).equals(ready)
    started = time.monotonic()
    with pytest.raises(SinkUnavailableError, match=r"partition 1 .*app master may be gone"):
        next(got)
    assert time.monotonic() - started < 10
    with pytest.raises(ray.exceptions.TaskCancelledError):  # the stuck fetch was cancelled
        ray.get(stuck[0], timeout=30)


def test_fetch_timeout_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="fetch_timeout"):
        SparkPartitions(schema=pa.schema([]), num_partitions=0, fetch=ray.put, fetch_timeout=0)


# --- init_spark errors -------------------------------------------------------------------


def _fake_java(directory: Path, version_line: str) -> None:
    java = directory / "java"
    java.write_text(f"#!/bin/sh\necho '{version_line}' >&2\n")
    java.chmod(0o755)


def test_init_spark_without_java(
    spark: SparkSession, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("JAVA_HOME", raising=False)
    with pytest.raises(ConfigError, match="apt-get install openjdk-17-jre-headless"):
        init_spark()
    assert active_spark() is spark


@pytest.mark.parametrize(
    "version_line, major",
    [
        ('openjdk version "11.0.2" 2019-01-15', 11),  # modern numbering
        ('java version "1.8.0_292"', 8),  # 1.x numbering
    ],
)
def test_init_spark_with_old_java(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, version_line: str, major: int
) -> None:
    _fake_java(tmp_path, version_line)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("JAVA_HOME", raising=False)
    with pytest.raises(ConfigError, match=f"Java {major}, .*openjdk-17-jre-headless"):
        init_spark()


def test_init_spark_checks_java_home_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "bin").mkdir()
    _fake_java(tmp_path / "bin", 'openjdk version "11.0.2"')
    monkeypatch.setenv("JAVA_HOME", str(tmp_path))
    with pytest.raises(ConfigError, match="Java 11"):
        init_spark()


def test_init_spark_on_ray_without_pyspark_python(
    spark: SparkSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PYSPARK_PYTHON")
    with pytest.raises(ConfigError, match=r"PYSPARK_PYTHON.*before ray\.init\(\)"):
        init_spark()
    assert active_spark() is spark


@pytest.mark.parametrize(
    "value, ok",
    [
        (None, False),  # unset
        ("/usr/bin/python3", False),  # another interpreter: no raysink there
        (sys.executable, True),
    ],
)
def test_pyspark_python_must_be_this_interpreter(value: str | None, ok: bool) -> None:
    if ok:
        _check_pyspark_python(value, where="test")
    else:
        with pytest.raises(ConfigError, match="PYSPARK_PYTHON"):
            _check_pyspark_python(value, where="test")


def test_second_init_spark_is_a_config_error(spark: SparkSession) -> None:
    with pytest.raises(ConfigError, match="already running"):
        init_spark()
    assert active_spark() is spark


def test_configs_merge_java_options_and_override_defaults() -> None:
    merged = spark_configs({
        "spark.executor.extraJavaOptions": "-Dmine=1",
        "spark.sql.session.timeZone": "Europe/Paris",
    })
    assert merged["spark.executor.extraJavaOptions"] == f"{JAVA_17_OPTIONS} -Dmine=1"
    assert merged["spark.driver.extraJavaOptions"] == JAVA_17_OPTIONS
    assert merged["spark.ray.raydp_app_master.extraJavaOptions"] == JAVA_17_OPTIONS
    assert merged["spark.sql.session.timeZone"] == "Europe/Paris"
    assert merged["spark.sql.execution.arrow.pyspark.enabled"] == "true"
    for package in ("java.lang", "java.math", "sun.util.calendar", "jdk.internal.ref"):
        assert f"--add-opens=java.base/{package}=ALL-UNNAMED" in JAVA_17_OPTIONS
