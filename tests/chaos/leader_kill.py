"""``leader_kill``: the leader of a partition of the trial's topics SIGKILLed on a
three-broker cluster, and started again.

The session broker (``tests.support.kafka``) is one JVM with replication factor 1: killing
it stops everything, and no leader moves. Here the trial's Kafka target is a topic of one
``KafkaCluster`` per chaos session (``tests.support.kafka_cluster``: a KRaft controller and
three brokers, replication factor 3, ``min.insync.replicas=2``), started at the first
``leader_kill`` trial (``chaos_kafka_cluster`` in ``tests/chaos/conftest.py``) and made
whole again (every node up, every partition in sync) before each. The victim is the
broker leading the progress partition or a data partition (``TrialSpec.victim``:
``progress`` or ``data``, with ``extra["partition"]``): its replicas elsewhere take over,
the transactions it coordinated move with their ``__transaction_state`` partitions, and
the killed broker comes back ``extra["down"]`` seconds later and catches up. A stream
trial's kill comes ``delay`` seconds into the stream, maybe before its first commit made
the progress topic: the kill then waits for the topic (``_leader``).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from raysink.sinks.kafka._config import default_progress_topic
from tests.chaos.plan import TrialSpec

__all__ = ["kill_leader"]

_TOPIC_WAIT = 120.0  # seconds the victim's topic may take to appear (a stream's first commit)


def kill_leader(cluster: Any, spec: TrialSpec, main: Mapping[str, Any]) -> str:
    """SIGKILL the broker leading the trial's victim partition, start it again after
    ``extra["down"]`` seconds; returns the note of what was done."""
    topic = str(main["topic"])
    if spec.victim == "progress":
        target, partition = default_progress_topic(topic), 0
    else:
        target, partition = topic, int(spec.extra.get("partition", 0))
    leader = _leader(cluster, target, partition)
    if leader < 0:
        return f"{target}[{partition}] had no leader to kill"
    cluster.kill(leader)
    down = float(spec.extra.get("down", 0.0))
    time.sleep(down)
    took = cluster.start_node(leader)
    return (f"broker {leader}, leader of {target}[{partition}], SIGKILLed; started again "
            f"after {down:g} s (answering {took:.1f} s later)")


def _leader(cluster: Any, topic: str, partition: int) -> int:
    """The broker leading ``topic[partition]``, once the topic exists (-1: no leader)."""
    deadline = time.monotonic() + _TOPIC_WAIT
    while True:
        try:
            return int(cluster.leader_of(topic, partition))
        except (RuntimeError, KeyError):  # not created yet
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
