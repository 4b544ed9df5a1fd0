"""Spark as the fresh reader of ``bench/longrun.py``'s Delta and Iceberg tables.

One RayDP session (``raysink.spark.init_spark``: 2 executors x 1 core, 1 GB, on the Ray
``bench/longrun.py`` started with ``PYSPARK_PYTHON`` set) with Delta's and Iceberg's
connectors and the SQLite JDBC driver (``raysink.spark.packages``, cached by
``make setup``). Iceberg tables are read through Iceberg's JDBC catalog over the SQLite
catalog raysink committed to, under the same catalog name (``raysink``: the SQL catalog
keeps it in every row), as ``tests/spark/test_read_back.py`` does. Each table's
``count()`` is timed twice: the first (a fresh reader: the table opened and planned
from nothing, in a session warmed up on tiny tables of its own) and a warm second one.
"""

from __future__ import annotations

import functools
import time
from pathlib import Path
from typing import Any

CATALOG = "raysink"


def _configs(root: Path) -> dict[str, str]:
    return {
        "spark.ui.showConsoleProgress": "false",
        "spark.ui.enabled": "false",
        "spark.sql.shuffle.partitions": "4",
        # Delta's log replay in 2 tasks (one per executor core), not 50
        "spark.databricks.delta.snapshotPartitions": "2",
        f"spark.sql.catalog.{CATALOG}": "org.apache.iceberg.spark.SparkCatalog",
        f"spark.sql.catalog.{CATALOG}.type": "jdbc",
        f"spark.sql.catalog.{CATALOG}.uri": f"jdbc:sqlite:{root / 'catalog.db'}",
        f"spark.sql.catalog.{CATALOG}.warehouse": f"file://{root / 'warehouse'}",
        "spark.sql.catalog.warmup": "org.apache.iceberg.spark.SparkCatalog",
        "spark.sql.catalog.warmup.type": "hadoop",
        "spark.sql.catalog.warmup.warehouse": f"file://{root / 'spark-warmup' / 'iceberg'}",
    }


def _warm_up(spark: Any, root: Path) -> None:
    """A tiny Delta and Iceberg table written and counted first, so that no table's
    first count pays the session's first job, class loading and the executors' first
    fetch of the connectors' jars (160 s for the first Delta count at load 30)."""
    delta = str(root / "spark-warmup" / "delta")
    spark.range(100).write.format("delta").mode("overwrite").save(delta)
    spark.read.format("delta").load(delta).count()
    spark.sql("CREATE TABLE IF NOT EXISTS warmup.db.t (id BIGINT) USING iceberg")
    spark.sql("INSERT INTO warmup.db.t SELECT id FROM range(100)")
    spark.table("warmup.db.t").count()


def _timed_count(read: Any) -> tuple[int, float]:
    started = time.perf_counter()
    count = int(read().count())
    return count, round(time.perf_counter() - started, 3)


def spark_counts(root: Path, kinds: list[str]) -> dict[str, dict[str, Any]]:
    """Per Delta or Iceberg sink of ``kinds``: the first and warm ``count()`` seconds and
    the counts; the session's start seconds under the key ``"session"``."""
    from raysink.spark import init_spark, stop_spark
    from raysink.spark.packages import DELTA, ICEBERG, SQLITE_JDBC

    tables = [k for k in kinds if k != "parquet"]
    if not tables:
        return {}
    started = time.perf_counter()
    spark = init_spark("raysink-longrun", executors=2, executor_cores=1,
                       executor_memory="1g", configs=_configs(root),
                       packages=(DELTA, ICEBERG, SQLITE_JDBC))
    spark.sparkContext.setLogLevel("ERROR")
    out: dict[str, dict[str, Any]] = {
        "session": {"start_s": round(time.perf_counter() - started, 1)}}
    try:
        started = time.perf_counter()
        _warm_up(spark, root)
        out["session"]["warm_up_s"] = round(time.perf_counter() - started, 1)
        for kind in tables:
            if kind.startswith("delta"):
                read = functools.partial(spark.read.format("delta").load, str(root / kind))
            else:
                read = functools.partial(spark.table,
                                         f"{CATALOG}.bench.{kind.replace('-', '_')}")
            try:
                first, first_s = _timed_count(read)
                warm, warm_s = _timed_count(read)
            except Exception as exc:  # reported per table, the others still read
                out[kind] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
                continue
            out[kind] = {"first_s": first_s, "warm_s": warm_s,
                         "counts": {"first": first, "warm": warm}}
            print(f"spark {kind}: count {first:,} in {first_s} s, again {warm_s} s",
                  flush=True)
    finally:
        stop_spark()
    return out
