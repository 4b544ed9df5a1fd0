"""Writing a part of a decided epoch again, when the writer that held its transaction
lost it (the writer died, was replaced, or its transaction timed out or was fenced).

The part's records are still in the data topic, in an aborted (or dead) transaction, at
the offsets its manifest lists. The coordinator's committer reads them back with a
``read_uncommitted`` consumer and produces them again, each to its original partition
with its key, headers and timestamp, in its own transaction, with the part's progress
record and the epoch's. Before it writes anything:

1. it fences every part transaction no live writer vouched for (``Held.UNKNOWN``):
   ``init_transactions`` under that transactional id ends the producer that held it, so
   no zombie can commit the original afterwards;
2. it reads the progress topic to its end (``strict``): a part (or the whole epoch) a
   previous commit already got in is not written again. The committer's own
   transactional id was taken over by this process (``KafkaSink._claim``) before, so no
   earlier committer is still writing;
3. it asks the broker where each partition's log starts and ends now: a part whose
   offsets retention (or ``delete_records``, or a re-created topic) took is a
   ``DataLossError`` naming the epoch, the writer and per partition the missing offsets
   and the log's start, raised before any transaction begins. Nothing can write that
   epoch again: retrying would only stall the sink with the wrong cause (the consumer's
   default ``auto.offset.reset`` jumped to the log's end and the read timed out, for
   ever). The replay's reader sets ``auto.offset.reset=error``, so an offset retention
   takes while the replay reads is the same ``DataLossError``.

**Streamed in chunks.** A lost part can be as large as an epoch, and the replay may run
long after ``transaction_timeout``. The records are read in offset order and held at most
``replay_chunk_bytes`` (``KafkaSettings``; 16 MiB by default) at a time: a full chunk is
produced and flushed (its delivery awaited) before the next is read, and librdkafka's
prefetch is kept near one chunk (``replay_consumer_config``). So a replay holds about two
chunks of records plus one fetch (1 MiB), whatever the epoch's size, and when the
committer commits, nothing is left to flush. No deadline covers the whole replay: a read
or a flush that makes no progress for ``timeout`` seconds is a stall
(``SinkUnavailableError`` naming the partition and offset), a slow one that moves is not.

Ordering: the writers pre-commit an epoch only once every earlier one is committed
(``Sink.holds_transactions``), so when an epoch is replayed no later epoch has records in
the data topic yet: the replayed records still precede every later epoch's.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from raysink.errors import DataLossError, SinkUnavailableError
from raysink.sinks.base import Held
from raysink.sinks.kafka._config import kafka_module, unavailable
from raysink.sinks.kafka._progress import KafkaManifest, epoch_key, part_key, record_value

if TYPE_CHECKING:
    from raysink.sinks.kafka._roles import CommittingSink

__all__ = ["Chunks", "Gone", "fence", "part_ranges", "replay"]

log = logging.getLogger(__name__)

Range = tuple[int, int]  # first and last offset, inclusive

# offsets between two runs of a part that are read through rather than sought over
_SEEK_GAP = 10_000


def fence(sink: CommittingSink, txn: str) -> None:
    """Take ``txn`` over and let it go: its earlier holder is fenced, and the transaction
    it left open is aborted."""
    ck = kafka_module()
    producer = ck.Producer(sink.settings.producer_config(txn))
    try:
        producer.init_transactions(sink.settings.timeout)
    except ck.KafkaException as exc:
        raise unavailable(sink.settings, f"could not fence transactional id {txn!r}",
                          exc) from exc
    finally:
        producer.flush(0)
    log.info("kafka sink %s/%s: fenced %s", sink.runtime, sink.name, txn)


def replay(sink: CommittingSink, epoch: int, attempt: int,
           parts: Sequence[tuple[KafkaManifest, Held]]) -> bool:
    """Write ``parts`` of ``epoch`` again with the progress records, in one transaction of
    the sink's committer. Returns ``False`` when the progress topic says the epoch is in."""
    started = time.monotonic()
    for manifest, held in parts:
        if held is Held.UNKNOWN:
            fence(sink, str(manifest["txn"]))
    reader = sink.progress()
    done = reader.committed_epoch(strict=True)
    if done is not None and done >= epoch:
        return False
    todo = [m for m, _ in parts if not reader.part_committed(int(m["writer"]), epoch)]
    ck = kafka_module()
    settings = sink.settings
    consumer = ck.Consumer(settings.replay_consumer_config())
    try:
        check_retained(consumer, sink, epoch, todo)
        committer = sink.begin_committer_transaction(epoch)
        committer_state = sink.committer()
        chunks = Chunks(consumer, committer, chunk_bytes=settings.replay_chunk_bytes,
                        timeout=settings.timeout, flush=committer_state.watch_flush,
                        where={"runtime": sink.runtime, "sink": sink.name, "epoch": epoch})
        try:
            for manifest in todo:
                writer = int(manifest["writer"])
                topic = str(manifest.get("topic", settings.topic))
                for partition, ranges in part_ranges(manifest):
                    chunks.copy(topic, partition, ranges, writer=writer)
                chunks.produce(settings.progress_topic,
                               record_value(epoch, attempt, writer=writer, replayed=True),
                               part_key(sink.runtime, sink.name, writer))
            chunks.produce(settings.progress_topic, sink.epoch_record(epoch, attempt),
                           epoch_key(sink.runtime, sink.name))
            chunks.drain()
        except ck.KafkaException as exc:
            raise committer_state.failed(exc, epoch) from exc
    finally:
        consumer.close()
    sink.end_committer_transaction(committer, epoch)
    log.warning("kafka sink %s/%s: epoch %s: replayed %d records of writers %s (their "
                "transactions were lost) in %.2fs, in %d chunks of at most %d bytes",
                sink.runtime, sink.name, epoch, chunks.copied,
                [int(m["writer"]) for m in todo], time.monotonic() - started,
                chunks.flushes, settings.replay_chunk_bytes)
    return True


