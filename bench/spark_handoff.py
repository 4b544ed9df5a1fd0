"""Benchmark: raysink's Spark handoff against ``ray.data.from_spark`` (not a test).

Builds a cached DataFrame (default 5 M rows: a long, a double, a string, a small int),
then runs alternating rounds of:

* ``handoff``    ``SparkPartitions.open(df)``, every partition fetched (``as_ready``),
                 then released;
* ``from_spark`` ``ray.data.from_spark(df)``, every block in the object store, released;
* ``direct``     (``--direct``) the driver calls each executor actor's ``getRDDPartition``
                 itself: Arrow IPC bytes in the object store, no decode, no Ray task;
                 the floor any fetch through Ray pays.

Each round prints ``prepare`` (Spark caches and counts the Arrow RDD), ``fetch`` (until
every partition is in the object store) and rows/s over both; ``--get`` adds a
``ray.get`` of every partition into this process (decoding the bytes for ``direct``).

    .venv/bin/python bench/spark_handoff.py [--rows 5000000] [--rounds 3] [--direct] [--get]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("PYSPARK_PYTHON", sys.executable)

import pyarrow as pa
import ray

Round = Callable[[Any, bool], tuple[float, float, int]]


def run_handoff(df: Any, get: bool) -> tuple[float, float, int]:
    from raysink.spark import SparkPartitions

    start = time.perf_counter()
    with SparkPartitions.open(df) as parts:
        prepared = time.perf_counter()
        refs = [ref for _, ref in parts.as_ready()]
        rows = sum(table.num_rows for table in ray.get(refs)) if get else 0
        fetched = time.perf_counter()
    return prepared - start, fetched - prepared, rows


def run_from_spark(df: Any, get: bool) -> tuple[float, float, int]:
    from raydp.spark.dataset import from_spark_recoverable, release_spark_recoverable

    start = time.perf_counter()
    dataset = from_spark_recoverable(df)  # what ray.data.from_spark(df) calls
    prepared = time.perf_counter()  # its fetch tasks are already submitted here
    refs = dataset.to_arrow_refs()
    ray.wait(refs, num_returns=len(refs), fetch_local=False)
    rows = sum(table.num_rows for table in ray.get(refs)) if get else 0
    fetched = time.perf_counter()
    release_spark_recoverable(df)
    return prepared - start, fetched - prepared, rows


def run_direct(df: Any, get: bool) -> tuple[float, float, int]:
    from raysink.spark.handoff import _jvm_arrow_schema, _RecoverableRdd, cross_language_calls

    start = time.perf_counter()
    rdd = _RecoverableRdd.prepare(df, _jvm_arrow_schema(df))
    prepared = time.perf_counter()
    executors = [ray.get_actor(f"raydp-executor-{name}") for name in rdd.locations]
    with cross_language_calls():
        refs = [
            executor.getRDDPartition.remote(rdd.rdd_id, i, rdd.schema_json, rdd.driver_agent_url)
            for i, executor in enumerate(executors)
        ]
    ray.wait(refs, num_returns=len(refs), fetch_local=False)
    rows = 0
    if get:
        for ipc in ray.get(refs):
            rows += pa.ipc.open_stream(pa.py_buffer(ipc)).read_all().num_rows
    fetched = time.perf_counter()
    rdd.release()
    return prepared - start, fetched - prepared, rows


def build_frame(spark: Any, rows: int, partitions: int) -> Any:
    df = spark.range(0, rows, 1, partitions).selectExpr(
        "id",
        "id * 0.5 AS x",
        "concat('row-', CAST(id AS STRING)) AS s",
        "CAST(id % 97 AS INT) AS k",
    )
    df.cache()
    df.count()
    return df


def report(name: str, times: list[tuple[float, float]], rows: int) -> None:
    totals = [prepare + fetch for prepare, fetch in times]
    best = min(range(len(times)), key=lambda i: totals[i])
    print(
        f"{name:>10}: median {rows / statistics.median(totals) / 1e6:.2f} M rows/s "
        f"(best {rows / totals[best] / 1e6:.2f}; best round prepare {times[best][0]:.2f} s "
        f"+ fetch {times[best][1]:.2f} s)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=5_000_000)
    parser.add_argument("--partitions", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--direct", action="store_true", help="also time direct actor pulls")
    parser.add_argument("--get", action="store_true", help="also ray.get every partition")
    args = parser.parse_args()

    from raysink.spark import init_spark, stop_spark

    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    spark = init_spark(
        "raysink-bench", executors=2, executor_cores=1, executor_memory="1g",
        configs={"spark.ui.showConsoleProgress": "false"},
    )
    try:
        spark.sparkContext.setLogLevel("ERROR")
        df = build_frame(spark, args.rows, args.partitions)
        variants: dict[str, Round] = {"handoff": run_handoff, "from_spark": run_from_spark}
        if args.direct:
            variants["direct"] = run_direct
        times: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
        for round_no in range(args.rounds):
            for name, run in variants.items():
                prepare, fetch, rows = run(df, args.get)
                times[name].append((prepare, fetch))
                print(
                    f"round {round_no} {name:>10}: prepare {prepare:.2f} s, fetch {fetch:.2f} s, "
                    f"{args.rows / (prepare + fetch) / 1e6:.2f} M rows/s"
                    + (f" ({rows} rows got)" if args.get else "")
                )
        for name in variants:
            report(name, times[name], args.rows)
    finally:
        stop_spark()
        ray.shutdown()


if __name__ == "__main__":
    main()
