"""An epoch's records produced partition by partition, and the offset runs they got, from
two delivery reports per chunk instead of one per record.

A replay of a lost part reads its records back at the offsets its manifest lists, so the
writer must know exactly where each record landed. librdkafka tells that only per
record, through a delivery report that ``confluent-kafka`` hands to a Python callback:
measured here at about 1.7 us of CPU per record, as much as producing it (a third of a
writer's time). So the writer instead:

1. **chooses each record's partition itself**, as librdkafka's default partitioner
   (``consistent_random``) would: the CRC-32 of the key modulo the partition count,
   computed for a whole batch with numpy (``key_partitions``); a record with no key (or an
   empty one), which librdkafka would place at random, goes to a partition a block of
   rows at a time. The key-to-partition mapping is the one raysink had before, so the
   order of a key's records carries across the change. A sink whose ``producer_config``
   names another ``partitioner`` keeps the per-record reports (``plan`` returns ``None``);
2. **produces partition by partition**, each writer starting at another partition, odd
   writers going the other way round (``partition_order``), so that two writers of one
   epoch seldom write one partition at the same time and their batches seldom interleave;
3. asks a delivery report for the **first and the last record of each chunk** (at most
   ``CHUNK`` consecutive records of one partition) only. An idempotent producer's records
   of one partition are written in order without gaps in their sequence numbers (the
   broker refuses a record whose predecessor is missing, and a transactional producer
   cannot go on past a lost record without aborting), so when a chunk's last offset
   minus its first is its count minus one, every record of the chunk is at the offsets
   between, and the chunk is one run of the manifest;
4. a chunk whose offsets spread wider (another producer's batch landed between two of its
   batches) is placed by reading its offsets back (``resolve``): its records are there in
   order, so matching them by key, value and headers places them for sure when the
   earliest and the latest match of each agree. Only when two placements fit (another
   producer wrote a record equal to one of ours beside it) does ``Chunks.runs`` return
   ``None``: the writer aborts the transaction (nothing of it is visible) and produces
   the epoch again with a report per record, as before.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import repeat
from operator import length_hint
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

if TYPE_CHECKING:
    from raysink.sinks.kafka._encode import Encoded

__all__ = ["BLOCK", "CHUNK", "Chunks", "Part", "Planner", "key_partitions", "partition_order",
           "plan"]

CHUNK = 512
"""Records of one partition between two pairs of delivery reports. Small, because a chunk
another writer's batch landed inside is read back (``resolve``) at a cost in proportion
to its size, while the reports cost two callbacks per chunk (a few microseconds): how
many chunks spread depends on how often the writers' batches interleave, not on the chunk
size (docs/kafka.md, "Throughput")."""

BLOCK = 4096
"""Records without a key placed in one partition before the next."""

_GOLDEN = 0.6180339887498949


def _crc_table() -> Any:
    """CRC-32 (the zlib polynomial, reflected) of each byte value."""
    table = np.arange(256, dtype=np.uint32)
    for _ in range(8):
        table = np.where(table & 1, (table >> 1) ^ np.uint32(0xEDB88320), table >> 1)
    return table.astype(np.uint32)


_CRC = _crc_table()


def key_partitions(keys: Any, count: int) -> Any:
    """Per record, librdkafka's ``consistent_random`` partition of its key (CRC-32 of the
    key's bytes, modulo ``count``), or -1 for a null or empty key (which it would place at
    random). One numpy step per byte position, over every key at once."""
    array = pc.cast(keys, pa.large_binary())
    if isinstance(array, pa.ChunkedArray):
        array = array.combine_chunks()
    rows = len(array)
    _, offsets_buffer, data_buffer = array.buffers()
    offsets = np.frombuffer(offsets_buffer, dtype=np.int64, count=rows + 1,
                            offset=array.offset * 8)
    data = (np.frombuffer(data_buffer, dtype=np.uint8) if data_buffer is not None
            else np.zeros(0, np.uint8))
    starts = offsets[:-1]
    lengths = offsets[1:] - starts
    if array.null_count:
        lengths = np.where(array.is_valid().to_numpy(zero_copy_only=False), lengths, 0)
    crc = np.full(rows, 0xFFFFFFFF, dtype=np.uint32)
    shortest = int(lengths.min()) if rows else 0
    if shortest == int(lengths.max()) and shortest and not array.null_count:
        # keys of one length (the common case: ids of a fixed format) are the rows of a
        # matrix: one strided column per byte position, no gather and no scatter
        base = int(starts[0])
        matrix = data[base:base + rows * shortest].reshape(rows, shortest)
        for position in range(shortest):
            crc = _CRC[(crc ^ matrix[:, position]) & 0xFF] ^ (crc >> np.uint32(8))
        crc ^= np.uint32(0xFFFFFFFF)
        return (crc % np.uint32(count)).astype(np.int64)
    active = np.flatnonzero(lengths > 0)
    position = 0
    while active.size:
        current = crc[active]
        byte = data[starts[active] + position]
        crc[active] = _CRC[(current ^ byte) & 0xFF] ^ (current >> np.uint32(8))
        position += 1
        active = active[lengths[active] > position]
    crc ^= np.uint32(0xFFFFFFFF)
    return np.where(lengths > 0, (crc % np.uint32(count)).astype(np.int64), -1)


def partition_order(count: int, writer: int) -> list[int]:
    """The partitions in the order writer ``writer`` produces to them: all of them, each
    writer starting elsewhere (spread by the golden ratio, whatever the writer count), odd
    writers going the other way round. Two writers going the same way whose pre-commits
    start a few partitions apart can follow each other through every partition (their
    batches interleaving all the way); going opposite ways they cross, and share a
    partition only while they cross."""
    start = int(writer * count * _GOLDEN) % count
    step = -1 if writer % 2 else 1
    return [(start + step * i) % count for i in range(count)]


@dataclass(frozen=True, slots=True)
class Part:
    """One batch's records of one partition, in their order, still in Arrow: they become
    Python objects (``rows``) only when produced, one part at a time, so the epoch's
    records never all exist as Python objects at once."""

    partition: int
    encoded: Encoded

    def rows(self) -> _Rows:
        return _Rows(self.partition, self.encoded.values, self.encoded.keys,
                     self.encoded.headers)

    @property
    def values(self) -> list[Any]:
        return self.encoded.values

    @property
    def keys(self) -> list[Any] | None:
        return self.encoded.keys


@dataclass(frozen=True, slots=True)
class _Rows:
    """A part's records as the client takes them."""

    partition: int
    values: list[Any]
    keys: list[Any] | None
    headers: list[list[tuple[str, Any]]] | None


