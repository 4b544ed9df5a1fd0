"""Where a runtime's actors run on the four-node cluster, read back from Ray itself.

With the embedded SQLite meta store the coordinator is pinned to the driver's node (its
file is there) and a warning says to use PostgreSQL; writers spread one per worker node
before the driver's node gets one. ``Placement(labels=...)`` keeps writers on the
labelled nodes; with a PostgreSQL meta store the coordinator may go to a labelled node.
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pytest

from raysink import Placement, SinkRuntime
from raysink.driver.lifecycle import coordinator_name, writer_name
from raysink.sinks import ParquetSink
from raysink.writer.writer import NAMESPACE
from tests.cluster.conftest import COORDINATOR_LABELS, Nodes
from tests.support.cluster import LocalCluster
from tests.support.postgres import PostgresServer

pytestmark = pytest.mark.timeout(120)


def _node(name: str) -> str:
    return LocalCluster.node_of_actor(name, namespace=NAMESPACE)


def test_sqlite_pins_the_coordinator_to_the_driver_and_writers_spread(
        nodes: Nodes, tmp_path: Path, name: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="raysink"), SinkRuntime(
            name, ParquetSink(str(tmp_path / "t")), writers=3,
            metastore=f"sqlite:///{tmp_path / 'm.db'}", progress=False) as rt:
        assert rt.write_arrow(pa.table({"id": list(range(30))})).committed
        assert _node(coordinator_name(name)) == nodes.cluster.head
        writers = sorted(_node(writer_name(name, "main", k)) for k in range(3))
        assert writers == sorted(nodes.cluster.workers())
    assert "pinned to this node" in caplog.text and "PostgreSQL meta store" in caplog.text


def test_labels_keep_writers_on_their_nodes_and_postgres_lets_the_coordinator_move(
        nodes: Nodes, pg_server: PostgresServer, tmp_path: Path, name: str) -> None:
    labelled = set(nodes.labelled(COORDINATOR_LABELS))
    placement = Placement(labels=COORDINATOR_LABELS, coordinator=COORDINATOR_LABELS)
    with SinkRuntime(name, ParquetSink(str(tmp_path / "t")), writers=4,
                     metastore=pg_server.dsn(), placement=placement, progress=False) as rt:
        assert rt.write_arrow([pa.table({"id": [i]}) for i in range(8)]).committed
        assert _node(coordinator_name(name)) in labelled
        writers = Counter(_node(writer_name(name, "main", k)) for k in range(4))
        assert set(writers) == labelled and set(writers.values()) == {2}
