"""The few Kafka requests librdkafka does not offer, spoken on the wire.

``confluent-kafka`` (2.16) has no call to describe a partition's producers or to write a
transaction marker, which is what finding and ending a *hanging transaction* takes
(KIP-664: Kafka's own ``kafka-transactions.sh find-hanging`` and ``abort`` use
``DescribeProducers`` and ``WriteTxnMarkers``). Both are small requests sent to the
partition's leader, so this module speaks them itself:

* ``describe_producers(address, topic, partition)``: every producer the leader keeps for
  the partition, with the first offset of its open transaction (``-1`` for none), its
  producer epoch, the transaction coordinator's epoch and its last write's time;
* ``write_txn_marker(address, topic, partition, producer, commit=...)``: the marker the
  transaction coordinator should have written.

Only a plaintext listener is spoken to (no TLS, no SASL): with ``security.protocol`` set
in ``client_config`` the caller says what command to run instead.

Framing (the Kafka protocol guide): a request is ``int32 size`` then the header (api key,
version, correlation id, client id, then tagged fields for flexible versions) then the
body; both requests here are flexible versions (compact strings and arrays, tagged
fields, always empty here).
"""

from __future__ import annotations

import socket
import struct
from dataclasses import dataclass
from typing import Any

__all__ = ["Batch", "ProducerState", "WireError", "describe_producers", "fetch_batches",
           "uvarint", "write_txn_marker"]

_DESCRIBE_PRODUCERS = (61, 0)
_WRITE_TXN_MARKERS = (27, 1)
_CLIENT_ID = b"raysink"


class WireError(Exception):
    """A request could not be sent or was refused: ``code`` is Kafka's error code (0 when
    the failure was the connection's)."""

    def __init__(self, message: str, code: int = 0) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True, slots=True)
class ProducerState:
    """One producer a partition's leader knows (``DescribeProducers``)."""

    producer_id: int
    producer_epoch: int
    last_sequence: int
    last_timestamp_ms: int
    coordinator_epoch: int
    txn_start_offset: int  # -1: no open transaction on this partition


# -- encoding -------------------------------------------------------------------------

def uvarint(value: int) -> bytes:
    """An unsigned varint (Kafka's flexible versions: lengths, tag counts)."""
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def compact_string(text: str | None) -> bytes:
    if text is None:
        return uvarint(0)
    raw = text.encode()
    return uvarint(len(raw) + 1) + raw


def compact_array(items: list[bytes]) -> bytes:
    return uvarint(len(items) + 1) + b"".join(items)


NO_TAGS = uvarint(0)


