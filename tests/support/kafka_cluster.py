"""A Kafka cluster like the ones users run: a KRaft controller of its own and N brokers.

``tests/support/kafka.py``'s ``KafkaBroker`` is one JVM, broker and controller combined,
with replication factor 1: it can show neither a leader moving to another replica nor a
broker its controller fences. ``KafkaCluster`` starts, from the same jars, one controller
(``process.roles=controller``, the single voter of a static quorum,
``controller.quorum.voters``) and ``brokers`` brokers (``process.roles=broker``, default
3), each a JVM with its own temporary directory and free loopback port (``server_port``),
each formatted by Kafka's storage tool (``format -t <id> -c <its properties>``) with the
cluster's one id.

With three brokers, topics the brokers create default to replication factor 3 and
``min.insync.replicas=2`` (``default.replication.factor``; the internal topics alike:
offsets and transaction state with 3 replicas, the transaction log's min ISR 2, few
partitions so the first transaction does not create 50). With one broker (``brokers=1``,
a broker fenced by a controller in another process) everything is 1. The controller
fences a broker that sent no heartbeat for ``broker.session.timeout.ms`` (5 s here, 9 s
by default; brokers send one every 0.5 s): a paused broker loses its partitions within
seconds, not minutes.

Faults, each by the node's pid (never by a process name): ``kill(n)`` (SIGKILL) then
``start_node(n)``; ``pause(n)``/``resume(n)`` (SIGSTOP/SIGCONT); ``rolling_restart()``
(each broker stopped cleanly and started again, the next one only when every partition
is back in sync). ``leader_of(topic, p)`` is the broker leading a partition (cluster
metadata); ``txn_coordinator_of(id)`` the broker coordinating a transactional id: the
leader of ``__transaction_state`` partition ``abs(hash(id)) % partitions`` with Java's
``String.hashCode``, how Kafka's transaction coordinator places an id (its log names that
partition when it initialises the id; the tests check one).

The session fixture ``kafka_cluster`` (``tests/kafka_cluster/conftest.py``) starts one
cluster per session; ``cleanup()`` (also at exit) stops every node by its pid and deletes
its directory.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from tests.support.kafka import KafkaBroker, _cluster_id, kafka_home

__all__ = ["KafkaCluster", "java_string_hash", "transaction_partition"]

_READY_TIMEOUT = 180.0
SESSION_TIMEOUT_MS = 5000
CONTROLLER_ID = 100


def java_string_hash(text: str) -> int:
    """Java's ``String.hashCode`` of ``text`` (31-based over UTF-16 code units, a signed
    32-bit int)."""
    units = text.encode("utf-16-be")
    value = 0
    for i in range(0, len(units), 2):
        value = (31 * value + int.from_bytes(units[i:i + 2], "big")) & 0xFFFFFFFF
    return value - (1 << 32) if value >= 1 << 31 else value


def transaction_partition(transactional_id: str, partitions: int) -> int:
    """The ``__transaction_state`` partition of ``transactional_id``: Kafka's
    ``Utils.abs(id.hashCode) % partitions`` (``Utils.abs`` maps ``MIN_VALUE`` to 0)."""
    value = java_string_hash(transactional_id)
    return (0 if value == -(1 << 31) else abs(value)) % partitions


class _Node(KafkaBroker):
    """One JVM of the cluster: the controller (``voters`` empty: it is the voter) or a
    broker; ``KafkaBroker``'s process control with its own properties."""

    def __init__(self, home: Path, node_id: int, *, voters: str, shared: dict[str, str],
                 cluster_id: str, heap: str) -> None:
        self.node_id = node_id
        self.controller = not voters
        self._voters = voters
        self._shared = shared
        self.paused = False
        super().__init__(home, heap=heap, cluster_id=cluster_id)

    def _properties(self) -> dict[str, str]:
        address = f"127.0.0.1:{self.port}"
        common = {"node.id": str(self.node_id), "log.dirs": str(self.log_dir),
                  "controller.listener.names": "CONTROLLER", **self._shared}
        if self.controller:
            return {**common, "process.roles": "controller",
                    "controller.quorum.voters": f"{self.node_id}@{address}",
                    "listeners": f"CONTROLLER://{address}",
                    "listener.security.protocol.map": "CONTROLLER:PLAINTEXT"}
        return {**common, "process.roles": "broker",
                "controller.quorum.voters": self._voters,
                "listeners": f"PLAINTEXT://{address}",
                "advertised.listeners": f"PLAINTEXT://{address}",
                "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
                "inter.broker.listener.name": "PLAINTEXT"}

    def _await_ready(self, started: float) -> None:
        if not self.controller:
            super()._await_ready(started)
            return
        while True:  # a controller answers no metadata request: its port accepting will do
            if self._process is None or self._process.poll() is not None:
                raise RuntimeError(f"the Kafka controller exited at start:\n{self._log_tail()}")
            with contextlib.suppress(OSError), \
                    socket.create_connection(("127.0.0.1", self.port), timeout=1.0):
                return
            if time.monotonic() - started > _READY_TIMEOUT:
                raise RuntimeError(f"the Kafka controller did not listen within "
                                   f"{_READY_TIMEOUT:g} s:\n{self._log_tail()}")
            time.sleep(0.2)

    def signal(self, signum: signal.Signals) -> None:
        if self.pid is None:
            raise RuntimeError(f"node {self.node_id} is not running")
        os.kill(self.pid, signum)
        if signum in (signal.SIGSTOP, signal.SIGCONT):
            self.paused = signum == signal.SIGSTOP

    def stop(self, *, kill: bool = False) -> None:
        """A paused JVM is continued first: it acts on SIGTERM only once it runs."""
        if self.paused and self.pid is not None and not kill:
            with contextlib.suppress(ProcessLookupError):
                self.signal(signal.SIGCONT)
        self.paused = False
        super().stop(kill=kill)


