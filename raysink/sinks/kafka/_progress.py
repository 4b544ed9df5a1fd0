"""The progress topic and the topics' administration.

The progress topic (one partition, compacted) holds, per sink of a runtime, two kinds of
record, each written in the same transaction as the data it speaks for:

``raysink:<runtime>:<sink>``            ``{"epoch": E, "attempt": a}``: the last epoch
                                        committed whole (the coordinator's transaction)
``raysink:<runtime>:<sink>:w<k>``       ``{"epoch": E, "attempt": a}``: writer slot k's
                                        part of epoch E committed (its own transaction,
                                        or the coordinator's when it replayed the part)

Each record also carries ``"format"`` (``raysink.sinks._format``; none: raysink 0.1.0's,
format 1); the epoch record of a newer format is refused (``NewerVersionError``).

Compaction keeps the newest record of each key: since a sink commits its epochs in order,
a writer's newest record at or past epoch E means its part of E is in.

``ProgressReader`` keeps one ``read_committed`` consumer on that partition and the newest
value of each of the sink's keys, reading on from where it stopped. ``read(strict=False)``
reads to the last stable offset (what a reader sees now; an open transaction ahead hides
what was committed after it); ``read(strict=True)`` insists on reading up to the end the
partition had when the call began, waiting while an open transaction holds the last
stable offset back: what a decision to replay must rest on.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from typing import Any, cast

from raysink.errors import SinkUnavailableError, TransactionHeldError
from raysink.sinks._format import MARKER_FORMAT, check_marker
from raysink.sinks.base import Manifest
from raysink.sinks.kafka._config import KafkaSettings, kafka_module, unavailable
from raysink.sinks.kafka._failures import is_unknown_topic

__all__ = ["KafkaManifest", "ProgressReader", "Topics", "epoch_key", "kafka_manifests",
           "part_key", "record_value"]

log = logging.getLogger(__name__)


class KafkaManifest(Manifest, total=False):
    """What one Kafka writer produced for one epoch attempt: its transactional id
    (``txn``), its actor's Ray name, the data topic and the offsets its records got per
    partition (``[[first, count], ...]`` per partition)."""

    txn: str
    actor: str | None
    topic: str
    runs: dict[str, list[list[int]]]


def kafka_manifests(manifests: Sequence[Manifest] | None) -> Sequence[KafkaManifest]:
    """The manifests the coordinator hands a Kafka sink back, as its writers made them."""
    return cast("Sequence[KafkaManifest]", manifests or ())


def epoch_key(runtime: str, sink: str) -> str:
    return f"raysink:{runtime}:{sink}"


def part_key(runtime: str, sink: str, writer: int) -> str:
    return f"raysink:{runtime}:{sink}:w{writer}"


def record_value(epoch: int, attempt: int, **extra: Any) -> bytes:
    """A progress record's value, carrying its format (``raysink.sinks._format``)."""
    return json.dumps({"epoch": epoch, "attempt": attempt, "format": MARKER_FORMAT, **extra},
                      separators=(",", ":")).encode()


