"""A throwaway Apache Kafka broker for tests, started by the test session itself.

``KafkaBroker`` runs the broker whose jars ``scripts/kafka/fetch.sh`` keeps in
``~/.cache/raysink/kafka-<version>/`` (``make setup`` fetches them from Maven Central; the
fixture fetches them itself when they are missing). One JVM in KRaft mode, broker and
controller combined (a single voter), listening on 127.0.0.1 only, on free ports, with a
log directory of its own under ``/tmp`` that ``format`` (Kafka's storage tool) prepares
once. Internal topics use replication factor 1 (``offsets.topic.replication.factor``,
``transaction.state.log.replication.factor``, ``transaction.state.log.min.isr``: with the
defaults a single broker never completes a transaction) and few partitions (the first
transaction would otherwise create 50). Clients do not create topics by themselves
(``auto.create.topics.enable=false``).

``restart(kill=True)`` SIGKILLs the JVM and starts it again on the same ports and
directory (the broker-restart fault); ``stop()`` ends it by its pid. Measured on the shared
two-core machine (load 10-20 from other jobs): the storage format about 6 s, a start until
the broker answers ``list_topics`` 8-11 s, a SIGKILL restart (log recovery included) 10-20 s.

The session fixture ``kafka_broker`` starts one broker for the whole test session.
"""

from __future__ import annotations

import atexit
import base64
import contextlib
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.ports import server_port

__all__ = ["KafkaBroker", "kafka_broker", "kafka_home", "read_topic"]

_REPO = Path(__file__).resolve().parents[2]
_FETCH = _REPO / "scripts" / "kafka" / "fetch.sh"
_START_TIMEOUT = 120.0
_POLL_SECONDS = 0.05  # ``read_topic``'s wait for a record before it looks at its positions


def kafka_home() -> Path:
    """The directory holding the broker's jars, fetched first if missing."""
    result = subprocess.run(["bash", str(_FETCH)], capture_output=True, text=True,
                            timeout=900, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"could not fetch the Kafka broker ({_FETCH}): "
                           f"{result.stderr.strip()[-2000:]}")
    return Path(result.stdout.strip().splitlines()[-1])


def _cluster_id() -> str:
    """A Kafka cluster id: 16 random bytes, URL-safe base64 without padding; never one
    that starts with ``-`` (1 in 64), which the storage tool reads as an option."""
    while True:
        cluster = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not cluster.startswith("-"):
            return cluster


