"""The writer's data path on the session's broker, without Ray: records placed as
librdkafka's default partitioner places them, produced without a delivery report per
record, and manifest runs that name exactly the records of the part (what a replay reads
back), also when a chunk was not contiguous and the epoch was produced again."""

from __future__ import annotations

import uuid
from typing import Any

import pyarrow as pa
import pytest

from raysink.sinks import KafkaSink
from raysink.sinks.kafka import _batches, _produced
from raysink.sinks.kafka._progress import Topics
from raysink.sinks.kafka._replay import part_ranges
from tests.support.kafka import KafkaBroker, read_topic

pytestmark = pytest.mark.timeout(180)

PARTITIONS = 4


def _batches_of(rows: int) -> list[pa.Table]:
    """Three batches; keys repeat, some are null or empty (placed by the writer), one
    header column."""
    keys = [None if i % 17 == 0 else ("" if i % 19 == 0 else f"k{i % 23}")
            for i in range(rows)]
    table = pa.table({"id": pa.array(range(rows), pa.int64()),
                      "k": pa.array(keys, pa.string()),
                      "h": pa.array([f"h{i}" for i in range(rows)])})
    third = rows // 3
    return [table.slice(0, third), table.slice(third, third), table.slice(2 * third)]


def _writer_of(broker: KafkaBroker, topic: str) -> Any:
    sink = KafkaSink(broker.bootstrap, topic, key="k", headers=["h"],
                     partitions=PARTITIONS, timeout=30.0).bind(f"rt{uuid.uuid4().hex[:6]}",
                                                               "main")
    Topics(sink.settings).create_progress()  # the coordinator's, in a runtime
    writer = sink.create_writer(1)
    writer.open()
    return writer


def _librdkafka_partitions(broker: KafkaBroker, keys: list[str]) -> dict[str, int]:
    """Where librdkafka's default partitioner puts each key (its delivery reports)."""
    from confluent_kafka import Producer

    topic = broker.create_topic(f"p-{uuid.uuid4().hex[:8]}", PARTITIONS)
    placed: dict[str, int] = {}
    producer = Producer({"bootstrap.servers": broker.bootstrap})
    for key in keys:
        producer.produce(topic, b"x", key, on_delivery=lambda err, msg: placed.__setitem__(
            msg.key().decode(), msg.partition()))
    assert producer.flush(30) == 0
    return placed


def _assert_runs_exact(broker: KafkaBroker, topic: str, manifest: dict[str, Any],
                       rows: int) -> dict[int, int]:
    """The manifest's runs hold exactly this part's records (read back uncommitted, as a
    replay does); returns each id's partition."""
    at = {(m.partition(), m.offset()): m for m in
          read_topic(broker.bootstrap, topic, committed=False)}
    ids: list[int] = []
    where: dict[int, int] = {}
    for partition, ranges in part_ranges(manifest):
        for first, last in ranges:
            for offset in range(first, last + 1):
                message = at[(partition, offset)]
                row_id = int(message.value().decode().split(",")[0].split(":")[1])
                ids.append(row_id)
                where[row_id] = partition
                assert message.headers() == [("h", f"h{row_id}".encode())]
    assert sorted(ids) == list(range(rows)), "the runs name each record once, no other"
    return where


@pytest.mark.parametrize("broken", [False, True])
def test_a_part_is_placed_like_librdkafka_and_its_runs_are_exact(
        kafka_broker: KafkaBroker, monkeypatch: pytest.MonkeyPatch, broken: bool) -> None:
    rows = 3_000
    reports = {"per record": 0}
    per_record = _produced.Deliveries.report

    def counted(self: Any, err: Any, msg: Any) -> None:
        reports["per record"] += 1
        per_record(self, err, msg)

    monkeypatch.setattr(_produced.Deliveries, "report", counted)
    if broken:  # as if another producer's batch had landed inside a chunk
        monkeypatch.setattr(_batches.Chunks, "runs", lambda self: None)
    topic = f"w-{uuid.uuid4().hex[:10]}"
    writer = _writer_of(kafka_broker, topic)
    try:
        for batch in _batches_of(rows):
            writer.write(batch.to_batches()[0])
        manifest = writer.pre_commit(1, 0)
        where = _assert_runs_exact(kafka_broker, topic, manifest, rows)
        assert writer.finish(1, 0, commit=True).name == "COMMITTED"
    finally:
        writer.close()
    # without a per-record report unless a chunk was not contiguous
    assert reports["per record"] == (rows if broken else 0)
    keys = {f"k{i % 23}": i for i in range(rows) if i % 17 and i % 19}
    placed = _librdkafka_partitions(kafka_broker, sorted(keys))
    assert {k: where[i] for k, i in keys.items()} == placed
    committed = read_topic(kafka_broker.bootstrap, topic, committed=True)
    assert sorted(int(m.value().decode().split(",")[0].split(":")[1]) for m in committed
                  if m.topic() == topic) == list(range(rows)), "once each, the abort unseen"


def test_a_chunk_another_producer_wrote_into_is_placed_from_the_log(
        kafka_broker: KafkaBroker, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another producer's record lands inside a chunk (the chunk's first records are
    flushed, then the foreign record, then the rest): the writer reads the chunk's offsets
    back and names its records exactly, without producing the epoch again."""
    from confluent_kafka import Producer

    rows = 3_000
    reports = {"per record": 0}
    per_record = _produced.Deliveries.report
    monkeypatch.setattr(_produced.Deliveries, "report", lambda self, err, msg: (
        reports.__setitem__("per record", reports["per record"] + 1),
        per_record(self, err, msg)))
    topic = f"w-{uuid.uuid4().hex[:10]}"
    foreign = Producer({"bootstrap.servers": kafka_broker.bootstrap})
    send_range = _batches._send_range
    injected: list[int] = []

    def with_a_foreign_record(producer: Any, topic_: str, part: Any, begin: int, end: int,
                              wait: Any) -> None:
        send_range(producer, topic_, part, begin, end, wait)
        if not injected and end - begin > 10:
            assert producer.flush(30) == 0
            foreign.produce(topic_, b'{"id":-1}', b"foreign", partition=part.partition)
            assert foreign.flush(30) == 0
            injected.append(part.partition)

    monkeypatch.setattr(_batches, "_send_range", with_a_foreign_record)
    writer = _writer_of(kafka_broker, topic)
    readers = []
    try:
        for epoch in (1, 2):  # the second epoch reads back through the same consumer
            injected.clear()
            for batch in _batches_of(rows):
                writer.write(batch.to_batches()[0])
            manifest = writer.pre_commit(epoch, 0)
            _assert_runs_exact(kafka_broker, topic, manifest, rows)
            assert writer.finish(epoch, 0, commit=True).name == "COMMITTED"
            assert injected and reports["per record"] == 0
            assert len(manifest["runs"][str(injected[0])]) >= 2, "the foreign record split a run"
            readers.append(writer._reader)
    finally:
        writer.close()
        foreign.close()
    assert readers[0] is not None and readers[1] is readers[0], "one read-back consumer"
    assert writer._reader is None, "closed with the writer"