def _shared_settings(brokers: int) -> dict[str, str]:
    replicas = str(min(3, brokers))
    min_isr = str(min(2, brokers))
    return {
        "num.partitions": "1", "auto.create.topics.enable": "false",
        "default.replication.factor": replicas, "min.insync.replicas": min_isr,
        "offsets.topic.replication.factor": replicas, "offsets.topic.num.partitions": "3",
        "transaction.state.log.replication.factor": replicas,
        "transaction.state.log.min.isr": min_isr,
        "transaction.state.log.num.partitions": "6",
        "share.coordinator.state.topic.replication.factor": replicas,
        "share.coordinator.state.topic.min.isr": min_isr,
        "group.initial.rebalance.delay.ms": "0",
        "transaction.abort.timed.out.transaction.cleanup.interval.ms": "1000",
        "log.cleaner.backoff.ms": "1000",
        # the controller fences a broker silent this long; brokers beat well within it
        "broker.session.timeout.ms": str(SESSION_TIMEOUT_MS),
        "broker.heartbeat.interval.ms": "500",
        # a cleanly stopped broker hands its leaderships over at once
        "controlled.shutdown.enable": "true",
    }


class KafkaCluster:
    """A KRaft controller and ``brokers`` brokers on loopback; see the module docstring.

    Nodes are named by their ``node.id``: brokers 1..N, the controller ``CONTROLLER_ID``.
    ``timings`` keeps the seconds of each start, node start and rolling restart."""

    def __init__(self, brokers: int = 3, *, home: Path | None = None,
                 heap: str = "320m", controller_heap: str = "192m") -> None:
        if brokers < 1:
            raise ValueError(f"a cluster needs a broker; got brokers={brokers}")
        home = home or kafka_home()
        cluster = _cluster_id()
        shared = _shared_settings(brokers)
        self.controller = _Node(home, CONTROLLER_ID, voters="", shared=shared,
                                cluster_id=cluster, heap=controller_heap)
        voters = f"{CONTROLLER_ID}@127.0.0.1:{self.controller.port}"
        self.brokers = {n: _Node(home, n, voters=voters, shared=shared, cluster_id=cluster,
                                 heap=heap) for n in range(1, brokers + 1)}
        self.bootstrap = ",".join(b.bootstrap for b in self.brokers.values())
        self.replication = int(shared["default.replication.factor"])
        self.timings: dict[str, list[float]] = {"start": [], "node_start": [], "rolling": []}

    # process control ----------------------------------------------------------------
    def _nodes(self) -> list[_Node]:
        return [self.controller, *self.brokers.values()]

    def start(self) -> float:
        """Format and start every node at once; returns the seconds until every broker is
        registered (listed in the cluster's metadata)."""
        started = time.monotonic()
        with ThreadPoolExecutor(len(self._nodes())) as pool:
            for future in [pool.submit(node.start) for node in self._nodes()]:
                future.result()
        self._await_brokers(set(self.brokers), _READY_TIMEOUT)
        took = time.monotonic() - started
        self.timings["start"].append(took)
        return took

    def _await_brokers(self, want: set[int], timeout: float) -> None:
        started = time.monotonic()
        admin = self.admin()
        while True:
            with contextlib.suppress(Exception):
                if want <= set(admin.list_topics(timeout=2.0).brokers):
                    return
            if time.monotonic() - started > timeout:
                raise RuntimeError(f"brokers {sorted(want)} not all registered within "
                                   f"{timeout:g} s")
            time.sleep(0.2)

    def node(self, node: int) -> _Node:
        if node == CONTROLLER_ID:
            return self.controller
        if node not in self.brokers:
            raise KeyError(f"no node {node}: brokers {sorted(self.brokers)}, controller "
                           f"{CONTROLLER_ID}")
        return self.brokers[node]

    def kill(self, node: int) -> None:
        """SIGKILL the node's JVM (by its pid)."""
        self.node(node).stop(kill=True)

    def stop_node(self, node: int) -> None:
        """Stop the node cleanly (SIGTERM: a broker hands its leaderships over)."""
        self.node(node).stop()

    def start_node(self, node: int) -> float:
        """Start a stopped or killed node again on its port and directory; returns the
        seconds until it answers."""
        took = self.node(node).start()
        self.timings["node_start"].append(took)
        return took

    def pause(self, node: int) -> None:
        """SIGSTOP the node: it answers nothing and sends no heartbeat, its sockets open."""
        self.node(node).signal(signal.SIGSTOP)

    def resume(self, node: int) -> None:
        self.node(node).signal(signal.SIGCONT)

    def rolling_restart(self, *, timeout: float = 180.0) -> float:
        """Stop each broker cleanly and start it again, one after another, each time
        waiting until every partition is back in sync; returns the seconds it took."""
        started = time.monotonic()
        for number in self.brokers:
            self.stop_node(number)
            self.start_node(number)
            self.await_in_sync(timeout=timeout)
        took = time.monotonic() - started
        self.timings["rolling"].append(took)
        return took

    def restore(self, *, timeout: float = 180.0) -> None:
        """Every node running and unpaused, every partition in sync: what a test that
        paused, killed or stopped a node left is undone before the next one."""
        for node in self._nodes():
            if node.paused:
                node.signal(signal.SIGCONT)
            if node.pid is None or node._process is None or node._process.poll() is not None:
                node.start()
        self.await_in_sync(timeout=timeout)

    def cleanup(self) -> None:
        """SIGKILL every node (by its pid) and delete its directory; idempotent. (Not a
        clean stop: brokers stopped cleanly after the controller wait for it a minute.)"""
        for node in self._nodes():
            with contextlib.suppress(Exception):
                node.stop(kill=True)
            with contextlib.suppress(Exception):
                node.cleanup()

    # metadata -----------------------------------------------------------------------
    def admin(self) -> Any:
        from confluent_kafka.admin import AdminClient

        return AdminClient({"bootstrap.servers": self.bootstrap, "log_level": 0})

    def _partitions(self, topic: str) -> dict[int, Any]:
        metadata = self.admin().list_topics(topic, timeout=10).topics[topic]
        if metadata.error is not None:
            raise RuntimeError(f"topic {topic}: {metadata.error}")
        return dict(metadata.partitions)

    def leader_of(self, topic: str, partition: int = 0) -> int:
        """The broker leading ``topic``'s ``partition`` (-1: none now)."""
        return int(self._partitions(topic)[partition].leader)

    def txn_coordinator_of(self, transactional_id: str) -> int:
        """The broker coordinating ``transactional_id``: the leader of its
        ``__transaction_state`` partition (see the module docstring)."""
        partitions = self._partitions("__transaction_state")
        return int(partitions[transaction_partition(transactional_id,
                                                    len(partitions))].leader)

    def out_of_sync(self) -> list[str]:
        """Each partition with no leader or a replica outside its ISR, as ``topic-p``."""
        topics = self.admin().list_topics(timeout=10).topics
        return [f"{name}-{p}" for name, meta in topics.items()
                for p, part in meta.partitions.items()
                if part.leader < 0 or set(part.isrs) != set(part.replicas)]

    def await_in_sync(self, *, timeout: float = 180.0) -> None:
        """Every broker registered and every partition's replicas in its ISR."""
        deadline = time.monotonic() + timeout
        self._await_brokers(set(self.brokers), timeout)
        lagging: list[str] = []
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                lagging = self.out_of_sync()
                if not lagging:
                    return
            time.sleep(0.5)
        raise AssertionError(f"partitions still out of sync after {timeout:g} s: "
                             f"{lagging[:10]}")

    def create_topic(self, name: str, partitions: int = 3, **config: str) -> str:
        from confluent_kafka.admin import NewTopic

        admin = self.admin()  # kept until the future is done: its end fails the future
        futures = admin.create_topics(
            [NewTopic(name, num_partitions=partitions, replication_factor=self.replication,
                      config=config)])
        futures[name].result(timeout=60)
        return name


_started: list[KafkaCluster] = []


def started_cluster(brokers: int = 3) -> KafkaCluster:
    """A started cluster, stopped at the latest when the interpreter exits."""
    cluster = KafkaCluster(brokers)
    _started.append(cluster)
    try:
        cluster.start()
    except BaseException:
        cluster.cleanup()
        raise
    return cluster


@atexit.register
def _cleanup_all() -> None:
    for cluster in _started:
        cluster.cleanup()