class KafkaBroker:
    """One single-node KRaft broker in a temporary directory; see the module docstring.

    Call order: ``start()`` (formats the log directory the first time), then any of
    ``admin``, ``create_topic``, ``restart``, ``stop``/``start``; finally ``cleanup()``
    (idempotent), which stops the broker and deletes its directory. ``timings`` keeps
    the seconds each format, start and restart took."""

    def __init__(self, home: Path | None = None, *, heap: str = "512m",
                 jit: bool = False, settings: dict[str, str] | None = None,
                 cluster_id: str | None = None) -> None:
        self.home = home or kafka_home()
        self.cluster_id = cluster_id or _cluster_id()
        self.port = server_port()
        self.controller_port = server_port()
        self.bootstrap = f"127.0.0.1:{self.port}"
        self.root = Path(tempfile.mkdtemp(prefix="raysink-kafka-", dir="/tmp"))
        self.log_dir = self.root / "data"
        self.log_file = self.root / "server.log"
        self._heap = heap
        self._jit = jit
        self._settings = dict(settings or {})
        self._process: subprocess.Popen[bytes] | None = None
        self._formatted = False
        self.timings: dict[str, list[float]] = {"format": [], "start": [], "restart": []}
        self._write_config()

    # configuration ------------------------------------------------------------------
    def _properties(self) -> dict[str, str]:
        """The broker's ``server.properties``, ``settings`` over the defaults."""
        return {
            "process.roles": "broker,controller",
            "node.id": "1",
            "controller.quorum.voters": f"1@127.0.0.1:{self.controller_port}",
            "listeners": f"PLAINTEXT://127.0.0.1:{self.port},"
                         f"CONTROLLER://127.0.0.1:{self.controller_port}",
            "advertised.listeners": f"PLAINTEXT://127.0.0.1:{self.port}",
            "controller.listener.names": "CONTROLLER",
            "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
            "inter.broker.listener.name": "PLAINTEXT",
            "log.dirs": str(self.log_dir),
            "num.partitions": "1",
            "auto.create.topics.enable": "false",
            "offsets.topic.replication.factor": "1",
            "offsets.topic.num.partitions": "4",
            "transaction.state.log.replication.factor": "1",
            "transaction.state.log.min.isr": "1",
            "transaction.state.log.num.partitions": "4",
            "share.coordinator.state.topic.replication.factor": "1",
            "share.coordinator.state.topic.min.isr": "1",
            "group.initial.rebalance.delay.ms": "0",
            # a transaction left open past its timeout is aborted within a second
            "transaction.abort.timed.out.transaction.cleanup.interval.ms": "1000",
            "log.cleaner.backoff.ms": "1000",
            **self._settings,
        }

    def _write_config(self) -> None:
        (self.root / "server.properties").write_text(
            "".join(f"{k}={v}\n" for k, v in self._properties().items()))
        (self.root / "log4j2.properties").write_text(
            "rootLogger.level=INFO\nrootLogger.appenderRef.f.ref=F\n"
            "appender.f.type=File\nappender.f.name=F\n"
            f"appender.f.fileName={self.log_file}\nappender.f.layout.type=PatternLayout\n"
            "appender.f.layout.pattern=[%d] %p %m (%c)%n\n")

    def _java(self, main: str, *args: str) -> list[str]:
        options = [f"-Xmx{self._heap}", "-Xms64m", "-XX:+UseSerialGC",
                   f"-Dlog4j2.configurationFile={self.root / 'log4j2.properties'}",
                   "-Djava.awt.headless=true"]
        if not self._jit:
            options.append("-XX:TieredStopAtLevel=1")  # starts faster; tests need no peak
        return ["java", *options, "-cp", f"{self.home}/*", main, *args]

    # process control ----------------------------------------------------------------
    def _format(self) -> None:
        started = time.monotonic()
        result = subprocess.run(
            self._java("kafka.tools.StorageTool", "format", "-t", self.cluster_id, "-c",
                       str(self.root / "server.properties")),
            capture_output=True, text=True, timeout=300, check=False)
        if result.returncode != 0:
            raise RuntimeError(f"kafka storage format failed: {result.stdout}{result.stderr}")
        self.timings["format"].append(time.monotonic() - started)
        self._formatted = True

    def start(self) -> float:
        """Start the broker (format first, the first time) and wait until it answers;
        returns the seconds from the JVM's start until then."""
        if self._process is not None and self._process.poll() is None:
            return 0.0
        if not self._formatted:
            self._format()
        started = time.monotonic()
        with open(self.root / "stdout.log", "ab") as out:
            self._process = subprocess.Popen(
                self._java("kafka.Kafka", str(self.root / "server.properties")),
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self._await_ready(started)
        took = time.monotonic() - started
        self.timings["start"].append(took)
        return took

    def _await_ready(self, started: float) -> None:
        from confluent_kafka.admin import AdminClient

        admin = AdminClient({"bootstrap.servers": self.bootstrap, "log_level": 0})
        while True:
            if self._process is None or self._process.poll() is not None:
                raise RuntimeError(f"the Kafka broker exited at start:\n{self._log_tail()}")
            try:
                metadata = admin.list_topics(timeout=1.0)
                if metadata.brokers:
                    return
            except Exception:
                pass
            if time.monotonic() - started > _START_TIMEOUT:
                raise RuntimeError(f"the Kafka broker did not answer within "
                                   f"{_START_TIMEOUT:g} s:\n{self._log_tail()}")
            time.sleep(0.2)

    def _log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_file.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    def stop(self, *, kill: bool = False) -> None:
        """End the broker by its pid: SIGTERM (a clean shutdown) or SIGKILL."""
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=30)

    def pause(self, seconds: float) -> None:
        """Stop the JVM (SIGSTOP) for ``seconds``, then let it go on (SIGCONT)."""
        process = self._process
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGSTOP)
        try:
            time.sleep(seconds)
        finally:
            process.send_signal(signal.SIGCONT)

    def restart(self, *, kill: bool = True) -> float:
        """SIGKILL (or stop) the JVM and start it again on the same ports and log
        directory; returns the seconds from the kill until the broker answers."""
        started = time.monotonic()
        self.stop(kill=kill)
        self.start()
        took = time.monotonic() - started
        self.timings["restart"].append(took)
        return took

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.root, ignore_errors=True)

    # clients ------------------------------------------------------------------------
    def admin(self) -> Any:
        from confluent_kafka.admin import AdminClient

        return AdminClient({"bootstrap.servers": self.bootstrap, "log_level": 0})

    def create_topic(self, name: str, partitions: int = 3, **config: str) -> str:
        return self.create_on(self.bootstrap, name, partitions, **config)

    @staticmethod
    def create_on(bootstrap: str, name: str, partitions: int = 3, **config: str) -> str:
        """Create topic ``name`` on the brokers at ``bootstrap`` (replication 1)."""
        from confluent_kafka.admin import AdminClient, NewTopic

        admin = AdminClient({"bootstrap.servers": bootstrap, "log_level": 0})
        futures = admin.create_topics(  # the client is kept until the future is done
            [NewTopic(name, num_partitions=partitions, replication_factor=1, config=config)])
        futures[name].result(timeout=60)
        return name

    def delete_topic(self, name: str) -> None:
        admin = self.admin()
        admin.delete_topics([name])[name].result(timeout=60)
        deadline = time.monotonic() + 30
        while name in admin.list_topics(timeout=10).topics:
            if time.monotonic() > deadline:
                raise AssertionError(f"topic {name} still listed 30 s after its deletion")
            time.sleep(0.2)