class Topics:
    """The data and progress topics: whether they exist, creating them."""

    def __init__(self, settings: KafkaSettings) -> None:
        self.settings = settings
        self._admin: Any = None

    def admin(self) -> Any:
        if self._admin is None:
            admin_client = kafka_module().admin.AdminClient
            self._admin = admin_client(self.settings.admin_config())
        return self._admin

    def describe(self, topic: str) -> Any | None:
        """The topic's metadata, or ``None`` when the cluster says it does not exist.

        A topic is believed gone only when a new client is told so too: after a broker
        restart an old client answered from stale metadata for minutes (see
        ``ProgressReader._ends``), and a progress topic taken for deleted is a marker taken
        for gone, a ``DataLossError`` that stalls the sink for good. Any other error of
        the topic (its leader not elected yet, say) is Kafka unavailable, tried again."""
        found = self._metadata(topic)
        if found is not None and found.error is None:
            return found
        self._admin = None  # ask a new client
        found = self._metadata(topic)
        if found is None or found.error is None:
            return found
        if found.error.code() == kafka_module().KafkaError.UNKNOWN_TOPIC_OR_PART:
            return None
        raise unavailable(self.settings, f"could not describe topic {topic!r}",
                          kafka_module().KafkaException(found.error))

    def _metadata(self, topic: str) -> Any | None:
        try:
            metadata = self.admin().list_topics(topic=topic, timeout=self.settings.timeout)
        except Exception as exc:
            raise unavailable(self.settings, "did not answer", exc) from exc
        return metadata.topics.get(topic)

    def exists(self, topic: str) -> bool:
        return self.describe(topic) is not None

    def partitions(self, topic: str) -> list[int]:
        found = self.describe(topic)
        return [] if found is None else sorted(found.partitions)

    def config(self, topic: str) -> dict[str, str]:
        """The topic's effective configuration (``describe_configs``)."""
        admin_mod = kafka_module().admin
        resource = admin_mod.ConfigResource(admin_mod.ConfigResource.Type.TOPIC, topic)
        try:
            future = self.admin().describe_configs([resource])[resource]
            entries = future.result(timeout=self.settings.timeout)
        except Exception as exc:
            raise unavailable(self.settings, f"could not describe topic {topic!r}",
                              exc) from exc
        return {name: entry.value for name, entry in entries.items()}

    def create_data(self) -> None:
        s = self.settings
        config = dict(s.topic_config)
        if s.min_insync_replicas is not None:
            config["min.insync.replicas"] = str(s.min_insync_replicas)
        self._create(s.topic, s.partitions or -1, config)

    def create_progress(self) -> None:
        s = self.settings
        config = {"cleanup.policy": "compact", "segment.ms": "600000",
                  "min.cleanable.dirty.ratio": "0.1"}
        if s.min_insync_replicas is not None:
            config["min.insync.replicas"] = str(s.min_insync_replicas)
        self._create(s.progress_topic, 1, config)

    def _create(self, topic: str, partitions: int, config: dict[str, str]) -> None:
        """Create ``topic`` (an existing one is left as it is) and wait until the
        brokers' metadata lists it."""
        new_topic = kafka_module().admin.NewTopic
        replication = self.settings.replication_factor or -1
        futures = self.admin().create_topics(
            [new_topic(topic, num_partitions=partitions, replication_factor=replication,
                       config=config)], request_timeout=self.settings.timeout)
        try:
            futures[topic].result(timeout=self.settings.timeout)
            log.info("created Kafka topic %s (%s partitions)", topic,
                     partitions if partitions > 0 else "the broker's default")
        except Exception as exc:
            error = exc.args[0] if exc.args else None
            exists = kafka_module().KafkaError.TOPIC_ALREADY_EXISTS
            if getattr(error, "code", lambda: None)() != exists:
                raise unavailable(self.settings, f"could not create topic {topic!r}",
                                  exc) from exc
        deadline = time.monotonic() + self.settings.timeout
        while (found := self._metadata(topic)) is None or found.error is not None:
            if time.monotonic() > deadline:
                raise SinkUnavailableError(f"topic {topic!r} was created but the brokers "
                                           "do not list it yet")
            time.sleep(0.1)


