"""The cluster layer's fixtures: one multi-node Ray on this machine for the whole layer.

``cluster``  a ``tests.support.cluster.LocalCluster``: the head (the driver's node) and
             three worker raylets, two of them labelled ``{"raysink": "coordinator"}``
             (tests that lose the coordinator's node pin it there). A test that removes
             a node adds one back with the same labels (``restore``), so every test
             starts with three workers. Closed at the end of the layer, whatever happened.
``schema``   a fresh PostgreSQL schema owned by ``raysink`` (dropped afterwards)

``name`` (a runtime name of the test's own) comes from ``tests/conftest.py``.

The layer runs after every other one in a session (``tests/conftest.py`` orders it
last): it ends the single-node Ray of the other layers before its cluster starts.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Mapping

import pytest

from tests.integration.real_targets import pg_schema
from tests.support.cluster import LocalCluster
from tests.support.postgres import PostgresServer

log = logging.getLogger(__name__)

COORDINATOR_LABELS: Mapping[str, str] = {"raysink": "coordinator"}
WORKER_LABELS: list[Mapping[str, str]] = [COORDINATOR_LABELS, COORDINATOR_LABELS, {}]


class Nodes:
    """The layer's cluster with what a test needs to put it back as it found it."""

    def __init__(self, cluster: LocalCluster) -> None:
        self.cluster = cluster
        self._labels: dict[str, Mapping[str, str]] = dict(
            zip(cluster.workers(), WORKER_LABELS, strict=True))

    def remove(self, node: str) -> float:
        """Remove worker ``node`` without grace; a new worker with its labels comes when
        ``restore`` runs. Returns the seconds the removal took."""
        return self.cluster.remove(node)

    def _lost(self) -> list[str]:
        """The workers removed since the cluster was last whole."""
        return [n for n in self._labels if n not in self.cluster.workers()]

    def restore(self) -> None:
        """Add workers until there are three again, with the labels of the ones lost."""
        lost = self._lost()
        started = time.monotonic()
        for node in lost:
            labels = self._labels.pop(node)
            self._labels[self.cluster.add_worker(labels=labels)] = labels
        if lost:
            log.info("%s worker(s) added in %.1f s", len(lost), time.monotonic() - started)

    def wait_lost_declared_dead(self, timeout: float = 60.0) -> None:
        """Wait until Ray has declared every removed worker dead (its health checks time
        out 15-20 s after the loss); what Ray does then can reach far beyond that node."""
        import ray

        lost = set(self._lost())
        deadline = time.monotonic() + timeout
        while lost & {str(n["NodeID"]) for n in ray.nodes() if n["Alive"]}:
            assert time.monotonic() < deadline, f"Ray still lists removed nodes alive: {lost}"
            time.sleep(0.5)

    def labelled(self, labels: Mapping[str, str]) -> list[str]:
        return [n for n, have in self._labels.items()
                if n in self.cluster.workers() and dict(have) == dict(labels)]


@pytest.fixture(scope="session")
def cluster() -> Iterator[Nodes]:
    with LocalCluster(len(WORKER_LABELS), labels=WORKER_LABELS) as local:
        yield Nodes(local)


@pytest.fixture
def nodes(cluster: Nodes) -> Iterator[Nodes]:
    """The cluster, restored to three workers after the test."""
    yield cluster
    cluster.restore()


@pytest.fixture
def schema(pg_server: PostgresServer) -> Iterator[str]:
    yield from pg_schema(pg_server)
