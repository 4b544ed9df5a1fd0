"""The Kafka replay's chunked copy (``raysink/sinks/kafka/_replay.py``) against a scripted
log and producer: what the real broker cannot show on demand.

- memory: a part many times the chunk is copied holding at most one chunk (and one
  record) read and not yet delivered, and nothing is read while records wait for
  delivery; every record once, in offset order, other producers' records skipped;
- retention: offsets below the log's start (before the read, or taken while it reads:
  the consumer's ``auto.offset.reset=error``) and offsets missing inside the log are a
  ``DataLossError`` naming the epoch, the writer, the partition, the missing offsets and
  the log's start;
- stalls: no progress for ``timeout`` is a ``SinkUnavailableError`` naming the partition
  and offset; a slow read or flush that moves is never cut by a deadline of its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

confluent_kafka = pytest.importorskip("confluent_kafka")

from raysink.errors import ConfigError, DataLossError, SinkUnavailableError  # noqa: E402
from raysink.sinks import KafkaSink  # noqa: E402
from raysink.sinks.kafka._config import KafkaSettings  # noqa: E402
from raysink.sinks.kafka._replay import Chunks, check_retained, part_ranges  # noqa: E402

KafkaError = confluent_kafka.KafkaError
TOPIC = "orders"
WHERE = {"runtime": "rt", "sink": "main", "epoch": 7}


@dataclass
class Clock:
    now: float = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Message:
    """What ``Consumer.poll`` returns: a record, or an event (``code``)."""

    partition_: int
    offset_: int
    value_: bytes = b""
    key_: bytes | None = None
    code: int | None = None

    def error(self) -> Any:
        return None if self.code is None else KafkaError(self.code)

    def offset(self) -> int:
        return self.offset_

    def partition(self) -> int:
        return self.partition_

    def value(self) -> bytes:
        return self.value_

    def key(self) -> bytes | None:
        return self.key_

    def headers(self) -> list[tuple[str, bytes]] | None:
        return None

    def timestamp(self) -> tuple[int, int]:
        return (1, 1_700_000_000_000 + self.offset_)


@dataclass
class Log:
    """One partition's log (offset -> value), the scripted consumer reading it, and what
    the copy's producer has queued (the consumer checks the queue at every read)."""

    records: dict[int, bytes]
    clock: Clock
    low: int = 0
    producer: Producer | None = None
    position: int | None = None
    eof_sent: bool = False
    polls_with_queue: int = 0
    stall: bool = False
    retain_from: tuple[int, int] | None = None  # (after this many reads, new log start)
    reads: int = 0
    assigned: list[int] = field(default_factory=list)

    high: int = 0

    def __post_init__(self) -> None:
        self.high = max(self.records) + 1 if self.records else 0

    def assign(self, partitions: list[Any]) -> None:
        (tp,) = partitions
        assert tp.topic == TOPIC
        self.position, self.eof_sent = tp.offset, False
        self.assigned.append(tp.offset)

    def unassign(self) -> None:
        self.position = None

    def get_watermark_offsets(self, tp: Any, timeout: float, cached: bool) -> tuple[int, int]:
        assert not cached, "the log's start must be asked of the broker"
        return self.low, self.high

    def poll(self, timeout: float) -> Message | None:
        if self.producer is not None and self.producer.queue:
            self.polls_with_queue += 1
        if self.stall or self.position is None:
            self.clock.now += timeout
            return None
        if self.retain_from is not None and self.reads >= self.retain_from[0]:
            self.low = self.retain_from[1]
            for offset in [o for o in self.records if o < self.low]:
                del self.records[offset]
        if self.position < self.low:
            self.position = None  # librdkafka stops fetching the partition
            return Message(0, -1001, code=KafkaError._AUTO_OFFSET_RESET)
        offset, high = self.position, self.high
        while offset < high and offset not in self.records:
            offset += 1
        if offset >= high:
            if self.eof_sent:
                self.clock.now += timeout
                return None
            self.eof_sent = True
            return Message(0, high, code=KafkaError._PARTITION_EOF)
        self.position, self.reads = offset + 1, self.reads + 1
        return Message(0, offset, self.records[offset], b"k")


