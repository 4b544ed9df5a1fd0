"""The Kafka sink's settings: what it derives (transactional ids, topic names), what it
passes through to librdkafka, and what it refuses because exactly-once needs it."""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from raysink.errors import ConfigError, SinkUnavailableError
from raysink.protocol.requirements import check_extra

__all__ = ["THROUGHPUT", "FatalWatch", "KafkaSettings", "check_client_config",
           "default_progress_topic", "kafka_module", "positive_or_none"]

_INSTALL_HINT = ("the Kafka sink needs confluent-kafka: pip install 'raysink[kafka]' "
                 "(or pip install confluent-kafka)")

TOPIC_NAME = re.compile(r"^[A-Za-z0-9._-]{1,249}$")

# a data topic up to this long names the transactional ids as it is; a longer one (or a
# custom progress topic) is shortened and followed by a digest (``txn_scope``)
_SCOPE_READABLE = 64
_SCOPE_SHORTENED = 48

# Producer settings exactly-once depends on: a contradicting value is refused, with why.
_REQUIRED = {
    "enable.idempotence": ({"true", "1"}, "transactions need the idempotent producer"),
    "acks": ({"all", "-1"}, "a record is durable only once every in-sync replica has it"),
    "request.required.acks": ({"all", "-1"},
                              "a record is durable only once every in-sync replica has it"),
    "allow.auto.create.topics": ({"false", "0"},
                                 "topics are created by the sink, with its topic settings "
                                 "(a deleted data topic must not come back empty)"),
}
_RAYSINK_OWNS = {
    "transactional.id": "raysink derives one per writer and sink from the runtime's name "
                        "(transactional_id_prefix= changes its prefix)",
    "bootstrap.servers": "pass the brokers as KafkaSink's first argument",
    "isolation.level": "a consumer setting: your consumers set isolation.level="
                       "read_committed; the sink's own readers choose theirs",
    "transaction.timeout.ms": "use KafkaSink(transaction_timeout=seconds)",
}
_IN_FLIGHT = ("max.in.flight.requests.per.connection", "max.in.flight")
_RETRIES = ("retries", "message.send.max.retries")
THROUGHPUT: dict[str, Any] = {
    # batches fill while a writer produces an epoch (a flush sends at once, whatever the
    # linger): large batches, by bytes rather than by a count of small records
    "linger.ms": 5,
    "batch.size": 1_000_000,
    "batch.num.messages": 1_000_000,
    # an epoch's records queue in the client while they are sent
    "queue.buffering.max.messages": 1_000_000,
    "queue.buffering.max.kbytes": 1_048_576,
    # pipelined requests per broker: the most the idempotent producer keeps in order
    "max.in.flight.requests.per.connection": 5,
    # no compression: on the bench's machine the client's lz4 cost more than the bytes
    # saved (bench/kafka.py); set compression.type where the network bounds a writer
    "compression.type": "none",
}
"""The producers' defaults for throughput (docs/kafka.md, "Throughput")."""
_CLIENT_REFUSED = ("group.id", "enable.auto.commit", "isolation.level", "transactional.id",
                   "bootstrap.servers")


def kafka_module() -> Any:
    """``confluent_kafka``, imported on first use; ``ConfigError`` naming the extra."""
    try:
        import confluent_kafka
        import confluent_kafka.admin
    except ImportError as exc:
        raise ConfigError(_INSTALL_HINT) from exc
    check_extra("kafka")
    return confluent_kafka


def default_progress_topic(topic: str) -> str:
    """The progress topic a sink of ``topic`` uses unless ``progress_topic=`` says."""
    return f"{topic}-raysink-progress"


def _plain(name: str, value: Any, option: str) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float | str):
        return str(value)
    raise ConfigError(f"{option}[{name!r}] must be a string, number or bool (raysink "
                      f"installs its own callbacks); got {type(value).__name__}")


def check_producer_config(config: Mapping[str, Any] | None) -> dict[str, str]:
    """The user's producer settings, as strings; ``ConfigError`` for one exactly-once
    needs that it contradicts, or one raysink sets itself."""
    checked: dict[str, str] = {}
    for name, value in (config or {}).items():
        text = _plain(name, value, "producer_config")
        if name in _RAYSINK_OWNS:
            raise ConfigError(f"producer_config[{name!r}] is not accepted: "
                              f"{_RAYSINK_OWNS[name]}; got {value!r}")
        if name in _REQUIRED:
            allowed, why = _REQUIRED[name]
            if text.lower() not in allowed:
                raise ConfigError(f"producer_config[{name!r}]={value!r} contradicts "
                                  f"exactly-once ({why}); leave it out or set "
                                  f"{sorted(allowed)[0]!r}")
        if name in _IN_FLIGHT and not (text.isdigit() and 1 <= int(text) <= 5):
            raise ConfigError(f"producer_config[{name!r}]={value!r}: the idempotent "
                              "producer keeps order only with at most 5 requests in "
                              "flight per connection; use 1 to 5")
        if name in _RETRIES and (not text.isdigit() or int(text) < 1):
            raise ConfigError(f"producer_config[{name!r}]={value!r}: the idempotent "
                              "producer must retry (a record is written once by its "
                              "sequence number, not by giving up); leave it out")
        checked[name] = text
    return checked


