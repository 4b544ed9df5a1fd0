"""Spark as the fresh reader of ``bench/longrun.py``'s Delta and Iceberg tables, beside
the same rows written in one go (the floor), in the same session.

One RayDP session (``raysink.spark.init_spark``: 2 executors x 1 core, 1 GB, on the Ray
``bench/longrun.py`` started with ``PYSPARK_PYTHON`` set) with Delta's and Iceberg's
connectors and the SQLite JDBC driver (``raysink.spark.packages``, cached by
``make setup``). Iceberg tables are read through Iceberg's JDBC catalog over the SQLite
catalog raysink committed to, under the same catalog name (``raysink``: the SQL catalog
keeps it in every row), as ``tests/spark/test_read_back.py`` does.

What is timed, per table: what a user's Spark application does to count a table it has
not read before: ``spark.read.format("delta").load(path)`` or ``spark.table(name)`` (the
open: Delta reads the log up to a snapshot, Iceberg loads the metadata) and ``count()``
(Delta answers it from the files' ``numRecords`` stats, Iceberg from the manifests'
record counts: neither reads data files). Then the same again (warm: the snapshot is
cached). Then the fresh read again, ``repeats - 1`` times, each after the session's
caches of the table are dropped (Delta's snapshot cache, Iceberg's catalog cache): a
range rather than one sample on a loaded machine. Not timed: the session's start and a
warm-up on tiny tables of its own, written outside this session (by deltalake and
pyiceberg, as raysink's are) and read the same way, so that the timed read pays neither
the JVMs' first class loading and fetch of the connectors' jars (160 s for a first Delta
count at load 30) nor a path the warm-up left cold (a table written by the session
itself is read from its cached snapshot; the Delta one has a checkpoint and a commit
after it, so the checkpoint's Parquet is read too). Each count reports its Spark jobs
(how many, their seconds): each job costs 0.2-6 s on the loaded 2-core machine here,
whatever it reads.

The floor (``--spark-floor``, on by default): ``delta-floor`` and ``iceberg-floor``, the
same number of rows written in one commit (one log entry, one file), counted in the same
session after the sinks' tables: the part of a count no maintenance can remove.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa

CATALOG = "raysink"
FLOORS = {"delta": "delta-floor", "iceberg": "iceberg-floor"}


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
    }


def _rows(n: int) -> pa.Table:
    return pa.table({"id": pa.array(range(n), pa.int64()),
                     "day": pa.array([f"d{(i // 100_000) % 30:02d}" for i in range(n)]),
                     "value": pa.array([float(i % 1000) for i in range(n)], pa.float64())})


def _iceberg_catalog(root: Path) -> Any:
    from pyiceberg.catalog import load_catalog

    return load_catalog(CATALOG, type="sql", uri=f"sqlite:///{root / 'catalog.db'}",
                        warehouse=f"file://{root / 'warehouse'}")


def write_one_go(root: Path, fmt: str, name: str, rows: int) -> None:
    """``rows`` rows in one commit: a Delta table at ``root/name`` or an Iceberg table
    ``bench.<name>`` in the sinks' catalog (replaced when there)."""
    table = _rows(rows)
    if fmt == "delta":
        import deltalake

        shutil.rmtree(root / name, ignore_errors=True)  # one commit, even on a re-run
        deltalake.write_deltalake(str(root / name), table)
        return
    catalog = _iceberg_catalog(root)
    ident = f"bench.{name.replace('-', '_')}"
    catalog.create_namespace_if_not_exists("bench")
    if catalog.table_exists(ident):
        catalog.drop_table(ident)
    catalog.create_table(ident, schema=table.schema).append(table)


def _reader(spark: Any, root: Path, fmt: str, name: str) -> Callable[[], Any]:
    if fmt == "delta":
        return lambda: spark.read.format("delta").load(str(root / name))
    return lambda: spark.table(f"{CATALOG}.bench.{name.replace('-', '_')}")


def _warm_up(spark: Any, root: Path, formats: set[str]) -> None:
    """A tiny table per format, written outside the session, opened and counted twice."""
    for fmt in sorted(formats):
        name = f"warmup-{fmt}"
        write_one_go(root, fmt, name, 100)
        if fmt == "delta":  # a checkpoint and a commit after it, as a maintained table has
            import deltalake

            deltalake.DeltaTable(str(root / name)).create_checkpoint()
            deltalake.write_deltalake(str(root / name), _rows(10), mode="append")
        for _ in range(2):
            _reader(spark, root, fmt, name)().count()


