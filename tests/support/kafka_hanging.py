"""Making a *hanging transaction* on a real broker, on demand.

A hanging transaction is one a partition holds open while its transaction coordinator
knows nothing of it, so no marker ever ends it: ``read_committed`` readers stop at its
first record for good (KIP-664). Real brokers make one when a transaction coordinator
skips a partition's marker (a leader it cannot find while fenced) or when a produce
request arrives after its transaction ended. Neither can be timed from a test, so this
module makes the second one directly: a transactional batch produced straight to the
partition's leader, with a producer id that no transaction coordinator has added that
partition for. The broker accepts it only with ``transaction.partition.verification.enable``
off (KIP-890's check, on by default, refuses exactly such a write), which
``allow_unverified_writes`` switches at the cluster level for the test.

The batch is Kafka's record batch format v2 (magic 2), CRC-32C over the batch from its
attributes on, sent in a ``Produce`` v9 request after an ``InitProducerId`` v2.
"""

from __future__ import annotations

import struct
import time
from typing import Any

from raysink.sinks.kafka._wire import (
    NO_TAGS,
    ProducerState,
    WireError,
    compact_array,
    compact_string,
    request,
    uvarint,
)

__all__ = ["allow_unverified_writes", "hang_committed_epoch_record", "hang_transaction",
           "leader_address"]

_INIT_PRODUCER_ID = (22, 2)
_PRODUCE = (0, 9)


def compact_bytes(raw: bytes) -> bytes:
    return uvarint(len(raw) + 1) + raw


def _crc32c_table() -> list[int]:
    table = []
    for n in range(256):
        crc = n
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
        table.append(crc)
    return table


_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def _zigzag(value: int) -> bytes:
    return uvarint((value << 1) ^ (value >> 63))


def _record(index: int, key: bytes | None, value: bytes) -> bytes:
    body = (b"\x00" + _zigzag(0) + _zigzag(index)
            + (_zigzag(-1) if key is None else _zigzag(len(key)) + key)
            + _zigzag(len(value)) + value + _zigzag(0))
    return _zigzag(len(body)) + body


def record_batch(producer_id: int, producer_epoch: int, sequence: int,
                 records: list[tuple[bytes | None, bytes]]) -> bytes:
    """A transactional record batch (magic 2) of ``records`` (key, value)."""
    now = int(time.time() * 1000)
    tail = struct.pack(">hiqqqhii", 0x10, len(records) - 1, now, now, producer_id,
                       producer_epoch, sequence, len(records))
    tail += b"".join(_record(i, k, v) for i, (k, v) in enumerate(records))
    head = struct.pack(">ib", -1, 2) + struct.pack(">I", crc32c(tail))
    batch = head + tail
    return struct.pack(">qi", 0, len(batch)) + batch


def leader_address(bootstrap: str, topic: str, partition: int) -> tuple[str, int]:
    from confluent_kafka.admin import AdminClient

    metadata = AdminClient({"bootstrap.servers": bootstrap, "log_level": 0}).list_topics(
        topic, timeout=30)
    leader = metadata.topics[topic].partitions[partition].leader
    broker = metadata.brokers[leader]
    return broker.host, int(broker.port)


def allow_unverified_writes(bootstrap: str, allow: bool = True) -> None:
    """Switch KIP-890's partition verification off (``allow``) or on for the cluster."""
    from confluent_kafka.admin import AdminClient, AlterConfigOpType, ConfigEntry, ConfigResource

    admin = AdminClient({"bootstrap.servers": bootstrap, "log_level": 0})
    for broker in admin.list_topics(timeout=30).brokers:
        resource = ConfigResource(ConfigResource.Type.BROKER, str(broker), incremental_configs=[
            ConfigEntry("transaction.partition.verification.enable",
                        "false" if allow else "true",
                        incremental_operation=AlterConfigOpType.SET)])
        admin.incremental_alter_configs([resource])[resource].result(timeout=30)


