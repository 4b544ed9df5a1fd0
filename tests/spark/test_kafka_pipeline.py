"""Spark's Kafka source end to end, exactly once, with the driver SIGKILLed mid-stream.

``examples/kafka_pipeline.py``'s pipeline: a Structured Streaming query reads an input
topic with Spark's own Kafka source and hands each micro-batch to ``rt.foreach_batch`` of
one runtime holding a ``DeltaSink`` and a ``KafkaSink``.

Run 1 (``tests/spark/kafka_pipeline_driver.py``, a process of its own with its own Ray and
RayDP) is SIGKILLed once micro-batch 1's epoch (2) is PENDING and both sinks' commits of
it are held (Delta's before its commit, Kafka's before any writer is asked to commit):
decided for both sinks, committed in neither, its Kafka writers holding open transactions
whose records are in the log. Run 2 is the pipeline started again (same checkpoint,
runtime and meta store) in the test process, on the layer's RayDP session: the killed
driver's Ray went with it, so all run 2 finds of run 1 is what run 1 stored (a driver
process of its own would prove no more and cost another Ray and RayDP start). It rolls
epoch 2 forward at its start (the Delta commit; for Kafka the writers are gone, so the
part is replayed from the log), is handed batch 1 again by Spark (skipped) and reads to
the end.
Then, record by record: the Delta table holds each input record once, transformed; the
output topic, read ``read_committed``, holds each once, keyed by customer, its value the
Delta row, and in each partition the epochs in order (an input record's epoch is the one
its Delta file was staged for); a ``read_uncommitted`` reader sees records of epoch 2
twice, so the kill really left a transaction behind.

This is the default run's only driver-kill test of a Structured Streaming query: it also
proves the case of ``tests/spark/test_streaming.py`` (``slow`` there: a file source into a
ParquetSink), a driver killed with a micro-batch's epoch PENDING and no sink committed,
rolled forward at the next start, Spark's replay of the batch skipped, each later batch
written as a new epoch, each run's batches checked.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from pyspark.errors import StreamingQueryException
from pyspark.sql import DataFrame, SparkSession

from raysink._faults import ENV_VAR, fault_dir
from raysink.testing import arm_fault, disarm_faults
from tests.support.driver import Driver, batches
from tests.support.kafka import KafkaBroker, read_topic

pytestmark = pytest.mark.timeout(900)

DRIVER = "tests.spark.kafka_pipeline_driver"
RECORDS = 150  # input records, over 3 partitions
PER_BATCH = 50  # Spark's maxOffsetsPerTrigger: 3 micro-batches
Key = tuple[int, int]  # an input record: (partition, offset)


def _produce_orders(broker: KafkaBroker, topic: str) -> dict[Key, dict[str, Any]]:
    """The input: RECORDS JSON orders keyed by customer; each one's output row, by the
    partition and offset it got."""
    from confluent_kafka import Producer

    broker.create_topic(topic, partitions=3)
    producer = Producer({"bootstrap.servers": broker.bootstrap, "log_level": 0})
    rows: dict[Key, dict[str, Any]] = {}

    def delivered(error: Any, message: Any) -> None:
        assert error is None, error
        order = json.loads(message.value())
        rows[(message.partition(), message.offset())] = {
            "id": order["id"], "customer": order["customer"],
            "cents": round(order["amount"] * 100),
            "source_partition": message.partition(), "source_offset": message.offset()}

    for i in range(RECORDS):
        order = {"id": 10_000 + i, "customer": f"c{i % 7}", "amount": i * 0.25}
        producer.produce(topic, json.dumps(order).encode(), key=order["customer"].encode(),
                         on_delivery=delivered)
    assert producer.flush(60) == 0
    assert len(rows) == RECORDS
    return rows


def _delta_rows(table: str) -> dict[Key, tuple[dict[str, Any], int]]:
    """Every row of the Delta table with the epoch its file was staged for."""
    from deltalake import DeltaTable

    found: dict[Key, tuple[dict[str, Any], int]] = {}
    for path in DeltaTable(table).file_uris():
        match = re.search(r"/_?raysink/(\d{12})/", path)
        assert match is not None, f"a data file raysink did not stage: {path}"
        for row in pq.read_table(path).to_pylist():
            key = (row["source_partition"], row["source_offset"])
            assert key not in found, f"input record {key} in the table twice"
            found[key] = (row, int(match.group(1)))
    return found


@pytest.fixture
def pipeline(tmp_path: Path, name: str, kafka_broker: KafkaBroker,
             monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    # the drivers inherit this process's fault directory: arms written here reach them
    monkeypatch.setenv(ENV_VAR, str(fault_dir()))
    return {"bootstrap": kafka_broker.bootstrap, "input_topic": f"orders-{name}",
            "output_topic": f"enriched-{name}", "table": str(tmp_path / "orders"),
            "checkpoint": str(tmp_path / "checkpoint"), "name": name,
            "metastore": f"sqlite:///{tmp_path / 'meta.db'}",
            "records_per_batch": PER_BATCH}


Batches = dict[int, tuple[int, int, bool]]  # batch_id -> (epoch, rows, skipped)


def _run_again(spark: SparkSession, config: dict[str, Any]) -> tuple[Batches, int | None]:
    """Run 2, in this process: each micro-batch's report, and the last committed epoch
    once the query read everything."""
    from examples.kafka_pipeline import Pipeline, runtime, start_query

    pipeline = Pipeline(**config, until_idle=True)
    resumed: Batches = {}
    with runtime(pipeline) as rt:
        def on_batch(df: DataFrame, batch_id: int) -> None:
            report = rt.foreach_batch(df, batch_id)
            resumed[batch_id] = (report.epoch, report.rows, report.skipped)

        query = start_query(spark, pipeline, on_batch)
        ended = False
        try:
            with contextlib.suppress(StreamingQueryException):  # see exception() below
                ended = query.awaitTermination(timeout=480)
        finally:
            query.stop()
        assert query.exception() is None, query.exception()
        assert ended, f"the query had not read everything after 480 s: {resumed}"
        return resumed, rt.status().last_committed_epoch


def test_driver_killed_mid_stream_each_record_once_in_delta_and_kafka(
        spark: SparkSession, pipeline: dict[str, Any], kafka_broker: KafkaBroker,
        tmp_path: Path) -> None:
    expected = _produce_orders(kafka_broker, pipeline["input_topic"])
    log = tmp_path / "driver.log"

    name = pipeline["name"]
    arm_fault(name, "sink.mid_commit", action="sleep", seconds=600,
              when={"epoch": 2, "sink": "orders"})
    arm_fault(name, "kafka.before_finish", action="sleep", seconds=600, when={"epoch": 2})
    first = Driver(DRIVER, pipeline, log)
    first.wait_fired(name, "sink.mid_commit", timeout=480)
    first.wait_fired(name, "kafka.before_finish", timeout=120)
    first.kill()
    disarm_faults(name)
    written = batches(first)
    assert list(written) == [0], written
    epoch, rows, skipped = written[0]
    assert epoch == 1 and rows > 0 and not skipped, written
    assert {epoch for _, epoch in _delta_rows(pipeline["table"]).values()} == {1}

    resumed, last_committed = _run_again(spark, pipeline)
    assert resumed[1] == (2, 0, True), resumed  # Spark's replay of batch 1: skipped
    last = max(resumed)
    assert last_committed == last + 1
    assert last >= 2 and sorted(resumed) == list(range(1, last + 1)), resumed
    for batch_id in range(2, last + 1):  # the batches after the replay: new epochs, rows
        epoch, rows, skipped = resumed[batch_id]
        assert epoch == batch_id + 1 and rows > 0 and not skipped, resumed

    # the Delta table: each input record once, transformed
    delta = _delta_rows(pipeline["table"])
    assert {k: row for k, (row, _) in delta.items()} == expected
    epochs = {k: epoch for k, (_, epoch) in delta.items()}
    assert sorted(set(epochs.values())) == list(range(1, last + 2))

    # the output topic, read_committed: each record once, the Delta row, epochs in order
    committed = read_topic(kafka_broker.bootstrap, pipeline["output_topic"])
    seen: dict[Key, dict[str, Any]] = {}
    order: dict[int, list[int]] = {}
    for message in committed:
        row = json.loads(message.value())
        key = (row["source_partition"], row["source_offset"])
        assert key not in seen, f"input record {key} read twice from the output topic"
        assert message.key() == row["customer"].encode()
        seen[key] = row
        order.setdefault(message.partition(), []).append(epochs[key])
    assert seen == expected
    for partition, sequence in order.items():
        assert sequence == sorted(sequence), f"output partition {partition}: {sequence}"

    # the kill left epoch 2's transactions behind: their records reached the log
    uncommitted = read_topic(kafka_broker.bootstrap, pipeline["output_topic"],
                             committed=False)
    counts = Counter((json.loads(m.value())["source_partition"],
                      json.loads(m.value())["source_offset"]) for m in uncommitted)
    assert any(n > 1 and epochs[k] == 2 for k, n in counts.items()), counts