class _Jobs:
    """The Spark jobs run since ``mark()``: how many, and their seconds summed."""

    def __init__(self, spark: Any) -> None:
        self.store = spark._jsc.sc().statusStore()
        self.since = self._next()

    def _next(self) -> int:
        jobs = self.store.jobsList(None)
        return max((jobs.apply(i).jobId() for i in range(jobs.size())), default=-1) + 1

    def mark(self) -> None:
        self.since = self._next()

    def report(self) -> dict[str, float]:
        jobs = self.store.jobsList(None)
        seconds, count = 0.0, 0
        for i in range(jobs.size()):
            job = jobs.apply(i)
            if job.jobId() < self.since:
                continue
            count += 1
            start, end = job.submissionTime(), job.completionTime()
            if start.isDefined() and end.isDefined():
                seconds += (end.get().getTime() - start.get().getTime()) / 1000
        return {"jobs": count, "jobs_s": round(seconds, 3)}


def _forget(spark: Any, kind: str) -> None:
    """Drop what the session keeps of a table it read, so that the next read opens it as
    a fresh reader does (the JVMs stay warm): Delta's snapshot cache, Iceberg's catalog
    cache."""
    if kind.startswith("delta"):
        spark._jvm.org.apache.spark.sql.delta.DeltaLog.clearCache()
    else:
        spark.catalog.refreshTable(f"{CATALOG}.bench.{kind.replace('-', '_')}")


def _timed_count(read: Callable[[], Any], jobs: _Jobs) -> dict[str, Any]:
    jobs.mark()
    started = time.perf_counter()
    frame = read()
    opened = time.perf_counter()
    count = int(frame.count())
    done = time.perf_counter()
    return {"rows": count, "s": round(done - started, 3), "open_s": round(opened - started, 3),
            "count_s": round(done - opened, 3), **jobs.report()}


def spark_counts(root: Path, kinds: list[str], floor_rows: int | None = None,
                 repeats: int = 3) -> dict[str, dict[str, Any]]:
    """Per Delta or Iceberg sink of ``kinds`` (and per floor, when ``floor_rows`` is
    given): the first and warm count, each with its open and count seconds and its Spark
    jobs; then ``repeats - 1`` fresh reads more, each after ``_forget``; ``first_s``,
    ``warm_s``, ``fresh_s`` (every fresh read's seconds, sorted) and ``counts`` for the
    verdicts. The session's start
    and warm-up seconds under the key ``"session"``."""
    from raysink.spark import init_spark, stop_spark
    from raysink.spark.packages import DELTA, ICEBERG, SQLITE_JDBC

    tables = [k for k in kinds if k != "parquet"]
    if not tables:
        return {}
    formats = {k.split("-")[0] for k in tables}
    floors = [FLOORS[f] for f in sorted(formats)] if floor_rows else []
    started = time.perf_counter()
    for name in floors:
        write_one_go(root, name.split("-")[0], name, floor_rows or 0)
    written_s = round(time.perf_counter() - started, 1)
    started = time.perf_counter()
    spark = init_spark("raysink-longrun", executors=2, executor_cores=1,
                       executor_memory="1g", configs=_configs(root),
                       packages=(DELTA, ICEBERG, SQLITE_JDBC))
    spark.sparkContext.setLogLevel("ERROR")
    out: dict[str, dict[str, Any]] = {
        "session": {"start_s": round(time.perf_counter() - started, 1),
                    "floors_written_s": written_s}}
    try:
        started = time.perf_counter()
        _warm_up(spark, root, formats)
        out["session"]["warm_up_s"] = round(time.perf_counter() - started, 1)
        jobs = _Jobs(spark)
        for kind in tables + floors:
            try:
                read = _reader(spark, root, kind.split("-")[0], kind)
                first = _timed_count(read, jobs)
                warm = _timed_count(read, jobs)
                again = []
                for _ in range(repeats - 1):
                    _forget(spark, kind)
                    again.append(_timed_count(read, jobs))
            except Exception as exc:  # reported per table, the others still read
                out[kind] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
                continue
            fresh = sorted(r["s"] for r in [first, *again])
            out[kind] = {"first_s": first["s"], "warm_s": warm["s"], "first": first,
                         "warm": warm, "fresh_s": fresh, "fresh_again": again,
                         "counts": {"first": first["rows"], "warm": warm["rows"],
                                    **{f"fresh{i + 2}": r["rows"] for i, r in enumerate(again)}}}
            print(f"spark {kind}: count {first['rows']:,} in {first['s']} s (open "
                  f"{first['open_s']} s, count {first['count_s']} s, {first['jobs']} jobs "
                  f"{first['jobs_s']} s), again {warm['s']} s ({warm['jobs']} jobs); fresh "
                  f"again (caches dropped) {[r['s'] for r in again]} s", flush=True)
    finally:
        stop_spark()
    return out
