"""A lost writer's part replayed from the data topic, on the real broker: when retention
took its records first, and when it is larger than the replay's chunk.

In both cases writer 0 is SIGKILLed while its epoch is decided and held (a sleep at
``kafka.before_finish``), so the commit finds its transaction lost and replays its part
(``raysink/sinks/kafka/_replay.py``)."""

from __future__ import annotations

import dataclasses
import json
import re
import time

import pytest

from raysink import SinkRuntime
from raysink.testing import arm_fault
from tests.integration.helpers import closes_with_epoch_pending, run_in_thread, sigkill, wait_fired
from tests.kafka.conftest import Records, assert_aborted_reached_log, halves, sink
from tests.kafka.test_kafka_faults import _progress, _runtime, _writer_pid
from tests.support.kafka import KafkaBroker

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.timeout(300)]


def _delete_all_records(broker: KafkaBroker, topic: str) -> dict[int, int]:
    """``delete_records`` up to each partition's high watermark (what retention does to
    old segments, at once); returns each partition's new log start offset."""
    from confluent_kafka import TopicPartition
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": broker.bootstrap})
    partitions = sorted(admin.list_topics(topic, timeout=30).topics[topic].partitions)
    futures = admin.delete_records([TopicPartition(topic, p, -1) for p in partitions],
                                   request_timeout=30)  # -1: up to the high watermark
    return {tp.partition: int(f.result(timeout=30).low_watermark)
            for tp, f in futures.items()}


def test_a_replay_after_retention_is_data_loss_at_once(kafka_broker: KafkaBroker, topic: str,
                                                       name: str, meta: str) -> None:
    """Epoch 2 is decided; writer 0 is killed and every record of the topic deleted before
    the commit. The replay cannot be done: the sink reports ``DataLossError`` naming the
    epoch, the writer, each partition with its missing offsets and where its log starts,
    within seconds. Before: the replay consumer jumped to the log's end, its read timed
    out after ``timeout`` and the commit was retried for ever as ``SinkUnavailableError``
    (the status said "unavailable"), and the sink read ``stalled``."""
    with closes_with_epoch_pending(), _runtime(name, kafka_broker, topic, meta,
                                               commit_timeout=5,
                                               sink_options={"timeout": 30.0}) as rt:
        rt.write_arrow(halves(1))  # epoch 2's writers pre-commit once it is in
        pid = _writer_pid(rt)
        arm_fault(name, "kafka.before_finish", action="sleep", seconds=3.0,
                  when={"epoch": 2})
        thread, box = run_in_thread(lambda: rt.write_arrow(halves(2)))
        wait_fired(name, "kafka.before_finish", timeout=120)
        sigkill(pid)
        starts = _delete_all_records(kafka_broker, topic)
        deleted = time.monotonic()
        thread.join(timeout=120)
        assert not box["result"].committed  # decided, never visible
        error = ""
        while time.monotonic() - deleted < 60 and not error.startswith("DataLossError"):
            error = rt.status().sinks["main"].last_error or ""
            time.sleep(0.2)
        took = time.monotonic() - deleted
        status = rt.status()
    assert error.startswith("DataLossError"), error
    assert took < 25, f"DataLossError only after {took:.0f} s"  # < timeout: no read waited
    # failed, not stalled: no retry brings the records back (retried at retry_cap only)
    assert status.sinks["main"].state == "failed" and 2 in status.pending_epochs
    assert "epoch 2 cannot be replayed" in error and "writer 0:" in error, error
    named = [p for p, start in starts.items()
             if re.search(rf"writer 0: {topic}\[{p}\] offsets \d+-\d+ \(\d+ records; the log "
                          rf"starts at offset {start},", error)]
    assert named, error  # a partition of writer 0's part, with its log start offset
    assert [r["epoch"] for r in _progress(kafka_broker, topic, name)] == [1]


def test_a_replay_larger_than_its_chunk_is_exact(kafka_broker: KafkaBroker, topic: str,
                                                 name: str, meta: str) -> None:
    """Epoch 2 has 4,000 records and writer 0's half (2,000 records, about 140 KB) is
    replayed with a 4 KiB chunk: some 35 chunks, each produced and delivered before the
    next is read. Every record once, in epoch order in each partition, and the part's
    progress record says it was replayed. (That each chunk is delivered before more is
    read, and the bytes held, are shown in ``tests/unit/test_kafka_replay_chunks.py``.)"""
    rows = 4000
    target = sink(kafka_broker, topic)
    target.settings = dataclasses.replace(target.settings, replay_chunk_bytes=4096)
    with SinkRuntime(name, target, writers=2, metastore=meta, progress=False,
                     retry_cap=1.0, commit_timeout=120) as rt:
        assert rt.write_arrow(halves(1, rows)).committed
        pid = _writer_pid(rt)
        arm_fault(name, "kafka.before_finish", action="sleep", seconds=3.0,
                  when={"epoch": 2})
        thread, box = run_in_thread(lambda: rt.write_arrow(halves(2, rows)))
        wait_fired(name, "kafka.before_finish", timeout=120)
        sigkill(pid)
        thread.join(timeout=240)
        assert box["result"].committed, box
    Records(kafka_broker, topic).assert_exactly([1, 2], rows)
    assert_aborted_reached_log(kafka_broker, topic, 2)
    parts = [json.loads(m.value()) for m in
             Records(kafka_broker, f"{topic}-raysink-progress").messages
             if m.key() == f"raysink:{name}:main:w0".encode()]
    assert any(p["epoch"] == 2 and p.get("replayed") for p in parts), parts
