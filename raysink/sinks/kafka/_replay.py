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
   earlier committer is still writing.

Ordering: the writers pre-commit an epoch only once every earlier one is committed
(``Sink.holds_transactions``), so when an epoch is replayed no later epoch has records in
the data topic yet: the replayed records still precede every later epoch's.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from raysink.errors import DataLossError, SinkUnavailableError
from raysink.sinks.base import Held
from raysink.sinks.kafka._config import kafka_module, unavailable
from raysink.sinks.kafka._progress import KafkaManifest, epoch_key, part_key, record_value

if TYPE_CHECKING:
    from raysink.sinks.kafka._sink import KafkaSink

__all__ = ["fence", "replay"]

log = logging.getLogger(__name__)


def fence(sink: KafkaSink, txn: str) -> None:
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


def replay(sink: KafkaSink, epoch: int, attempt: int,
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
    records = 0
    committer = sink.begin_committer_transaction(epoch)
    for manifest in todo:
        records += _copy(sink, committer, manifest, epoch)
        committer.produce(sink.settings.progress_topic,
                          record_value(epoch, attempt, writer=int(manifest["writer"]),
                                       replayed=True),
                          part_key(sink.runtime, sink.name, int(manifest["writer"])))
    committer.produce(sink.settings.progress_topic, sink.epoch_record(epoch, attempt),
                      epoch_key(sink.runtime, sink.name))
    sink.end_committer_transaction(committer, epoch)
    log.warning("kafka sink %s/%s: epoch %s: replayed %d records of writers %s (their "
                "transactions were lost) in %.2fs", sink.runtime, sink.name, epoch, records,
                [int(m["writer"]) for m in todo], time.monotonic() - started)
    return True


def _copy(sink: KafkaSink, committer: Any, manifest: KafkaManifest, epoch: int) -> int:
    """Produce the part's records again; ``DataLossError`` when some are gone."""
    ck = kafka_module()
    runs: dict[str, list[list[int]]] = manifest.get("runs", {})
    topic = str(manifest.get("topic", sink.settings.topic))
    consumer = ck.Consumer(sink.settings.consumer_config(committed=False))
    copied = 0
    try:
        for partition, offsets in runs.items():
            wanted = {o for first, count in offsets for o in range(first, first + count)}
            found = _read_partition(sink, consumer, topic, int(partition), offsets)
            missing = wanted - set(found)
            if missing:
                raise DataLossError(
                    f"{len(missing)} records of writer {manifest['writer']} in "
                    f"{topic}[{partition}] are gone from the log (retention, or a deleted "
                    f"topic), first at offset {min(missing)}: the epoch cannot be written "
                    "again", runtime=sink.runtime, sink=sink.name, epoch=epoch)
            for offset in sorted(wanted):
                message = found[offset]
                _produce(committer, topic, int(partition), message)
                copied += 1
    finally:
        consumer.close()
    return copied


def _read_partition(sink: KafkaSink, consumer: Any, topic: str, partition: int,
                    runs: list[list[int]]) -> dict[int, Any]:
    """The messages at the runs' offsets (and any between them), read uncommitted."""
    ck = kafka_module()
    first = min(r[0] for r in runs)
    last = max(r[0] + r[1] - 1 for r in runs)
    wanted = {o for start, count in runs for o in range(start, start + count)}
    consumer.assign([ck.TopicPartition(topic, partition, first)])
    found: dict[int, Any] = {}
    deadline = time.monotonic() + sink.settings.timeout
    position = first
    while position <= last:
        if time.monotonic() > deadline:
            raise SinkUnavailableError(
                f"reading {topic}[{partition}] back for a replay stopped at offset "
                f"{position} (of {first}-{last})", runtime=sink.runtime, sink=sink.name)
        message = consumer.poll(0.2)
        if message is None:
            high = consumer.get_watermark_offsets(ck.TopicPartition(topic, partition),
                                                  timeout=sink.settings.timeout)[1]
            if high <= position:
                break  # nothing more in the log: what is missing is gone
            continue
        if message.error() is not None:
            continue
        position = message.offset() + 1
        if message.offset() in wanted:
            found[message.offset()] = message
    consumer.unassign()
    return found


def _produce(producer: Any, topic: str, partition: int, message: Any) -> None:
    kind, timestamp = message.timestamp()
    while True:
        try:
            producer.produce(topic, message.value(), message.key(), partition=partition,
                             headers=message.headers(),
                             timestamp=timestamp if kind else 0)
            return
        except BufferError:
            producer.poll(0.05)