@dataclass
class Producer:
    """Queues what is produced; ``flush`` delivers up to ``per_flush`` records a call."""

    clock: Clock
    per_flush: int | None = None
    queue: list[tuple[str, bytes, Any, dict[str, Any]]] = field(default_factory=list)
    delivered: list[tuple[str, bytes, Any, dict[str, Any]]] = field(default_factory=list)
    peak_queued: int = 0

    def produce(self, topic: str, value: bytes, key: Any, **options: Any) -> None:
        self.queue.append((topic, value, key, options))
        self.peak_queued = max(self.peak_queued, sum(len(v) + len(k or b"")
                                                     for _, v, k, _ in self.queue))

    def poll(self, timeout: float) -> int:
        return 0

    def flush(self, producer: Any, timeout: float) -> int:
        assert producer is self
        self.clock.now += timeout
        take = len(self.queue) if self.per_flush is None else self.per_flush
        self.delivered += self.queue[:take]
        del self.queue[:take]
        return len(self.queue)


def _copy(log: Log, ranges: list[tuple[int, int]], *, chunk: int = 1000,
          producer: Producer | None = None) -> tuple[Chunks, Producer]:
    producer = producer or Producer(log.clock)
    log.producer = producer
    chunks = Chunks(log, producer, chunk_bytes=chunk, timeout=30.0, flush=producer.flush,
                    where=dict(WHERE), clock=log.clock)
    chunks.copy(TOPIC, 0, ranges, writer=1)
    chunks.drain()
    return chunks, producer


def _value(offset: int) -> bytes:
    return f'{{"id": {offset}, "pad": "{"x" * 80}"}}'.encode()


def test_a_part_many_chunks_large_is_copied_once_in_order_holding_one_chunk() -> None:
    """3,000 records of about 100 bytes (300 KB) with a 1,000-byte chunk: every wanted
    record once, in offset order, with its partition, key and timestamp; another
    producer's records between the part's runs left out; at most one chunk and one record
    held or queued at a time, and nothing read while records wait for delivery."""
    clock = Clock()
    log = Log({o: _value(o) for o in range(100, 3300)}, clock)
    ranges = [(100, 1599), (1700, 3199)]  # 1600-1699: another producer's batch
    chunks, producer = _copy(log, ranges)
    wanted = [o for a, b in ranges for o in range(a, b + 1)]
    assert [v for _, v, _, _ in producer.delivered] == [_value(o) for o in wanted]
    assert all(o["partition"] == 0 and o["timestamp"] == 1_700_000_000_000 + off
               for (_, _, _, o), off in zip(producer.delivered, wanted, strict=True))
    record = len(_value(0)) + 1
    assert chunks.peak_bytes <= 1000 + record
    assert producer.peak_queued <= 1000 + record
    assert log.polls_with_queue == 0, "read more while a chunk waited for delivery"
    assert chunks.copied == len(wanted) and chunks.flushes >= len(wanted) * record // 1100


def test_a_far_run_is_sought_not_read_through() -> None:
    """Runs 100,000 offsets apart (other producers' records between): the reader seeks
    to the second run instead of reading everything between."""
    records = {o: _value(o) for o in [*range(0, 20), *range(20, 100_020, 1000),
                                      *range(100_020, 100_040)]}
    log = Log(records, Clock())
    _, producer = _copy(log, [(0, 19), (100_020, 100_039)])
    assert log.assigned == [0, 100_020] and log.reads == 40
    assert [v for _, v, _, _ in producer.delivered] == [
        _value(o) for o in [*range(0, 20), *range(100_020, 100_040)]]


def test_runs_are_merged_and_sorted() -> None:
    manifest: Any = {"runs": {"2": [[10, 5], [15, 5], [30, 1]], "0": [[7, 3], [0, 4]]}}
    assert part_ranges(manifest) == [(0, [(0, 3), (7, 9)]), (2, [(10, 19), (30, 30)])]


