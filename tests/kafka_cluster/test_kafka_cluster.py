"""Exactly once into a Kafka cluster while its brokers fail as they do for users: the
leader of the progress partition killed mid-commit, the broker coordinating the
committer's transaction killed mid-commit, a broker paused past its session timeout, a
rolling restart of every broker during a stream.

Three brokers and a KRaft controller of its own (``tests/support/kafka_cluster.py``);
the sink's topics with replication factor 3 and ``min.insync.replicas=2``, so one broker
down never stops a write. Each case reads the topic back with ``read_committed``: every
row once, nothing else, epochs in order in each partition. All but the first case are
marked ``kafka_cluster`` (``make kafka-cluster``); the first runs in the default suite.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from raysink import SinkRuntime
from raysink.testing import arm_fault
from tests.integration.helpers import run_in_thread, wait_fired
from tests.kafka.conftest import Records, halves, sink
from tests.support.kafka_cluster import SESSION_TIMEOUT_MS, KafkaCluster

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.timeout(400)]


def _runtime(name: str, cluster: KafkaCluster, topic: str, meta: str) -> SinkRuntime:
    target = sink(cluster, topic, replication_factor=3,  # type: ignore[arg-type]
                  min_insync_replicas=2, timeout=90.0)
    return SinkRuntime(name, target, writers=2, metastore=meta, progress=False,
                       retry_cap=1.0, commit_timeout=120, max_attempts=5)


def _progress(topic: str) -> str:
    return f"{topic}-raysink-progress"


def _committer(cluster: KafkaCluster, topic: str, name: str) -> str:
    """The transactional id of the committer of the runtime's sink ``main``."""
    target = sink(cluster, topic)  # type: ignore[arg-type]
    return str(target.settings.committer_txn(name, "main"))


def _during(rt: SinkRuntime, name: str, point: str, epoch: int,
            act: Callable[[], None], seconds: float = 2.0) -> Any:
    """Write ``epoch`` while a sleep of ``seconds`` holds its commit at ``point``;
    ``act()`` meanwhile. Returns the epoch's report."""
    arm_fault(name, point, action="sleep", seconds=seconds, when={"epoch": epoch})
    thread, box = run_in_thread(lambda: rt.write_arrow(halves(epoch)))
    wait_fired(name, point, timeout=120)
    act()
    thread.join(timeout=300)
    assert not thread.is_alive(), f"epoch {epoch} never finished"
    if "error" in box:
        raise box["error"]
    return box["result"]