# -- what the log still holds ------------------------------------------------------------


def part_ranges(manifest: KafkaManifest) -> list[tuple[int, list[Range]]]:
    """Per partition (in order), the part's offset runs as sorted ranges, adjacent and
    overlapping runs merged."""
    result: list[tuple[int, list[Range]]] = []
    runs: dict[str, list[list[int]]] = manifest.get("runs", {})
    for partition in sorted(runs, key=int):
        ranges: list[Range] = []
        for first, count in sorted((int(r[0]), int(r[1])) for r in runs[partition]):
            if count < 1:
                continue
            if ranges and first <= ranges[-1][1] + 1:
                ranges[-1] = (ranges[-1][0], max(ranges[-1][1], first + count - 1))
            else:
                ranges.append((first, first + count - 1))
        if ranges:
            result.append((int(partition), ranges))
    return result


@dataclass(frozen=True, slots=True)
class Gone:
    """Offsets of one part that the partition's log no longer holds."""

    writer: int
    topic: str
    partition: int
    first: int
    last: int
    records: int
    log_start: int
    log_end: int

    def __str__(self) -> str:
        end = ("empty" if self.log_end <= self.log_start
               else f"its last offset {self.log_end - 1}")
        return (f"writer {self.writer}: {self.topic}[{self.partition}] offsets "
                f"{self.first}-{self.last} ({self.records} records; the log starts at "
                f"offset {self.log_start}, {end})")


def _outside(ranges: Sequence[Range], low: int, high: int) -> list[Range]:
    """The parts of ``ranges`` below ``low`` or at/after ``high``."""
    out: list[Range] = []
    for first, last in ranges:
        if first < low:
            out.append((first, min(last, low - 1)))
        if last >= high:
            out.append((max(first, high, low), last))
    return [(a, b) for a, b in out if a <= b]


def check_retained(consumer: Any, sink: CommittingSink, epoch: int,
                   manifests: Sequence[KafkaManifest]) -> None:
    """``DataLossError`` naming every partition whose log no longer holds offsets of the
    parts (asked of the partition leaders, not a cache)."""
    gone: list[Gone] = []
    for manifest in manifests:
        topic = str(manifest.get("topic", sink.settings.topic))
        for partition, ranges in part_ranges(manifest):
            low, high = _watermarks(consumer, sink.settings, topic, partition)
            missing = _outside(ranges, low, high)
            if missing:
                gone.append(Gone(int(manifest["writer"]), topic, partition,
                                 missing[0][0], missing[-1][1],
                                 sum(b - a + 1 for a, b in missing), low, high))
    if gone:
        raise lost(gone, runtime=sink.runtime, sink=sink.name, epoch=epoch)