def check_client_config(config: Mapping[str, Any] | None) -> dict[str, str]:
    """Settings for every client of the sink (security, timeouts)."""
    checked: dict[str, str] = {}
    for name, value in (config or {}).items():
        if name in _CLIENT_REFUSED:
            raise ConfigError(f"client_config[{name!r}] is not accepted: the sink sets it "
                              f"for each of its clients; got {value!r}")
        checked[name] = _plain(name, value, "client_config")
    return checked


def check_topic(name: str, option: str) -> str:
    if not isinstance(name, str) or not TOPIC_NAME.match(name) or name in (".", ".."):
        raise ConfigError(f"{option} must be a Kafka topic name (1-249 of letters, digits, "
                          f"'.', '_', '-'); got {name!r}")
    return name


def positive_or_none(value: int | None, option: str,
                     none: str = "the broker's default") -> int | None:
    """``value`` if a positive integer or ``None`` (which means ``none``), else
    ``ConfigError``."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                              or value < 1):
        raise ConfigError(f"{option} must be a positive integer or None ({none}); got "
                          f"{value!r}")
    return value


@dataclass(frozen=True, kw_only=True, slots=True)
class KafkaSettings:
    """Everything the sink's clients need; picklable, validated at construction."""

    bootstrap_servers: str
    topic: str
    progress_topic: str
    partitions: int | None = None
    replication_factor: int | None = None
    min_insync_replicas: int | None = None
    topic_config: dict[str, str] = field(default_factory=dict)
    producer: dict[str, str] = field(default_factory=dict)
    client: dict[str, str] = field(default_factory=dict)
    transactional_id_prefix: str = "raysink"
    transaction_timeout_ms: int = 900_000
    timeout: float = 60.0
    # a replay holds at most this many bytes of records read back before it produces
    # them and waits for their delivery (see ``_replay``)
    replay_chunk_bytes: int = 16 * 1024 * 1024

    def __post_init__(self) -> None:
        if not self.bootstrap_servers or not isinstance(self.bootstrap_servers, str):
            raise ConfigError("bootstrap_servers must be a non-empty 'host:port[,...]' "
                              f"string; got {self.bootstrap_servers!r}")
        check_topic(self.topic, "topic")
        check_topic(self.progress_topic, "progress_topic")
        if self.progress_topic == self.topic:
            raise ConfigError(f"progress_topic must differ from topic ({self.topic!r}): "
                              "the progress topic is compacted, the data topic must not be")
        positive_or_none(self.partitions, "partitions")
        positive_or_none(self.replication_factor, "replication_factor")
        positive_or_none(self.min_insync_replicas, "min_insync_replicas")
        if self.topic_config.get("cleanup.policy", "delete") != "delete":
            raise ConfigError("topic_config['cleanup.policy'] must be 'delete': compaction "
                              "drops the records of aborted transactions, which the sink "
                              "reads back to replay an epoch whose writer was lost; got "
                              f"{self.topic_config['cleanup.policy']!r}")
        if not re.match(r"^[A-Za-z0-9._-]{1,100}$", self.transactional_id_prefix):
            raise ConfigError("transactional_id_prefix must be 1-100 of letters, digits, "
                              f"'.', '_', '-'; got {self.transactional_id_prefix!r}")
        if not 1_000 <= self.transaction_timeout_ms <= 3_600_000:
            raise ConfigError("transaction_timeout must be between 1 and 3600 seconds (the "
                              "broker caps it at its transaction.max.timeout.ms, 900 s by "
                              f"default); got {self.transaction_timeout_ms / 1000:g}")
        if not self.timeout > 0:
            raise ConfigError(f"timeout must be positive; got {self.timeout!r}")
        if isinstance(self.replay_chunk_bytes, bool) or not isinstance(
                self.replay_chunk_bytes, int) or self.replay_chunk_bytes < 1:
            raise ConfigError("replay_chunk_bytes must be a positive number of bytes; got "
                              f"{self.replay_chunk_bytes!r}")

    # -- names -----------------------------------------------------------------------

    def txn_scope(self) -> str:
        """What scopes the transactional ids besides runtime and sink: the data topic,
        readable, when the progress topic is its default and the name is short; else a
        shortened name and a stable digest of both topics (sha256, the same in every
        process and release, unlike ``hash()``).

        Two deployments of the same runtime and sink names on one cluster that write
        different topics then never fence each other's transactions; two that write the
        same topics share the ids, and fence each other, whatever their meta stores:
        that fencing is what stops the older of two runtimes of one name (docs/kafka.md,
        "Fencing and two runtimes of one name")."""
        topic, progress = self.topic, self.progress_topic
        if progress == default_progress_topic(topic) and len(topic) <= _SCOPE_READABLE:
            return topic
        digest = hashlib.sha256(f"{topic}\n{progress}".encode()).hexdigest()
        return f"{topic[:_SCOPE_SHORTENED]}.{digest[:12]}"

    def writer_txn(self, runtime: str, sink: str, writer: int) -> str:
        """The transactional id of writer slot ``writer``
        (``<prefix>.<runtime>.<sink>.<scope>.w<k>``, ``txn_scope``): every incarnation of
        the slot uses it, so a new one fences the ones before it."""
        return f"{self.transactional_id_prefix}.{runtime}.{sink}.{self.txn_scope()}.w{writer}"

    def committer_txn(self, runtime: str, sink: str) -> str:
        """The transactional id the coordinator commits with (epoch records, replays;
        ``<prefix>.<runtime>.<sink>.<scope>.c``): a new coordinator fences the one before
        it."""
        return f"{self.transactional_id_prefix}.{runtime}.{sink}.{self.txn_scope()}.c"

    def legacy_committer_txn(self, runtime: str, sink: str) -> str:
        """The committer's transactional id before ids were scoped by topic
        (``<prefix>.<runtime>.<sink>.c``): a coordinator of the old scheme may have left a
        transaction open under it (an epoch record), which a new coordinator ends by
        fencing it once (``KafkaSink._claim``)."""
        return f"{self.transactional_id_prefix}.{runtime}.{sink}.c"

    # -- client configurations ---------------------------------------------------------

    def base(self) -> dict[str, Any]:
        return {"bootstrap.servers": self.bootstrap_servers,
                "logger": logging.getLogger("raysink.sinks.kafka.client"),
                "socket.connection.setup.timeout.ms": 10_000,
                **self.client}

    def producer_config(self, transactional_id: str) -> dict[str, Any]:
        """The writers' and the committer's producer: ``THROUGHPUT`` (each overridable
        through ``producer_config``), then what exactly-once needs (not overridable)."""
        return {**self.base(),
                **THROUGHPUT,
                **self.producer,
                "transactional.id": transactional_id,
                "transaction.timeout.ms": self.transaction_timeout_ms,
                "enable.idempotence": True,
                "acks": "all",
                "allow.auto.create.topics": False}

    def consumer_config(self, *, committed: bool) -> dict[str, Any]:
        return {**self.base(), "group.id": "raysink-sink-reader",
                "enable.auto.commit": False, "enable.partition.eof": True,
                "isolation.level": "read_committed" if committed else "read_uncommitted",
                "fetch.max.bytes": 52_428_800, "allow.auto.create.topics": False,
                # a fetch with nothing to return waits this long, and holds the
                # connection: an offset query behind it waited 500 ms (the default)
                "fetch.wait.max.ms": 10}

    def replay_consumer_config(self) -> dict[str, Any]:
        """The replay's reader: ``read_uncommitted`` (the lost part's transaction was
        aborted), an offset the log no longer holds an error rather than a silent jump to
        the log's end (``auto.offset.reset=error``), and librdkafka's prefetch kept near
        one chunk (it would buffer 64 MiB by default)."""
        return {**self.consumer_config(committed=False),
                "auto.offset.reset": "error",
                "queued.max.messages.kbytes": max(1, self.replay_chunk_bytes // 1024),
                "max.partition.fetch.bytes": max(1024, min(self.replay_chunk_bytes,
                                                           1_048_576))}

    def admin_config(self) -> dict[str, Any]:
        return self.base()


class FatalWatch:
    """A producer's error callback that keeps its fatal error (fenced: another producer
    took the transactional id over), so a flush can stop waiting for records that will
    never be sent."""

    def __init__(self) -> None:
        self.error: Any = None

    def __call__(self, error: Any) -> None:
        if error.fatal() and self.error is None:
            self.error = error

    def flush(self, producer: Any, timeout: float) -> int:
        """Flush in short slices until nothing is left, the timeout, or a fatal error
        (raised as ``KafkaException``); returns the records left."""
        import time

        deadline = time.monotonic() + timeout
        while True:
            left = int(producer.flush(min(0.5, max(0.0, deadline - time.monotonic()))))
            if self.error is not None:
                raise kafka_module().KafkaException(self.error)
            if not left or time.monotonic() >= deadline:
                return left


def unavailable(settings: KafkaSettings, what: str, exc: BaseException, **where: Any
                ) -> SinkUnavailableError:
    """A client error as ``SinkUnavailableError`` naming the brokers."""
    return SinkUnavailableError(f"Kafka at {settings.bootstrap_servers} {what}: {exc}",
                                **where)
