"""A Spark-on-Ray job that writes one DataFrame exactly once, for a Ray cluster.

Submit it to a cluster started with ``ray up cluster.yaml``, while ``ray dashboard
cluster.yaml`` forwards the job server to localhost::

    RAY_AUTH_MODE=token ray job submit --address http://127.0.0.1:8265 --working-dir . -- \\
        python examples/cluster_job.py \\
        --metastore postgresql://raysink:PASSWORD@db.internal:5432/raysink \\
        --table /shared/orders --epoch 1

The job connects to the cluster (``ray.init()`` finds it from ``ray job submit``), starts
RayDP with ``raysink.spark.init_spark``, builds a DataFrame and writes it as epoch
``--epoch`` of the runtime ``--name`` through ``SinkRuntime.write``, with its decisions in
the PostgreSQL meta store. Re-submitting the same job (same ``--name``, ``--metastore``,
``--epoch``) after any crash recovers: an epoch already committed is reported
``skipped``, a decided one is rolled forward, an undecided one is written again. Give each
new batch of data a new epoch number.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Write a Spark DataFrame exactly once from a Ray cluster job.")
    parser.add_argument("--metastore", required=True,
                        help="the meta store, PostgreSQL on a cluster: "
                             "postgresql://user:password@host:5432/db")
    parser.add_argument("--table", required=True,
                        help="target: a directory on a mount every node shares (parquet), "
                             "or for delta also an object-store URI (s3://...)")
    parser.add_argument("--sink", choices=("parquet", "delta"), default="parquet")
    parser.add_argument("--name", default="cluster_orders",
                        help="runtime name: keep it to recover after a restart")
    parser.add_argument("--epoch", type=int, default=1,
                        help="the epoch this run writes (same number on a re-run)")
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--partitions", type=int, default=8)
    parser.add_argument("--writers", type=int, default=2, help="writer actors per sink")
    parser.add_argument("--executors", type=int, default=2)
    parser.add_argument("--executor-cores", type=int, default=2)
    parser.add_argument("--executor-memory", default="4g")
    return parser.parse_args(argv)


def make_sink(kind: str, table: str) -> Any:
    from raysink.sinks import DeltaSink, ParquetSink

    if kind == "delta":
        return DeltaSink(table)
    return ParquetSink(table)


def build_frame(spark: Any, rows: int, partitions: int) -> Any:
    """Deterministic rows: a re-run of the same epoch writes the same data."""
    return spark.range(0, rows, numPartitions=partitions).selectExpr(
        "id",
        "concat('order-', CAST(id AS STRING)) AS name",
        "CAST(id % 1000 AS DOUBLE) / 10.0 AS amount",
    )


def run(args: argparse.Namespace) -> int:
    import ray

    from raysink import SinkRuntime
    from raysink.spark import init_spark, stop_spark

    ray.init()  # inside `ray job submit`: the job's cluster
    spark = init_spark(f"{args.name}-job", executors=args.executors,
                       executor_cores=args.executor_cores,
                       executor_memory=args.executor_memory)
    try:
        df = build_frame(spark, args.rows, args.partitions)
        with SinkRuntime(args.name, make_sink(args.sink, args.table), writers=args.writers,
                         metastore=args.metastore) as rt:
            report = rt.write(df, epoch=args.epoch)
            print(report)
            status = rt.status()
        states = {name: sink.state for name, sink in status.sinks.items()}
        print(f"meta store {status.metastore}; last committed epoch "
              f"{status.last_committed_epoch}; sinks {states}")
        return 0 if report.committed else 1
    finally:
        stop_spark()


def main(argv: list[str] | None = None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
