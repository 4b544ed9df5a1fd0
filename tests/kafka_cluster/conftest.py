"""The Kafka cluster layer: one ``KafkaCluster`` (a KRaft controller and three brokers,
``tests/support/kafka_cluster.py``) for the whole session, started only when a test asks
for it, and put back in order (every node running, every partition in sync) before each
test that uses it. ``topic``, ``meta`` and the Ray session as in ``tests/kafka``.

Its tests are marked ``kafka_cluster`` (``make kafka-cluster``), not in the default run,
but for one representative case.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.kafka.conftest import meta, topic  # noqa: F401
from tests.support.kafka_cluster import KafkaCluster, started_cluster


@pytest.fixture(scope="session")
def kafka_cluster_session() -> Iterator[KafkaCluster]:
    cluster = started_cluster(brokers=3)
    try:
        yield cluster
    finally:
        cluster.cleanup()


@pytest.fixture
def kafka_cluster(kafka_cluster_session: KafkaCluster) -> KafkaCluster:
    """The session's cluster, whole again: a node a test killed, stopped or paused is
    running, every partition back in sync."""
    kafka_cluster_session.restore()
    return kafka_cluster_session