@dataclass(slots=True)
class Planner:
    """Places one transaction's records, batch after batch (``plan``): the records
    without a key go on rotating a block of ``BLOCK`` at a time where the last batch
    left off, so a transaction produced in many small plans (an epoch begun early,
    ``KafkaWriter.start_early``) spreads them as one plan of every batch would."""

    count: int
    writer: int
    rotor: int = -1

    def __post_init__(self) -> None:
        if self.rotor < 0:
            self.rotor = self.writer

    def plan(self, buffer: Sequence[Encoded]) -> list[Part]:
        """``buffer``'s records grouped by partition (in ``partition_order``), each
        batch's in its row order: a key's records keep their order."""
        count = self.count
        by_partition: dict[int, list[Part]] = {p: [] for p in range(count)}
        for encoded in buffer:
            rows = len(encoded)
            if encoded.key_array is not None:
                chosen = key_partitions(encoded.key_array, count)
            else:
                chosen = np.full(rows, -1, dtype=np.int64)
            unkeyed = chosen < 0
            if unkeyed.any():  # a block of BLOCK rows per partition, rotating
                blocks = np.cumsum(unkeyed) - 1
                chosen = np.where(unkeyed, (self.rotor + blocks // BLOCK) % count, chosen)
                self.rotor += int(blocks[-1]) // BLOCK + 1
            order = np.argsort(chosen, kind="stable")
            bounds = np.searchsorted(chosen[order], np.arange(count + 1))
            for p in range(count):
                if bounds[p] == bounds[p + 1]:
                    continue
                taken = encoded.take(pa.array(order[bounds[p]:bounds[p + 1]]))
                by_partition[p].append(Part(p, taken))
        return [part for p in partition_order(count, self.writer)
                for part in by_partition[p]]


def plan(buffer: Sequence[Encoded], count: int, writer: int) -> list[Part]:
    """The epoch's records grouped by partition (in ``partition_order``), each batch's in
    its row order: a key's records keep their order (one ``Planner``'s plan)."""
    return Planner(count, writer).plan(buffer)


@dataclass(slots=True)
class _Chunk:
    partition: int
    count: int = 0
    first: int | None = None
    last: int | None = None
    # the parts' rows it holds: (part, begin, end); its offsets once read back
    segments: list[tuple[Part, int, int]] = field(default_factory=list)
    offsets: list[int] | None = None

    def spread(self) -> bool:
        """Both reports in, and more offsets between them than records."""
        return (self.first is not None and self.last is not None
                and self.last - self.first + 1 != self.count)


@dataclass(slots=True)
class Chunks:
    """The chunks of one transaction and their two delivery reports each."""

    chunks: list[_Chunk] = field(default_factory=list)
    error: Any = None
    reports: int = 0

    def report(self, index: int, end: str, err: Any, msg: Any) -> None:
        self.reports += 1
        if err is not None:
            if self.error is None:
                self.error = err
            return
        setattr(self.chunks[index], end, int(msg.offset()))

    def runs(self) -> dict[str, list[list[int]]] | None:
        """Per partition the runs ``[first, count]`` (adjacent chunks joined), or ``None``
        when a chunk's records are not contiguous (see the module docstring)."""
        runs: dict[int, list[list[int]]] = {}
        for chunk in self.chunks:
            if chunk.first is None or chunk.last is None:
                return None
            if chunk.offsets is not None:
                pieces = _runs_of(chunk.offsets)
            elif chunk.last - chunk.first + 1 == chunk.count:
                pieces = [[chunk.first, chunk.count]]
            else:
                return None
            mine = runs.setdefault(chunk.partition, [])
            for first, count in pieces:
                if mine and mine[-1][0] + mine[-1][1] == first:
                    mine[-1][1] += count
                else:
                    mine.append([first, count])
        return {str(p): r for p, r in sorted(runs.items())}

    def spread(self) -> list[_Chunk]:
        return [c for c in self.chunks if c.spread() and c.offsets is None]


def _runs_of(offsets: Sequence[int]) -> list[list[int]]:
    runs: list[list[int]] = []
    for offset in offsets:
        if runs and runs[-1][0] + runs[-1][1] == offset:
            runs[-1][1] += 1
        else:
            runs.append([offset, 1])
    return runs


Record = tuple[Any, Any, tuple[tuple[str, Any], ...]]


def _as_bytes(data: Any) -> Any:
    return data.encode() if isinstance(data, str) else data


def _ours(chunk: _Chunk) -> list[Record]:
    """The chunk's records as the log holds them: key, value, headers, as bytes."""
    records: list[Record] = []
    for part, begin, end in chunk.segments:
        rows = part.rows()
        keys = rows.keys or [None] * len(rows.values)
        for i in range(begin, end):
            headers = rows.headers[i] if rows.headers is not None else []
            records.append((_as_bytes(keys[i]), _as_bytes(rows.values[i]),
                            tuple((n, _as_bytes(v)) for n, v in headers)))
    return records


def place(chunk: _Chunk, log: Sequence[tuple[int, Record]]) -> list[int] | None:
    """The offsets of the chunk's records among ``log`` (the records from its first
    offset to its last, in order, another producer's among them), or ``None`` when more
    than one placement fits. The records are in order, so the placement is unique exactly
    when the earliest match of each record (scanning forward) and the latest (scanning
    backward) agree."""
    ours = _ours(chunk)
    earliest: list[int] = []
    for offset, record in log:
        if len(earliest) < len(ours) and record == ours[len(earliest)]:
            earliest.append(offset)
    latest: list[int] = []
    for offset, record in reversed(log):
        if len(latest) < len(ours) and record == ours[len(ours) - 1 - len(latest)]:
            latest.append(offset)
    latest.reverse()
    if len(earliest) != len(ours) or earliest != latest:
        return None
    return earliest


def read_back(consumer: Any, topic: str, chunk: _Chunk, timeout: float,
              clock: Callable[[], float]) -> list[tuple[int, Record]] | None:
    """The records of ``topic[chunk.partition]`` from the chunk's first offset to its
    last (``read_uncommitted``), or ``None`` if they did not come within ``timeout``."""
    from raysink.sinks.kafka._config import kafka_module

    assert chunk.first is not None and chunk.last is not None
    consumer.assign([kafka_module().TopicPartition(topic, chunk.partition, chunk.first)])
    log: list[tuple[int, Record]] = []
    deadline = clock() + timeout
    try:
        while clock() < deadline:
            for message in consumer.consume(10_000, 0.2):
                if message.error() is not None:
                    continue
                offset = int(message.offset())
                if offset > chunk.last:
                    return log
                log.append((offset, (message.key(), message.value(),
                                     tuple(message.headers() or ()))))
                if offset == chunk.last:
                    return log
        return None
    finally:
        consumer.unassign()


def resolve(consumer: Any, topic: str, chunks: Chunks, timeout: float,
            clock: Callable[[], float]) -> bool:
    """Place every spread chunk's records by reading its offsets back; ``False`` when one
    cannot be placed for sure (or read)."""
    for chunk in chunks.spread():
        log = read_back(consumer, topic, chunk, timeout, clock)
        chunk.offsets = None if log is None else place(chunk, log)
        if chunk.offsets is None:
            return False
    return True


def produce_parts(producer: Any, topic: str, parts: Sequence[Part], chunks: Chunks,
                  wait: Callable[[], None]) -> None:
    """Produce ``parts`` with explicit partitions, a delivery report on the first and the
    last record of each chunk; a full local queue is waited out with ``wait``."""
    current: _Chunk | None = None
    for index, planned in enumerate(parts):
        closes = index == len(parts) - 1 or parts[index + 1].partition != planned.partition
        part = planned.rows()
        rows, at = len(part.values), 0
        while at < rows:
            if current is None or current.partition != part.partition:
                current = _Chunk(part.partition)
                chunks.chunks.append(current)
            number = len(chunks.chunks) - 1
            end = min(rows, at + CHUNK - current.count)
            current.segments.append((planned, at, end))
            full = current.count + end - at == CHUNK or (end == rows and closes)
            first = at if current.count == 0 else None
            last = end - 1 if full else None
            stop = end if last is None else last
            begin = at
            if first is not None:
                end_of_first = "last" if last == first else None
                _send(producer, topic, part, first, wait,
                      _marks(chunks, number, "first", end_of_first))
                begin = first + 1
            if begin < stop:
                _send_range(producer, topic, part, begin, stop, wait)
            if last is not None and last != first:
                _send(producer, topic, part, last, wait, _marks(chunks, number, "last"))
            current.count += end - at
            if full:
                current = None
            at = end
            producer.poll(0)


def _marks(chunks: Chunks, index: int, *ends: str | None) -> Callable[[Any, Any], None]:
    """The delivery report of a chunk's first or last record (or both)."""
    names = [e for e in ends if e is not None]

    def report(err: Any, msg: Any) -> None:
        for end in names:
            chunks.report(index, end, err, msg)
    return report


def _send(producer: Any, topic: str, part: _Rows, row: int, wait: Callable[[], None],
          report: Callable[[Any, Any], None]) -> None:
    key = None if part.keys is None else part.keys[row]
    options: dict[str, Any] = {"partition": part.partition, "on_delivery": report}
    if part.headers is not None:
        options["headers"] = part.headers[row]
    while True:
        try:
            producer.produce(topic, part.values[row], key, **options)
            return
        except BufferError:
            wait()


def _send_range(producer: Any, topic: str, part: _Rows, begin: int, end: int,
                wait: Callable[[], None]) -> None:
    """Records ``begin`` to ``end`` (exclusive) of ``part``, without reports, in order."""
    values = part.values[begin:end]
    keys = None if part.keys is None else part.keys[begin:end]
    if part.headers is None:
        produce_in_order(producer.produce, topic, part.partition, values, keys, wait)
        return
    produce, partition = producer.produce, part.partition
    for value, key, headers in zip(values, keys or [None] * len(values),
                                   part.headers[begin:end], strict=True):
        while True:
            try:
                produce(topic, value, key, partition, headers=headers)
                break
            except BufferError:
                wait()


def produce_in_order(produce: Callable[..., None], topic: str, partition: int,
                     values: list[Any], keys: list[Any] | None,
                     wait: Callable[[], None]) -> None:
    """``produce(topic, value, key, partition)`` for each record, in order, without a
    Python step per record: ``map`` drives the client's C call and ``deque(maxlen=0)``
    drains it. When the client's queue is full, ``produce`` raises ``BufferError`` for the
    record it could not take; every record before it was taken (``map`` calls them one
    after another), and how far ``map`` got is read off the values' iterator
    (``length_hint``: a list iterator knows exactly how many items it has left), so after
    ``wait`` the loop goes on at that very record: none is skipped and none is produced
    twice (``tests/unit/test_kafka_batches.py``)."""
    at = 0
    while at < len(values):
        remaining = iter(values[at:] if at else values)
        tail = repeat(None) if keys is None else iter(keys[at:] if at else keys)
        try:
            deque(map(produce, repeat(topic), remaining, tail, repeat(partition)), 0)
            return
        except BufferError:
            # the values' iterator gave up the refused record before the call raised
            at = len(values) - length_hint(remaining) - 1
            wait()