class ProgressReader:
    """The newest progress records of one sink (see the module docstring)."""

    def __init__(self, settings: KafkaSettings, runtime: str, sink: str) -> None:
        self.settings = settings
        self.prefix = epoch_key(runtime, sink)
        self._consumer: Any = None
        self._admin: Any = None
        self._position = 0
        self.latest: dict[str, dict[str, Any]] = {}

    def close(self) -> None:
        if self._consumer is not None:
            self._consumer.close()
            self._consumer = None

    def read_on(self) -> tuple[int | None] | None:
        """The epoch record's epoch (in a 1-tuple), read on from where this reader is
        without looking the topic up first: one metadata round trip fewer per commit.
        ``None`` when it has read nothing yet, or when the read says the topic is unknown
        (deleted): the caller then looks it up as at the first read."""
        if self._position <= 0:
            return None
        try:
            return (self.committed_epoch(strict=False),)
        except SinkUnavailableError as exc:
            if is_unknown_topic(exc):
                return None
            raise

    def reset(self) -> None:
        """Forget what was read (the topic was deleted, or re-created)."""
        self.close()
        self._position = 0
        self.latest = {}

    def _open(self) -> Any:
        if self._consumer is None:
            ck = kafka_module()
            self._consumer = ck.Consumer(self.settings.consumer_config(committed=True))
            self._consumer.assign([ck.TopicPartition(self.settings.progress_topic, 0,
                                                     self._position)])
        return self._consumer

    def read(self, *, strict: bool) -> dict[str, dict[str, Any]]:
        """Read on to the end (see the module docstring); the newest value per key."""
        ck = kafka_module()
        consumer = self._open()
        tp = ck.TopicPartition(self.settings.progress_topic, 0)
        deadline = time.monotonic() + self.settings.timeout
        try:
            low, end = self._ends(strict)
        except Exception as exc:
            raise unavailable(self.settings, "did not give the progress topic's end",
                              exc) from exc
        if end < self._position or low > self._position:  # re-created
            self.reset()
            consumer = self._open()
        while self._position < end:
            if time.monotonic() > deadline:
                raise TransactionHeldError(
                    f"the progress topic {self.settings.progress_topic!r} could not be read "
                    f"to offset {end} (at {self._position}) within {self.settings.timeout:g}"
                    " s: a transaction left open holds it back (it ends when its producer "
                    "is fenced, its transaction.timeout.ms passes, or, hanging, when its "
                    "marker is written)")
            self._poll(consumer, tp)
        return self.latest

    def _poll(self, consumer: Any, tp: Any) -> None:
        message = consumer.poll(0.2)
        if message is None:
            position = consumer.position([tp])[0].offset
            if position is not None and position > self._position:
                self._position = position  # past transaction markers
            return
        if message.error() is not None:
            if message.error().code() == kafka_module().KafkaError._PARTITION_EOF:
                self._position = max(self._position, message.offset())  # markers too
            elif message.error().fatal():
                raise unavailable(self.settings, "failed reading the progress topic",
                                  message.error())
            return
        self._position = message.offset() + 1
        key = (message.key() or b"").decode(errors="replace")
        if key == self.prefix or key.startswith(self.prefix + ":w"):
            try:
                self.latest[key] = json.loads(message.value() or b"{}")
            except ValueError:
                log.warning("progress record %s at offset %s is not JSON; ignored", key,
                            message.offset())

    def _ends(self, strict: bool) -> tuple[int, int]:
        """The partition's start (asked only when the end is below what was read: the
        topic was re-created) and its end: with ``strict``, open transactions included
        (the high watermark), else the last stable offset. A failure is tried once more
        with a new admin client: after a broker restart the old one kept answering
        ``FENCED_LEADER_EPOCH`` from stale metadata for minutes."""
        try:
            return self._ask_ends(strict)
        except Exception as exc:
            log.info("progress topic offsets: %s; asking again with a new client", exc)
            self._admin = None
            return self._ask_ends(strict)

    def _ask_ends(self, strict: bool) -> tuple[int, int]:
        ck = kafka_module()
        admin_mod = ck.admin
        if self._admin is None:
            self._admin = admin_mod.AdminClient(self.settings.admin_config())
        tp = ck.TopicPartition(self.settings.progress_topic, 0)
        level = (ck.IsolationLevel.READ_UNCOMMITTED if strict
                 else ck.IsolationLevel.READ_COMMITTED)
        timeout = self.settings.timeout
        ends = self._admin.list_offsets({tp: admin_mod.OffsetSpec.latest()},
                                        isolation_level=level, request_timeout=timeout)
        end = int(ends[tp].result(timeout=timeout).offset)
        if end >= self._position:
            return 0, end
        starts = self._admin.list_offsets({tp: admin_mod.OffsetSpec.earliest()},
                                          request_timeout=timeout)
        return int(starts[tp].result(timeout=timeout).offset), end

    def committed_epoch(self, *, strict: bool = False, cached: bool = False) -> int | None:
        """The epoch record's epoch: read on first, unless ``cached`` (what was read last)."""
        record = (self.latest if cached else self.read(strict=strict)).get(self.prefix)
        check_marker(record, runtime=None, sink=None, where=f"progress topic "
                     f"{self.settings.progress_topic!r} (key {self.prefix!r})")
        return None if record is None else int(record["epoch"])

    def part_committed(self, writer: int, epoch: int) -> bool:
        """Writer slot ``writer``'s part of ``epoch`` is in (by what was read last)."""
        record = self.latest.get(f"{self.prefix}:w{writer}")
        return record is not None and int(record["epoch"]) >= epoch
