"""Kafka in, Delta and Kafka out, exactly once: consume, transform, produce.

Spark's own Kafka source (``spark-sql-kafka-0-10``, loaded from Maven Central by
``init_spark(packages=[KAFKA])``) reads the input topic as a Structured Streaming query;
each micro-batch goes through ``rt.foreach_batch`` into ONE runtime holding a
``DeltaSink`` (the order table) and a ``KafkaSink`` (the enriched orders, keyed by
customer): one epoch decision for both, so a micro-batch is in both targets or in
neither. Run it against a broker::

    python examples/kafka_pipeline.py --bootstrap 127.0.0.1:9092 \\
        --input orders --output orders-enriched \\
        --table /data/orders --checkpoint /data/orders-checkpoint

Input records are JSON objects ``{"id": 1, "customer": "c7", "amount": 12.5}``. Each
output row (a Delta row, and a Kafka record whose value is the row as JSON) holds the
order's ``id`` and ``customer``, the amount in cents and the input record's partition and
offset. Kill the job anywhere and start it again with the same arguments: Spark restarts
the query from its checkpoint and hands the runtime the micro-batch it had not recorded;
the runtime rolls a decided epoch forward, skips one both targets hold, and writes an
undecided one again. Consumers of the output topic read with
``isolation.level=read_committed``. ``--until-idle`` ends the query once it has read
everything there is (Spark's ``availableNow`` trigger); without it the query runs until
stopped.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from raysink import SinkRuntime
from raysink.sinks import DeltaSink, KafkaSink

ORDER = "id long, customer string, amount double"


@dataclass(frozen=True, kw_only=True, slots=True)
class Pipeline:
    """Where the pipeline reads, writes and keeps its state."""

    bootstrap: str
    input_topic: str
    output_topic: str
    table: str
    checkpoint: str
    metastore: str | None = None
    name: str = "kafka-pipeline"
    records_per_batch: int = 10_000
    until_idle: bool = False
    writers: int = 2


def parse_args(argv: list[str] | None = None) -> Pipeline:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bootstrap", required=True, help="Kafka bootstrap servers")
    parser.add_argument("--input", required=True, help="the topic of orders to read")
    parser.add_argument("--output", required=True, help="the topic of enriched orders")
    parser.add_argument("--table", required=True, help="the Delta table of orders")
    parser.add_argument("--checkpoint", required=True, help="Spark's checkpoint location")
    parser.add_argument("--metastore", help="raysink's meta store (default: SQLite in cwd)")
    parser.add_argument("--name", default="kafka-pipeline", help="the runtime's name")
    parser.add_argument("--records-per-batch", type=int, default=10_000,
                        help="Spark's maxOffsetsPerTrigger")
    parser.add_argument("--until-idle", action="store_true",
                        help="stop once everything there is has been read")
    args = parser.parse_args(argv)
    return Pipeline(bootstrap=args.bootstrap, input_topic=args.input,
                    output_topic=args.output, table=args.table, checkpoint=args.checkpoint,
                    metastore=args.metastore, name=args.name,
                    records_per_batch=args.records_per_batch, until_idle=args.until_idle)


def transform(records: Any) -> Any:
    """Kafka records (a JSON value each) to output rows: the order's id and customer, the
    amount in cents, the record's partition and offset."""
    from pyspark.sql import functions as F

    order = F.from_json(F.col("value").cast("string"), ORDER)
    parsed = records.select(order.alias("o"), "partition", "offset")
    return parsed.select(
        F.col("o.id").alias("id"), F.col("o.customer").alias("customer"),
        F.round(F.col("o.amount") * 100).cast("long").alias("cents"),
        F.col("partition").alias("source_partition"), F.col("offset").alias("source_offset"))


def runtime(pipeline: Pipeline) -> SinkRuntime:
    """One runtime, two sinks: every micro-batch is one epoch decided once for both."""
    sinks = {"orders": DeltaSink(pipeline.table),
             "enriched": KafkaSink(pipeline.bootstrap, pipeline.output_topic, key="customer")}
    options: dict[str, Any] = {"writers": pipeline.writers, "progress": False}
    if pipeline.metastore is not None:
        options["metastore"] = pipeline.metastore
    return SinkRuntime(pipeline.name, sinks, **options)


def start_query(spark: Any, pipeline: Pipeline,
                on_batch: Callable[[Any, int], Any]) -> Any:
    """The streaming query: the input topic from its start (then from the checkpoint),
    ``records_per_batch`` records at most per micro-batch, each handed to ``on_batch``."""
    source = (spark.readStream.format("kafka")
              .option("kafka.bootstrap.servers", pipeline.bootstrap)
              .option("subscribe", pipeline.input_topic)
              .option("startingOffsets", "earliest")
              .option("kafka.isolation.level", "read_committed")
              .option("maxOffsetsPerTrigger", pipeline.records_per_batch)
              .load())
    writer = (transform(source).writeStream.foreachBatch(on_batch)
              .option("checkpointLocation", pipeline.checkpoint))
    if pipeline.until_idle:
        writer = writer.trigger(availableNow=True)
    return writer.start()


def main(argv: list[str] | None = None) -> None:
    pipeline = parse_args(argv)
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from raysink.spark import init_spark, stop_spark
    from raysink.spark.packages import KAFKA

    spark = init_spark(pipeline.name, packages=[KAFKA])
    try:
        with runtime(pipeline) as rt:
            query = start_query(spark, pipeline, rt.foreach_batch)
            query.awaitTermination()
            print(f"last committed epoch: {rt.status().last_committed_epoch}")
    finally:
        stop_spark()


if __name__ == "__main__":
    main()
