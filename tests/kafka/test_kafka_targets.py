"""The Kafka sink's topics (deleted, re-created, refused) and Ray Data into Kafka."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest
import ray

from raysink import ConfigError, DataLossError, SinkRuntime
from raysink.sinks.kafka._progress import epoch_key, record_value
from tests.kafka.conftest import ROWS, Records, epoch_rows, halves, sink
from tests.support.kafka import KafkaBroker, read_topic

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.timeout(400)]


def _runtime(name: str, broker: KafkaBroker, topic: str, meta: str) -> SinkRuntime:
    return SinkRuntime(name, sink(broker, topic), writers=2, metastore=meta, progress=False,
                       commit_timeout=120)


def test_deleted_topics(kafka_broker: KafkaBroker, topic: str, name: str,
                        tmp_path: Path) -> None:
    """A deleted progress topic is re-created (the data topic is there, nothing pending);
    a deleted data topic after commits is ``DataLossError``; with its progress gone too
    (nothing says data was written), the next runtime creates both again."""
    meta = f"sqlite:///{tmp_path / 'meta.db'}"
    progress = f"{topic}-raysink-progress"
    with _runtime(name, kafka_broker, topic, meta) as rt:
        for epoch in (1, 2):
            assert rt.write_arrow(halves(epoch)).committed
    kafka_broker.delete_topic(progress)
    with _runtime(name, kafka_broker, topic, meta) as rt:
        assert rt.sinks["main"].committed_epoch() == 2  # re-created at start
        assert rt.write_arrow(halves(3)).committed
    Records(kafka_broker, topic).assert_exactly([1, 2, 3])

    kafka_broker.delete_topic(topic)
    with pytest.raises(DataLossError, match="deleted after raysink committed"), \
            _runtime(name, kafka_broker, topic, meta) as rt:
        rt.write_arrow(halves(4))

    kafka_broker.delete_topic(progress)
    fresh = f"sqlite:///{tmp_path / 'fresh.db'}"
    with _runtime(name, kafka_broker, topic, fresh) as rt:
        assert rt.write_arrow(halves(1)).committed
    Records(kafka_broker, topic).assert_exactly([1])


@pytest.mark.parametrize("created_again", [
    False,  # deleted: the read on says the topic is unknown, it is looked up
    True,   # created again, empty: the read on finds its end below where it was
])
def test_a_progress_topic_deleted_under_a_reader_that_reads_on_is_no_marker(
        kafka_broker: KafkaBroker, topic: str, created_again: bool) -> None:
    """Once a reader has read the progress topic it reads on without looking the topic
    up (``ProgressReader.read_on``: one round trip fewer per commit). A topic deleted
    since, or created again, still reads as no marker (which the coordinator's check
    before a commit finds lost), never as the epoch read before. No runtime: the epoch
    record is produced here, as the committer writes it."""
    import confluent_kafka

    progress = kafka_broker.create_topic(f"{topic}-raysink-progress", 1,
                                         **{"cleanup.policy": "compact"})
    producer = confluent_kafka.Producer({"bootstrap.servers": kafka_broker.bootstrap})
    producer.produce(progress, record_value(2, 0), epoch_key("rt", "main"))
    assert producer.flush(30) == 0
    main = sink(kafka_broker, topic, progress_topic=progress).bind("rt", "main")
    assert main.committed_epoch() == 2  # looked up, then read
    assert main.committed_epoch() == 2  # read on
    kafka_broker.delete_topic(progress)
    if created_again:
        kafka_broker.create_topic(progress, 1, **{"cleanup.policy": "compact"})
    assert main.committed_epoch() is None


def test_a_compacted_topic_is_refused(kafka_broker: KafkaBroker, topic: str, name: str,
                                      meta: str) -> None:
    """``validate()`` refuses a compacted data topic (compaction drops aborted records a
    replay needs) and creates nothing."""
    kafka_broker.create_topic(topic, 1, **{"cleanup.policy": "compact"})
    with pytest.raises(ConfigError, match="compacted"):
        _runtime(name, kafka_broker, topic, meta).start()
    assert f"{topic}-raysink-progress" not in kafka_broker.admin().list_topics(
        timeout=30).topics


def test_ray_data_once_and_write_kafka_twice(kafka_broker: KafkaBroker, topic: str,
                                             name: str, meta: str) -> None:
    """``ds.write_datasink(rt.datasink(epoch=1))`` run twice: the records once. Ray
    Data's own ``write_kafka`` run twice: every record twice."""
    def dataset() -> ray.data.Dataset:
        table = epoch_rows(1)
        return ray.data.from_arrow([table.slice(i, ROWS // 4) for i in range(0, ROWS,
                                                                              ROWS // 4)])

    with _runtime(name, kafka_broker, topic, meta) as rt:
        for _ in range(2):
            datasink = rt.datasink(epoch=1)
            dataset().write_datasink(datasink)
            assert datasink.report is not None and datasink.report.committed
        assert datasink.report.skipped
    Records(kafka_broker, topic).assert_exactly([1])

    plain = f"{topic}-plain"
    kafka_broker.create_topic(plain, 3)
    for _ in range(2):
        dataset().write_kafka(plain, kafka_broker.bootstrap, key_field="customer")
    ids = Records(kafka_broker, plain).ids()
    assert len(ids) == 2 * ROWS and set(ids) == {1_000_000 + i for i in range(ROWS)}


def test_empty_and_binary_values(kafka_broker: KafkaBroker, topic: str, name: str,
                                 meta: str) -> None:
    """A binary ``value`` column is the record's bytes; an empty epoch commits nothing."""
    rows = pa.table({"customer": ["a", "b"], "value": pa.array([b"\x00raw", b"\xff"])})
    with SinkRuntime(name, sink(kafka_broker, topic), writers=2, metastore=meta,
                     progress=False) as rt:
        assert rt.write_arrow(rows).committed
        assert rt.write_arrow(rows.slice(0, 0)).committed
    messages = read_topic(kafka_broker.bootstrap, topic)
    assert sorted(m.value() for m in messages) == [b"\x00raw", b"\xff"]