def hang_transaction(bootstrap: str, topic: str, partition: int,
                     records: list[tuple[bytes | None, bytes]], *,
                     transactional_id: str = "raysink-test-hanging") -> ProducerState:
    """Leave a transaction open on ``topic[partition]`` that no coordinator will end:
    ``records`` in one transactional batch of a fresh producer id. Returns that producer
    as ``DescribeProducers`` would show it (its open transaction's first offset too)."""
    address = leader_address(bootstrap, topic, partition)
    producer_id, producer_epoch = _new_producer_id(address)
    partition_data = struct.pack(">i", partition) + compact_bytes(
        record_batch(producer_id, producer_epoch, 0, records)) + NO_TAGS
    body = (compact_string(transactional_id) + struct.pack(">hi", -1, 30_000)
            + compact_array([compact_string(topic) + compact_array([partition_data])
                             + NO_TAGS]) + NO_TAGS)
    reader = request(address, _PRODUCE, body, timeout=30)
    offset = _produce_result(reader)
    return ProducerState(producer_id=producer_id, producer_epoch=producer_epoch,
                         last_sequence=len(records) - 1, last_timestamp_ms=0,
                         coordinator_epoch=-1, txn_start_offset=offset)


def _new_producer_id(address: tuple[str, int]) -> tuple[int, int]:
    """An idempotent producer id from the broker; asked again while its producer id
    manager loads (``COORDINATOR_LOAD_IN_PROGRESS``, ``COORDINATOR_NOT_AVAILABLE``)."""
    deadline = time.monotonic() + 60
    while True:
        reader = request(address, _INIT_PRODUCER_ID,
                         compact_string(None) + struct.pack(">i", 60_000) + NO_TAGS,
                         timeout=30)
        reader.int32()
        code = reader.int16()
        if not code:
            return reader.int64(), reader.int16()
        if code not in (14, 15) or time.monotonic() > deadline:
            raise WireError(f"InitProducerId refused: error {code}", code)
        time.sleep(0.2)


def _produce_result(reader: Any) -> int:
    for _ in range(reader.array_length()):
        reader.compact_string()
        for _ in range(reader.array_length()):
            reader.int32()
            code = reader.int16()
            base = reader.int64()
            if code:
                raise WireError(f"the hanging batch was refused: error {code}", code)
            return int(base)
    raise WireError("the produce response named no partition")


def hang_committed_epoch_record(bootstrap: str, topic: str, runtime: str, sink: str, *,
                                wait: float = 120.0) -> tuple[str, int | None]:
    """Chaos seed 29's t0021 on demand: once the progress topic of ``topic`` holds an epoch
    record of ``runtime``'s ``sink``, a hanging transaction holding that record again
    (what a broker fenced while it wrote the epoch's markers leaves). Verification is off
    only while the batch is written. Returns what was done, for the trial's notes, and
    the epoch of the record held (``None``: none was found in time)."""
    import json

    from tests.support.kafka import read_topic

    progress = f"{topic}-raysink-progress"
    key = f"raysink:{runtime}:{sink}".encode()
    deadline = time.monotonic() + wait
    while True:
        records = [m for m in read_topic(bootstrap, progress) if m.key() == key]
        if records:
            break
        if time.monotonic() > deadline:
            return (f"no epoch record in {progress} within {wait:g} s: no hanging "
                    "transaction"), None
        time.sleep(0.5)
    value = records[-1].value()
    allow_unverified_writes(bootstrap)
    try:
        time.sleep(0.5)
        state = hang_transaction(bootstrap, progress, 0, [(key, value)])
    finally:
        allow_unverified_writes(bootstrap, False)
    epoch = int(json.loads(value)["epoch"])
    return (f"hanging transaction of producer {state.producer_id} on {progress}[0] from "
            f"offset {state.txn_start_offset} (epoch record {epoch})"), epoch