def test_offsets_below_the_log_start_are_data_loss_before_anything_is_written() -> None:
    """Retention took the start of partition 0's run and all of partition 2's: one
    ``DataLossError`` names both, each with its missing offsets and its log's start."""
    logs = {0: (120, 400), 1: (0, 400), 2: (300, 300)}

    class Watermarks:
        def get_watermark_offsets(self, tp: Any, timeout: float,
                                  cached: bool) -> tuple[int, int]:
            assert not cached
            return logs[tp.partition]

    sink: Any = SimpleNamespace(settings=KafkaSink("127.0.0.1:9", TOPIC).settings,
                                runtime="rt", name="main")
    manifest: Any = {"writer": 3, "topic": TOPIC,
                     "runs": {"0": [[100, 50]], "1": [[10, 5]], "2": [[200, 40]]}}
    with pytest.raises(DataLossError) as info:
        check_retained(Watermarks(), sink, 7, [manifest])
    text = str(info.value)
    assert info.value.epoch == 7 and "epoch 7 cannot be replayed" in text
    assert f"writer 3: {TOPIC}[0] offsets 100-119 (20 records;" in text
    assert "the log starts at offset 120, its last offset 399)" in text
    assert f"{TOPIC}[2] offsets 200-239 (40 records;" in text and "offset 300, empty)" in text
    assert f"{TOPIC}[1]" not in text
    assert "retention" in text.lower()


def test_retention_during_the_read_is_data_loss() -> None:
    """The log's start moves past the read while it runs: the consumer's offset-reset
    error becomes a ``DataLossError`` with the offsets from the first one not yet read."""
    log = Log({o: _value(o) for o in range(0, 3000)}, Clock(), retain_from=(500, 2000))
    with pytest.raises(DataLossError) as info:
        _copy(log, [(0, 2999)])
    text = str(info.value)
    assert f"writer 1: {TOPIC}[0] offsets 500-1999 (1500 records;" in text, text
    assert "the log starts at offset 2000, its last offset 2999)" in text


def test_a_record_missing_inside_the_log_is_data_loss() -> None:
    records = {o: _value(o) for o in range(0, 100) if o not in (40, 41)}
    with pytest.raises(DataLossError, match=rf"{TOPIC}\[0\] offsets 40-41 \(2 records;"):
        _copy(Log(records, Clock()), [(0, 99)])


def test_a_log_that_ends_before_the_part_is_data_loss() -> None:
    with pytest.raises(DataLossError, match=rf"{TOPIC}\[0\] offsets 50-59 \(10 records;"):
        _copy(Log({o: _value(o) for o in range(0, 50)}, Clock()), [(0, 59)])


def test_a_read_without_progress_is_a_stall_naming_partition_and_offset() -> None:
    log = Log({o: _value(o) for o in range(0, 100)}, Clock(), stall=True)
    with pytest.raises(SinkUnavailableError,
                       match=rf"reading {TOPIC}\[0\] back made no progress for 30 s at "
                             r"offset 10 "):
        _copy(log, [(10, 99)])


def test_a_slow_flush_that_moves_has_no_overall_deadline_and_a_stuck_one_stalls() -> None:
    """Delivering one record per 0.5 s slice: 200 records take 100 s of the clock, over
    the 30 s ``timeout``, and go through; a flush that delivers nothing stalls."""
    clock = Clock()
    log = Log({o: _value(o) for o in range(0, 200)}, clock)
    _, producer = _copy(log, [(0, 199)], chunk=1_000_000,
                        producer=Producer(clock, per_flush=1))
    assert len(producer.delivered) == 200 and clock.now >= 100
    stuck = Log({o: _value(o) for o in range(0, 200)}, Clock())
    with pytest.raises(SinkUnavailableError, match=r"not delivered for 30 s \(the chunk "
                                                   rf"ends at {TOPIC}\[0\] offset 199\)"):
        _copy(stuck, [(0, 199)], chunk=1_000_000, producer=Producer(stuck.clock, per_flush=0))


def test_replay_chunk_bytes_is_checked_and_bounds_the_reader() -> None:
    settings = KafkaSink("127.0.0.1:9", TOPIC).settings
    assert settings.replay_chunk_bytes == 16 * 1024 * 1024
    with pytest.raises(ConfigError, match="replay_chunk_bytes"):
        KafkaSettings(bootstrap_servers="b:9", topic="a", progress_topic="p",
                      replay_chunk_bytes=0)
    tiny = KafkaSettings(bootstrap_servers="127.0.0.1:9", topic="a", progress_topic="p",
                         replay_chunk_bytes=4096)
    config = tiny.replay_consumer_config()
    assert config["auto.offset.reset"] == "error"
    assert config["isolation.level"] == "read_uncommitted"
    assert config["queued.max.messages.kbytes"] == 4
    confluent_kafka.Consumer(config).close()  # librdkafka accepts it