def lost(gone: Sequence[Gone], **where: Any) -> DataLossError:
    """The ``DataLossError`` of a replay whose records are gone, with what to do."""
    epoch = where.get("epoch")
    return DataLossError(
        f"epoch {epoch} cannot be replayed: its writers' transactions were lost and "
        f"records of their parts are gone from the data topic: "
        f"{'; '.join(str(g) for g in gone)}. Retention (retention.ms / retention.bytes), "
        "delete_records or a re-created topic removed them before the epoch was committed, "
        f"so epoch {epoch}'s rows cannot reach this sink from Kafka: the sink stays stalled "
        "with the epoch pending. Write those rows again from their source; and keep the "
        "data topic's retention well above transaction_timeout plus the longest outage",
        **where)


def _watermarks(consumer: Any, settings: Any, topic: str, partition: int) -> tuple[int, int]:
    ck = kafka_module()
    try:
        low, high = consumer.get_watermark_offsets(ck.TopicPartition(topic, partition),
                                                   timeout=settings.timeout, cached=False)
    except ck.KafkaException as exc:
        raise unavailable(settings, f"did not say where {topic}[{partition}] starts",
                          exc) from exc
    return int(low), int(high)


# -- the chunked copy ----------------------------------------------------------------------

@dataclass(slots=True)
class Chunks:
    """Copies ranges of records from ``consumer`` to ``producer`` holding at most
    ``chunk_bytes`` (and one record more) read and not yet delivered: a full chunk is
    produced and flushed before more is read. ``flush(producer, seconds)`` returns the
    records still queued. A read or flush with no progress for ``timeout`` seconds is a
    stall (``SinkUnavailableError``); a record missing from the log, a
    ``DataLossError``."""

    consumer: Any
    producer: Any
    chunk_bytes: int
    timeout: float
    flush: Callable[[Any, float], int]
    where: dict[str, Any]
    clock: Callable[[], float] = time.monotonic
    copied: int = 0
    flushes: int = 0
    peak_bytes: int = 0  # the most bytes held at once (what bounds memory)
    _held: list[tuple[str, int, Any]] = field(default_factory=list)
    _bytes: int = 0

    def copy(self, topic: str, partition: int, ranges: Sequence[Range], *,
             writer: int) -> None:
        """Read ``ranges`` of ``topic[partition]`` in offset order, producing as it goes."""
        ck = kafka_module()
        index, expect = 0, ranges[0][0]
        self.consumer.assign([ck.TopicPartition(topic, partition, expect)])
        position, moved = expect, self.clock()
        try:
            while True:
                if self.clock() - moved > self.timeout:
                    raise SinkUnavailableError(
                        f"replaying epoch {self.where.get('epoch')}: reading {topic}"
                        f"[{partition}] back made no progress for {self.timeout:g} s at "
                        f"offset {position} (writer {writer}'s records run to "
                        f"{ranges[-1][1]}): its leader does not answer", **self.where)
                message = self.consumer.poll(0.2)
                if message is None:
                    continue
                if message.error() is not None:
                    self._read_error(message, topic, partition, expect, ranges, writer)
                    continue
                offset = int(message.offset())
                position, moved = offset + 1, self.clock()
                if offset < expect:
                    continue  # another producer's record between two runs
                if offset > expect:
                    self._skipped(topic, partition, expect, offset, ranges, writer)
                self._hold(topic, partition, message)
                expect += 1
                if expect > ranges[index][1]:
                    index += 1
                    if index == len(ranges):
                        return
                    expect = ranges[index][0]
                    if expect - position > _SEEK_GAP:
                        self.consumer.assign([ck.TopicPartition(topic, partition, expect)])
                        position = expect
        finally:
            self.consumer.unassign()

    def _read_error(self, message: Any, topic: str, partition: int, expect: int,
                    ranges: Sequence[Range], writer: int) -> None:
        """The end of the log before the part's next offset, or an offset out of the
        log's range: ``DataLossError`` when the broker's watermarks confirm it (else
        the read goes on, and the stall clock bounds it)."""
        ck = kafka_module()
        code = message.error().code()
        if code == ck.KafkaError._PARTITION_EOF:
            if int(message.offset()) <= expect:
                self._check_held(topic, partition, expect, ranges, writer)
        elif code in (ck.KafkaError._AUTO_OFFSET_RESET, ck.KafkaError.OFFSET_OUT_OF_RANGE):
            self._check_held(topic, partition, expect, ranges, writer)
            self.consumer.assign([ck.TopicPartition(topic, partition, expect)])
        else:
            log.debug("replay read of %s[%s]: %s", topic, partition, message.error())

    def _check_held(self, topic: str, partition: int, expect: int,
                    ranges: Sequence[Range], writer: int) -> None:
        """``DataLossError`` when the log no longer holds offsets from ``expect`` on."""
        low, high = self.consumer.get_watermark_offsets(
            kafka_module().TopicPartition(topic, partition), timeout=self.timeout,
            cached=False)
        rest = [(max(a, expect), b) for a, b in ranges if b >= expect]
        missing = _outside(rest, int(low), int(high))
        if missing:
            raise lost([Gone(writer, topic, partition, missing[0][0], missing[-1][1],
                             sum(b - a + 1 for a, b in missing), int(low), int(high))],
                       **self.where)

    def _skipped(self, topic: str, partition: int, expect: int, reached: int,
                 ranges: Sequence[Range], writer: int) -> None:
        """``DataLossError``: the log gave ``reached`` where the part's ``expect`` was
        (compacted, or another log under the topic's name)."""
        low, high = self.consumer.get_watermark_offsets(
            kafka_module().TopicPartition(topic, partition), timeout=self.timeout,
            cached=False)
        missing = [(max(a, expect), min(b, reached - 1)) for a, b in ranges
                   if b >= expect and a < reached]
        raise lost([Gone(writer, topic, partition, missing[0][0], missing[-1][1],
                         sum(b - a + 1 for a, b in missing), int(low), int(high))],
                   **self.where)

    def _hold(self, topic: str, partition: int, message: Any) -> None:
        size = len(message.value() or b"") + len(message.key() or b"")
        for _, value in message.headers() or ():
            size += len(value or b"")
        self._held.append((topic, partition, message))
        self._bytes += size
        self.peak_bytes = max(self.peak_bytes, self._bytes)
        if self._bytes >= self.chunk_bytes:
            self._emit()

    def produce(self, topic: str, value: bytes, key: str) -> None:
        """A progress record, after the records held so far."""
        self._emit()
        self._send(topic, value, key)

    def drain(self) -> None:
        """Produce what is held and wait until every record is delivered."""
        self._emit()

    def _emit(self) -> None:
        """Produce the held records in order, then flush until all are delivered, each
        slice of progress restarting the stall clock."""
        for topic, partition, message in self._held:
            kind, timestamp = message.timestamp()
            self._send(topic, message.value(), message.key(), partition=partition,
                       headers=message.headers(), timestamp=timestamp if kind else 0)
        self.copied += len(self._held)
        last = self._held[-1] if self._held else None
        self._held, self._bytes = [], 0
        left, moved = -1, self.clock()
        while left != 0:
            now_left = self.flush(self.producer, 0.5)
            if left < 0 or now_left < left:
                moved = self.clock()
            left = now_left
            if left and self.clock() - moved > self.timeout:
                at = (f" (the chunk ends at {last[0]}[{last[1]}] offset {last[2].offset()})"
                      if last is not None else "")
                raise SinkUnavailableError(
                    f"replaying epoch {self.where.get('epoch')}: {left} records were not "
                    f"delivered for {self.timeout:g} s{at}: the brokers do not take them",
                    **self.where)
        if last is not None:
            self.flushes += 1

    def _send(self, topic: str, value: Any, key: Any, **options: Any) -> None:
        """Produce one record, waiting (with the stall clock) while the client's queue is
        full."""
        moved = self.clock()
        while True:
            try:
                self.producer.produce(topic, value, key, **options)
                return
            except BufferError:
                if self.clock() - moved > self.timeout:
                    raise SinkUnavailableError(
                        f"replaying epoch {self.where.get('epoch')}: the producer's queue "
                        f"stayed full for {self.timeout:g} s", **self.where) from None
                self.producer.poll(0.05)
