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
``skipped`` (without starting Spark: the runtime opens first and asks), a decided one is
rolled forward, an undecided one is written again. Give each new batch of data a new
epoch number.

Where things run: the job's driver on the head (``ray job submit`` puts it there), the
coordinator on the driver's node, the writers spread over the nodes, one per node first
(``--placement-label key=value`` keeps them on nodes carrying that label). A lost worker
node costs the epoch in flight one more attempt, a few seconds; a lost head ends the job
(re-submit it). See "Running on a cluster" in the README.
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
    parser.add_argument("--placement-label", action="append", default=[],
                        metavar="KEY=VALUE",
                        help="writers only on nodes with this label (repeatable)")
    return parser.parse_args(argv)


def placement(labels: list[str]) -> Any:
    from raysink import ConfigError, Placement

    pairs = [label.split("=", 1) for label in labels]
    if any(len(pair) != 2 for pair in pairs):
        raise ConfigError(f"--placement-label takes KEY=VALUE; got {labels!r}")
    return Placement(labels=dict((k, v) for k, v in pairs))


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
    with SinkRuntime(args.name, make_sink(args.sink, args.table), writers=args.writers,
                     metastore=args.metastore, placement=placement(args.placement_label),
                     progress=False) as rt:
        done = rt.status().last_committed_epoch
        if done is not None and done >= args.epoch:
            report = rt.write_arrow([], epoch=args.epoch)  # reported skipped
        else:
            spark = init_spark(f"{args.name}-job", executors=args.executors,
                               executor_cores=args.executor_cores,
                               executor_memory=args.executor_memory)
            try:
                report = rt.write(build_frame(spark, args.rows, args.partitions),
                                  epoch=args.epoch)
            finally:
                stop_spark()
        print(report)
        status = rt.status()
    states = {name: sink.state for name, sink in status.sinks.items()}
    print(f"meta store {status.metastore}; last committed epoch "
          f"{status.last_committed_epoch}; sinks {states}")
    return 0 if report.committed else 1


def main(argv: list[str] | None = None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