def _leader_moves_off(cluster: KafkaCluster, topic: str, node: int,
                      seconds: float) -> int:
    """The new leader of ``topic``'s partition 0 once ``node`` lost it (within
    ``seconds``; a metadata call that hit a paused broker is asked again)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            leader = cluster.leader_of(topic)
            if leader not in (node, -1):
                return leader
        time.sleep(0.5)
    raise AssertionError(f"broker {node} still leads {topic}-0 after {seconds:g} s")


@pytest.mark.kafka  # the default run's case: counted in the kafka layer's budget
def test_progress_leader_killed_mid_commit(kafka_cluster: KafkaCluster, topic: str,
                                           name: str, meta: str) -> None:
    """The broker leading the progress partition is SIGKILLed while epoch 2's commit is
    between the writers' commits and the epoch record's: the committer's commit goes to
    the partition's new leader (elected once the controller fences the dead broker), the
    broker comes back, and epoch 3 follows. Every record once."""
    with _runtime(name, kafka_cluster, topic, meta) as rt:
        assert rt.write_arrow(halves(1)).committed
        leader = kafka_cluster.leader_of(_progress(topic))
        second = _during(rt, name, "sink.mid_commit", 2, lambda: kafka_cluster.kill(leader))
        assert second.committed
        assert _leader_moves_off(kafka_cluster, _progress(topic), leader, 60) != leader
        kafka_cluster.start_node(leader)
        assert rt.write_arrow(halves(3)).committed
    Records(kafka_cluster, topic).assert_exactly([1, 2, 3])  # type: ignore[arg-type]


@pytest.mark.kafka_cluster
def test_transaction_coordinator_killed_mid_commit(kafka_cluster: KafkaCluster, topic: str,
                                                   name: str, meta: str) -> None:
    """The broker coordinating the committer's transactional id is SIGKILLed with epoch
    2's commit half done (the writers' parts committed, the epoch record's transaction
    open): the id's ``__transaction_state`` partition gets a new leader, which completes
    the commit. The broker is found as Kafka places the id; its log shows it initialised
    the id."""
    with _runtime(name, kafka_cluster, topic, meta) as rt:
        assert rt.write_arrow(halves(1)).committed
        txn = _committer(kafka_cluster, topic, name)
        coordinator = kafka_cluster.txn_coordinator_of(txn)
        log = kafka_cluster.node(coordinator).log_file.read_text(errors="replace")
        assert f"Initialized transactionalId {txn} " in log
        second = _during(rt, name, "sink.mid_commit", 2,
                         lambda: kafka_cluster.kill(coordinator))
        assert second.committed
        kafka_cluster.start_node(coordinator)
        assert rt.write_arrow(halves(3)).committed
    Records(kafka_cluster, topic).assert_exactly([1, 2, 3])  # type: ignore[arg-type]


@pytest.mark.kafka_cluster
def test_broker_paused_past_its_session_timeout(kafka_cluster: KafkaCluster, topic: str,
                                                name: str, meta: str) -> None:
    """The progress partition's leader is SIGSTOPped while epoch 2's commit begins and
    stays stopped until its controller fenced it (its leaderships gone), then continues:
    it finds itself a follower, and the requests it held are answered. Epochs 2-4 each
    once."""
    paused: dict[str, float] = {}

    def pause_past_timeout() -> None:
        kafka_cluster.pause(leader)
        paused["at"] = time.monotonic()
        try:
            _leader_moves_off(kafka_cluster, _progress(topic), leader,
                              SESSION_TIMEOUT_MS / 1000 + 30)
            time.sleep(1.0)
        finally:
            kafka_cluster.resume(leader)
            paused["for"] = time.monotonic() - paused["at"]

    with _runtime(name, kafka_cluster, topic, meta) as rt:
        assert rt.write_arrow(halves(1)).committed
        leader = kafka_cluster.leader_of(_progress(topic))
        # the sleep holds the commit until the pause began: the writers' commits and the
        # epoch record's then meet a paused broker mid-request
        second = _during(rt, name, "kafka.before_finish", 2, pause_past_timeout,
                         seconds=1.0)
        assert paused["for"] > SESSION_TIMEOUT_MS / 1000
        assert second.committed
        assert rt.write_arrow(halves(3)).committed
        assert rt.write_arrow(halves(4)).committed
    Records(kafka_cluster, topic).assert_exactly([1, 2, 3, 4])  # type: ignore[arg-type]


@pytest.mark.kafka_cluster
def test_rolling_restart_during_a_stream(kafka_cluster: KafkaCluster, topic: str,
                                         name: str, meta: str) -> None:
    """Epochs are written one after another while each broker in turn is stopped cleanly
    and started again (the next once every partition is back in sync). Every epoch the
    stream fed is in the topic once when the runtime closes."""
    stop = threading.Event()
    fed: list[int] = []

    def stream(rt: SinkRuntime) -> None:
        epoch = 1
        while not stop.is_set():
            rt.write_arrow(halves(epoch))
            fed.append(epoch)
            epoch += 1

    with _runtime(name, kafka_cluster, topic, meta) as rt:
        assert rt.write_arrow(halves(0)).committed  # both topics made before the restarts
        thread, box = run_in_thread(lambda: stream(rt))
        try:
            kafka_cluster.rolling_restart()
        finally:
            stop.set()
            thread.join(timeout=300)
        assert not thread.is_alive(), "the stream's last epoch never finished"
        if "error" in box:
            raise box["error"]
    assert len(fed) >= 3, f"only epochs {fed} ran during the rolling restart"
    Records(kafka_cluster, topic).assert_exactly([0, *fed])  # type: ignore[arg-type]
