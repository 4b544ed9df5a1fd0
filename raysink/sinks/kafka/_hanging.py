"""An open transaction that holds the progress partition back: found, named, ended.

``read_committed`` readers stop at a partition's *last stable offset* (LSO): the first
record of the oldest transaction still open there. A transaction is open on a partition
until its marker (COMMIT or ABORT) is written to it by the transaction's coordinator, so a
marker that never comes holds every later record back for good: a *hanging transaction*
(KIP-664). Seen here: a broker fenced by its controller while it wrote epoch 2's markers
skipped the progress partition's ("Couldn't find leader endpoint ... likely deleted"),
and the sink read its progress marker as gone.

``find_open`` tells such a partition from one whose records are gone: the high watermark
is above the LSO, the record at the LSO is there for a ``read_uncommitted`` reader, and
the partition's leader names the producer whose transaction starts there
(``DescribeProducers``, through ``_wire``). ``OpenTransaction`` carries what an operator
needs: partition, producer id and epoch, first offset, age, whose it is by its key, and
the command Kafka's own tool takes to abort it.

``end_if_proven`` ends one only where the outcome is certain; the caller fenced this
sink's own transactional ids first (which ends every transaction their coordinator still
knows, so what stays open is hanging):

* every record the holding producer wrote there since the LSO is one of this sink's
  progress records, each saying an epoch at or below ``truth`` (what the meta store says
  is committed) was committed: a COMMIT marker makes true statements visible, whoever
  wrote them (a progress record only says "epoch E of this sink is in", and it is);
* a transaction older than the broker's ``transaction.max.timeout.ms`` (its coordinator
  would have aborted it long ago, if it knew it) whose record at the LSO is not this
  sink's: an ABORT marker, as ``kafka-transactions.sh abort`` writes;
* anything else is left alone, and named (``raysink.errors.TransactionHeldError``)
  with the command to run.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from raysink.sinks.kafka import _wire
from raysink.sinks.kafka._config import kafka_module

if TYPE_CHECKING:
    from raysink.sinks.kafka._config import KafkaSettings

__all__ = ["OpenTransaction", "end_if_proven", "find_open"]

log = logging.getLogger(__name__)

_SCAN_LIMIT = 10_000  # records read from the LSO on to judge what the transaction says
_DEFAULT_MAX_TIMEOUT_S = 900.0


@dataclass(frozen=True, slots=True)
class OpenTransaction:
    """The oldest transaction open on one partition."""

    topic: str
    partition: int
    first_offset: int
    high_watermark: int
    key: str | None
    epoch: int | None
    age_seconds: float | None
    producer_id: int | None = None
    producer_epoch: int | None = None
    coordinator_epoch: int | None = None

    def holder(self, prefix: str) -> str:
        if self.key == prefix:
            return "the committer of this sink (its epoch record)"
        if self.key is not None and self.key.startswith(prefix + ":w"):
            return f"writer {self.key[len(prefix) + 2:]} of this sink (its part record)"
        return f"a producer this sink does not own (key {self.key!r})"

    def describe(self, prefix: str, bootstrap: str) -> str:
        age = "unknown" if self.age_seconds is None else f"{self.age_seconds:.0f} s"
        producer = ("producer id unknown" if self.producer_id is None else
                    f"producer id {self.producer_id}, producer epoch {self.producer_epoch}")
        return (f"a transaction open on {self.topic}[{self.partition}] since offset "
                f"{self.first_offset} ({producer}, by {self.holder(prefix)}, open for "
                f"{age}; high watermark {self.high_watermark}) holds back every later "
                "record from read_committed readers. If it is hanging (its coordinator "
                "lost it), end it with: kafka-transactions.sh --bootstrap-server "
                f"{bootstrap} abort --topic {self.topic} --partition {self.partition} "
                f"--start-offset {self.first_offset}  (find others with: "
                f"kafka-transactions.sh --bootstrap-server {bootstrap} find-hanging "
                "--broker-id <leader>)")

    def as_dict(self) -> dict[str, Any]:
        return {"kind": "kafka_open_transaction", **asdict(self)}


# -- finding --------------------------------------------------------------------------

def find_open(settings: KafkaSettings, topic: str, partition: int = 0
              ) -> OpenTransaction | None:
    """The oldest open transaction on ``topic[partition]``, or ``None`` when its last
    stable offset is its high watermark (nothing held back)."""
    ck = kafka_module()
    admin = ck.admin.AdminClient(settings.admin_config())
    tp = ck.TopicPartition(topic, partition)
    timeout = settings.timeout

    def end(level: Any) -> int:
        futures = admin.list_offsets({tp: ck.admin.OffsetSpec.latest()},
                                     isolation_level=level, request_timeout=timeout)
        return int(futures[tp].result(timeout=timeout).offset)

    high = end(ck.IsolationLevel.READ_UNCOMMITTED)
    stable = end(ck.IsolationLevel.READ_COMMITTED)
    if high <= stable:
        return None
    key, epoch, written = _record_at(settings, topic, partition, stable)
    producer = _producer_at(settings, admin, topic, partition, stable)
    ages = [time.time() - t / 1000 for t in (written, producer and producer.last_timestamp_ms)
            if t and t > 0]
    return OpenTransaction(
        topic=topic, partition=partition, first_offset=stable, high_watermark=high, key=key,
        epoch=epoch, age_seconds=max(ages) if ages else None,
        producer_id=producer.producer_id if producer else None,
        producer_epoch=producer.producer_epoch if producer else None,
        coordinator_epoch=producer.coordinator_epoch if producer else None)


def _record_at(settings: KafkaSettings, topic: str, partition: int, offset: int
               ) -> tuple[str | None, int | None, int | None]:
    """Key, epoch (for a progress record) and timestamp (ms) of the record at ``offset``."""
    for message in _scan(settings, topic, partition, offset, offset + 1):
        key = (message.key() or b"").decode(errors="replace") or None
        return key, _epoch_of(message.value()), message.timestamp()[1]
    return None, None, None


def _epoch_of(value: bytes | None) -> int | None:
    try:
        return int(json.loads(value or b"{}")["epoch"])
    except (ValueError, KeyError, TypeError):
        return None


def _scan(settings: KafkaSettings, topic: str, partition: int, start: int, stop: int
          ) -> list[Any]:
    """The records of ``[start, stop)`` a ``read_uncommitted`` reader sees."""
    ck = kafka_module()
    consumer = ck.Consumer(settings.consumer_config(committed=False))
    found: list[Any] = []
    deadline = time.monotonic() + settings.timeout
    try:
        consumer.assign([ck.TopicPartition(topic, partition, start)])
        position = start
        while position < stop and time.monotonic() < deadline:
            message = consumer.poll(0.2)
            if message is None or message.error() is not None:
                now = consumer.position([ck.TopicPartition(topic, partition)])[0].offset
                if now is not None and now > position:
                    position = now  # past control records
                continue
            position = message.offset() + 1
            found.append(message)
    finally:
        consumer.close()
    return found


def _producer_at(settings: KafkaSettings, admin: Any, topic: str, partition: int,
                 offset: int) -> _wire.ProducerState | None:
    """The producer whose open transaction starts at ``offset`` (the leader says, when
    it can be asked: a plaintext listener)."""
    address = _leader(settings, admin, topic, partition)
    if address is None:
        return None
    try:
        producers = _wire.describe_producers(address, topic, partition,
                                             timeout=settings.timeout)
    except _wire.WireError as exc:
        log.info("DescribeProducers of %s[%s] failed: %s", topic, partition, exc)
        return None
    open_ones = sorted((p for p in producers if p.txn_start_offset >= 0),
                       key=lambda p: p.txn_start_offset)
    exact = [p for p in open_ones if p.txn_start_offset == offset]
    found = exact or open_ones
    return found[0] if found else None


def _leader(settings: KafkaSettings, admin: Any, topic: str, partition: int
            ) -> tuple[str, int] | None:
    if settings.client.get("security.protocol", "plaintext").lower() != "plaintext":
        return None
    metadata = admin.list_topics(topic, timeout=settings.timeout)
    found = metadata.topics.get(topic)
    if found is None or partition not in found.partitions:
        return None
    broker = metadata.brokers.get(found.partitions[partition].leader)
    return None if broker is None else (broker.host, int(broker.port))


# -- ending ---------------------------------------------------------------------------

def end_if_proven(settings: KafkaSettings, held: OpenTransaction, *, prefix: str,
                  truth: int | None) -> str | None:
    """End ``held`` where its outcome is certain (see the module docstring): returns
    ``"commit"`` or ``"abort"`` for the marker written, ``None`` when left open."""
    if held.producer_id is None or held.producer_epoch is None:
        return None
    commit = truth is not None and _all_true(settings, held, prefix, truth)
    if not commit and not _abandoned(settings, held, prefix):
        return None
    producer = _wire.ProducerState(
        producer_id=held.producer_id, producer_epoch=held.producer_epoch,
        last_sequence=-1, last_timestamp_ms=-1,
        coordinator_epoch=held.coordinator_epoch if held.coordinator_epoch is not None
        else -1, txn_start_offset=held.first_offset)
    ck = kafka_module()
    admin = ck.admin.AdminClient(settings.admin_config())
    address = _leader(settings, admin, held.topic, held.partition)
    if address is None:
        return None
    try:
        _wire.write_txn_marker(address, held.topic, held.partition, producer,
                               commit=commit, timeout=settings.timeout)
    except _wire.WireError as exc:
        log.warning("could not end the transaction open on %s[%s] at offset %s: %s",
                    held.topic, held.partition, held.first_offset, exc)
        return None
    return "commit" if commit else "abort"


def _all_true(settings: KafkaSettings, held: OpenTransaction, prefix: str,
              truth: int) -> bool:
    """Every record the holding producer wrote from the LSO until its next marker is this
    sink's progress record of an epoch at or below ``truth`` (the batches as the leader
    holds them, with their producer ids: ``_wire.fetch_batches``)."""
    ck = kafka_module()
    address = _leader(settings, ck.admin.AdminClient(settings.admin_config()), held.topic,
                      held.partition)
    if address is None:
        return False
    seen, offset = 0, held.first_offset
    while offset < held.high_watermark and seen < _SCAN_LIMIT:
        try:
            batches = _wire.fetch_batches(address, held.topic, held.partition, offset,
                                          timeout=settings.timeout)
        except _wire.WireError as exc:
            log.info("reading %s[%s] back failed: %s", held.topic, held.partition, exc)
            return False
        if not batches:
            break
        for batch in batches:
            offset = batch.last_offset + 1
            if batch.producer_id != held.producer_id or batch.base_offset < held.first_offset:
                continue
            if batch.control:
                return seen > 0  # the transaction's end on this partition
            if batch.records is None:
                return False  # compressed: not judged
            for _, key, value in batch.records:
                seen += 1
                name = (key or b"").decode(errors="replace")
                epoch = _epoch_of(value)
                if not (name == prefix or name.startswith(prefix + ":w")):
                    return False
                if epoch is None or epoch > truth:
                    return False
    return seen > 0


def _abandoned(settings: KafkaSettings, held: OpenTransaction, prefix: str) -> bool:
    """Not this sink's, and older than any transaction its coordinator would keep."""
    if held.key is not None and (held.key == prefix or held.key.startswith(prefix + ":w")):
        return False
    if held.age_seconds is None:
        return False
    return held.age_seconds > _max_timeout_s(settings, held) + 60.0


def _max_timeout_s(settings: KafkaSettings, held: OpenTransaction) -> float:
    """The leader's ``transaction.max.timeout.ms`` (900 s when it cannot be read)."""
    ck = kafka_module()
    try:
        admin = ck.admin.AdminClient(settings.admin_config())
        metadata = admin.list_topics(held.topic, timeout=settings.timeout)
        leader = metadata.topics[held.topic].partitions[held.partition].leader
        resource = ck.admin.ConfigResource(ck.admin.ConfigResource.Type.BROKER, str(leader))
        entries = admin.describe_configs([resource])[resource].result(
            timeout=settings.timeout)
        return float(entries["transaction.max.timeout.ms"].value) / 1000
    except Exception as exc:  # a broker that will not say: Kafka's default
        log.info("transaction.max.timeout.ms unknown (%s); taking 900 s", exc)
        return _DEFAULT_MAX_TIMEOUT_S