class Reader:
    """Reads a response body field by field."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.at = 0

    def _take(self, fmt: str) -> Any:
        value = struct.unpack_from(fmt, self.data, self.at)[0]
        self.at += struct.calcsize(fmt)
        return value

    def int8(self) -> int:
        return int(self._take(">b"))

    def int16(self) -> int:
        return int(self._take(">h"))

    def int32(self) -> int:
        return int(self._take(">i"))

    def int64(self) -> int:
        return int(self._take(">q"))

    def uvarint(self) -> int:
        shift = value = 0
        while True:
            byte = self.data[self.at]
            self.at += 1
            value |= (byte & 0x7F) << shift
            if not byte & 0x80:
                return value
            shift += 7

    def compact_string(self) -> str | None:
        length = self.uvarint()
        if length == 0:
            return None
        text = self.data[self.at:self.at + length - 1].decode(errors="replace")
        self.at += length - 1
        return text

    def array_length(self) -> int:
        return max(0, self.uvarint() - 1)

    def skip_tags(self) -> None:
        for _ in range(self.uvarint()):
            self.uvarint()
            self.at += self.uvarint()


# -- one request ----------------------------------------------------------------------

def request(address: tuple[str, int], api: tuple[int, int], body: bytes, *,
            timeout: float) -> Reader:
    """Send one request to the broker at ``address`` and return its response body (after
    the flexible response header)."""
    key, version = api
    header = (struct.pack(">hhi", key, version, 1)
              + struct.pack(">h", len(_CLIENT_ID)) + _CLIENT_ID + NO_TAGS)
    frame = header + body
    try:
        with socket.create_connection(address, timeout=timeout) as conn:
            conn.settimeout(timeout)
            conn.sendall(struct.pack(">i", len(frame)) + frame)
            size = struct.unpack(">i", _read_exactly(conn, 4))[0]
            data = _read_exactly(conn, size)
    except OSError as exc:
        raise WireError(f"broker {address[0]}:{address[1]} did not answer request "
                        f"{key} v{version}: {exc}") from exc
    reader = Reader(data)
    reader.int32()  # correlation id
    reader.skip_tags()
    return reader


def _read_exactly(conn: socket.socket, size: int) -> bytes:
    chunks, left = [], size
    while left:
        chunk = conn.recv(min(left, 1 << 20))
        if not chunk:
            raise OSError("connection closed mid-response")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


# -- DescribeProducers ----------------------------------------------------------------

def describe_producers(address: tuple[str, int], topic: str, partition: int, *,
                       timeout: float = 10.0) -> list[ProducerState]:
    """The producers the leader of ``topic[partition]`` at ``address`` keeps."""
    body = compact_array([compact_string(topic)
                          + compact_array([struct.pack(">i", partition)]) + NO_TAGS]) + NO_TAGS
    reader = request(address, _DESCRIBE_PRODUCERS, body, timeout=timeout)
    reader.int32()  # throttle
    found: list[ProducerState] = []
    for _ in range(reader.array_length()):
        reader.compact_string()
        for _ in range(reader.array_length()):
            reader.int32()
            code = reader.int16()
            message = reader.compact_string()
            if code:
                raise WireError(f"DescribeProducers of {topic}[{partition}] failed: error "
                                f"{code} {message or ''}".rstrip(), code)
            for _ in range(reader.array_length()):
                found.append(ProducerState(
                    producer_id=reader.int64(), producer_epoch=reader.int32(),
                    last_sequence=reader.int32(), last_timestamp_ms=reader.int64(),
                    coordinator_epoch=reader.int32(), txn_start_offset=reader.int64()))
                reader.skip_tags()
            reader.skip_tags()
        reader.skip_tags()
    return found


# -- WriteTxnMarkers ------------------------------------------------------------------

def write_txn_marker(address: tuple[str, int], topic: str, partition: int,
                     producer: ProducerState, *, commit: bool, timeout: float = 10.0
                     ) -> None:
    """Write a COMMIT (``commit``) or ABORT marker for ``producer``'s open transaction on
    ``topic[partition]`` at its leader ``address``."""
    marker = (struct.pack(">qh?", producer.producer_id, producer.producer_epoch, commit)
              + compact_array([compact_string(topic)
                               + compact_array([struct.pack(">i", partition)]) + NO_TAGS])
              + struct.pack(">i", producer.coordinator_epoch) + NO_TAGS)
    reader = request(address, _WRITE_TXN_MARKERS, compact_array([marker]) + NO_TAGS,
                     timeout=timeout)
    for _ in range(reader.array_length()):
        reader.int64()
        for _ in range(reader.array_length()):
            reader.compact_string()
            for _ in range(reader.array_length()):
                reader.int32()
                code = reader.int16()
                reader.skip_tags()
                if code:
                    raise WireError(f"WriteTxnMarkers on {topic}[{partition}] for producer "
                                    f"{producer.producer_id} refused: error {code}", code)
            reader.skip_tags()
        reader.skip_tags()


# -- Fetch: record batches with their producer ------------------------------------------

_FETCH = (1, 12)


@dataclass(frozen=True, slots=True)
class Batch:
    """One record batch as the log holds it: whose it is, and (uncompressed) its records'
    offsets, keys and values; ``records`` is ``None`` for a compressed batch."""

    base_offset: int
    last_offset: int
    producer_id: int
    transactional: bool
    control: bool
    records: list[tuple[int, bytes | None, bytes | None]] | None


def fetch_batches(address: tuple[str, int], topic: str, partition: int, offset: int, *,
                  max_bytes: int = 4 << 20, timeout: float = 10.0) -> list[Batch]:
    """The record batches of ``topic[partition]`` from ``offset`` on (``read_uncommitted``:
    open and aborted transactions included), up to ``max_bytes``."""
    part = (struct.pack(">iiqiqi", partition, -1, offset, -1, -1, max_bytes) + NO_TAGS)
    body = (struct.pack(">iiiibii", -1, 0, 1, max_bytes, 0, 0, -1)
            + compact_array([compact_string(topic) + compact_array([part]) + NO_TAGS])
            + compact_array([]) + compact_string("") + NO_TAGS)
    reader = request(address, _FETCH, body, timeout=timeout)
    reader.int32()  # throttle
    code = reader.int16()
    reader.int32()  # session
    if code:
        raise WireError(f"Fetch of {topic}[{partition}] failed: error {code}", code)
    batches: list[Batch] = []
    for _ in range(reader.array_length()):
        reader.compact_string()
        for _ in range(reader.array_length()):
            reader.int32()
            code = reader.int16()
            reader.int64(), reader.int64(), reader.int64()
            for _ in range(reader.array_length()):  # aborted transactions (none asked)
                reader.int64(), reader.int64()
                reader.skip_tags()
            reader.int32()  # preferred read replica
            size = reader.uvarint() - 1
            raw = reader.data[reader.at:reader.at + max(size, 0)]
            reader.at += max(size, 0)
            reader.skip_tags()
            if code:
                raise WireError(f"Fetch of {topic}[{partition}] failed: error {code}", code)
            batches.extend(parse_batches(raw))
        reader.skip_tags()
    return batches


def parse_batches(raw: bytes) -> list[Batch]:
    """Record batches (magic 2) in ``raw``; a partial batch at its end is left out."""
    batches: list[Batch] = []
    at = 0
    while at + 61 <= len(raw):
        base, length = struct.unpack_from(">qi", raw, at)
        end = at + 12 + length
        if end > len(raw):
            break
        (attributes, last_delta, _first_ts, _max_ts, producer_id, _epoch, _seq,
         count) = struct.unpack_from(">hiqqqhii", raw, at + 21)
        compressed = attributes & 0x07
        records = None if compressed else _records(raw[at + 61:end], base, count)
        batches.append(Batch(base_offset=base, last_offset=base + last_delta,
                             producer_id=producer_id, transactional=bool(attributes & 0x10),
                             control=bool(attributes & 0x20), records=records))
        at = end
    return batches


def _records(raw: bytes, base: int, count: int
             ) -> list[tuple[int, bytes | None, bytes | None]]:
    reader = Reader(raw)
    out: list[tuple[int, bytes | None, bytes | None]] = []
    for _ in range(count):
        length = _zigzag(reader.uvarint())
        start = reader.at
        reader.int8()  # attributes
        reader.uvarint()  # timestamp delta
        delta = _zigzag(reader.uvarint())
        key = _varbytes(reader)
        value = _varbytes(reader)
        out.append((base + delta, key, value))
        reader.at = start + length
    return out


def _zigzag(raw: int) -> int:
    return (raw >> 1) ^ -(raw & 1)


def _varbytes(reader: Reader) -> bytes | None:
    size = _zigzag(reader.uvarint())
    if size < 0:
        return None
    data = reader.data[reader.at:reader.at + size]
    reader.at += size
    return data