def read_topic(bootstrap: str, topic: str, *, committed: bool = True,
               timeout: float = 60.0) -> list[Any]:
    """Every record of ``topic`` a reader with ``isolation.level`` ``read_committed``
    (``committed``) or ``read_uncommitted`` sees, partition by partition in offset order:
    each a ``confluent_kafka.Message``. Reads up to the end each partition had when the
    call began (for ``read_committed``: the last stable offset)."""
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer({
        "bootstrap.servers": bootstrap, "group.id": f"raysink-test-{uuid.uuid4().hex}",
        "enable.auto.commit": False, "log_level": 0,
        # a fetch at the end returns at once (the broker holds it 500 ms by default)
        "fetch.wait.max.ms": 10,
        "isolation.level": "read_committed" if committed else "read_uncommitted"})
    try:
        metadata = consumer.list_topics(topic, timeout=30).topics[topic]
        if metadata.error is not None:
            return []
        partitions = sorted(metadata.partitions)
        ends = {p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=30,
                                                   cached=False)[1] for p in partitions}
        consumer.assign([TopicPartition(topic, p, 0) for p in partitions])
        records: dict[int, list[Any]] = {p: [] for p in partitions}
        positions = dict.fromkeys(partitions, 0)
        deadline = time.monotonic() + timeout
        while any(positions[p] < ends[p] for p in partitions):
            if time.monotonic() > deadline:
                raise AssertionError(f"reading {topic}: still at {positions} of {ends}")
            # short: the last records of a transactional topic are its markers, which are
            # never delivered; each read ended with a whole empty poll (0.5 s) before
            message = consumer.poll(_POLL_SECONDS)
            if message is None:
                _advance(consumer, topic, positions)
                continue
            if message.error() is not None:
                continue
            records[message.partition()].append(message)
            positions[message.partition()] = message.offset() + 1
        return [m for p in partitions for m in records[p]]
    finally:
        consumer.close()


def _advance(consumer: Any, topic: str, positions: dict[int, int]) -> None:
    """Positions past control records (transaction markers), which are never delivered."""
    from confluent_kafka import TopicPartition

    for tp in consumer.position([TopicPartition(topic, p) for p in positions]):
        if tp.offset >= 0:
            positions[tp.partition] = max(positions[tp.partition], tp.offset)


_started: list[KafkaBroker] = []


@atexit.register
def _cleanup_all() -> None:
    for broker in _started:
        with contextlib.suppress(Exception):
            broker.cleanup()


@pytest.fixture(scope="session")
def kafka_broker() -> Iterator[KafkaBroker]:
    """One Kafka broker for the whole test session (fetched and formatted on first use)."""
    broker = KafkaBroker()
    _started.append(broker)
    try:
        broker.start()
        yield broker
    finally:
        broker.cleanup()
