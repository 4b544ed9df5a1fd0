"""Nodes removed without grace mid-epoch, on a four-node Ray (``tests/cluster/conftest.py``).

One runtime writes a Parquet directory, a Delta table, a PostgreSQL table and a Kafka topic
at once (three writers per sink: one per worker node; the session's real broker, on this
machine's loopback), its decisions in the PostgreSQL meta store,
its coordinator on a worker node labelled for it (a PostgreSQL meta store lets it run
anywhere). Each of epochs 2-5 is held at one protocol point (a ``sleep`` fault inside the
actor) while that actor's node is removed: every process on it SIGKILLed, and Ray goes on
listing the node alive until its health checks time out. The epoch must commit (given up
and fed again to a writer on another node, or rolled forward by a new coordinator on the
other labelled node); a worker with the lost one's labels joins before the next epoch.
Every target holds every row of epochs 1-6 once, compared row by row; the topic is read
with ``isolation.level=read_committed``, each partition's records in epoch order. A lost
node takes a Kafka writer with it: one that had begun its transaction (epoch 3) leaves it
to be fenced and its part replayed from the log by the coordinator's committer. (One
runtime for every case: the layer's time budget is small.)

The seconds from each removal to its epoch committed are logged, never asserted
(``bench/node_loss.py`` measures them).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from pathlib import Path

import pyarrow as pa
import pytest

from raysink import Placement, SinkRuntime
from raysink.driver.lifecycle import COORDINATOR
from raysink.sinks import KafkaSink
from raysink.testing import arm_fault
from tests.cluster.conftest import COORDINATOR_LABELS, Nodes
from tests.integration.helpers import epoch_table, run_in_thread, wait_fired
from tests.integration.real_targets import (
    DeltaTarget,
    ParquetTarget,
    PostgresTarget,
    Target,
    assert_ids_exact,
)
from tests.support.kafka import KafkaBroker, read_topic
from tests.support.postgres import PostgresServer

pytestmark = pytest.mark.timeout(300)

log = logging.getLogger(__name__)

ROWS = 1200
WRITERS = 3

STEPS = [
    # epoch 2: a writer's node while it applies the epoch's data: the attempt is given
    # up, the writer replaced on another node, the epoch fed again
    ("writer.during_write", "writer"),
    # epoch 3: a writer's node after it staged its data, before the driver has its
    # commit request
    ("writer.after_pre_commit", "writer"),
    # epoch 4: the coordinator's node after PENDING is recorded: a new coordinator (a new
    # generation in the meta store) rolls the epoch forward on the other labelled node
    ("coordinator.after_pending", "coordinator"),
    # epoch 5: the coordinator's node inside the Delta commit (files added, marker not yet
    # read back): the new coordinator finds the marker or commits again, never twice
    ("sink.mid_commit", "coordinator"),
]


def _pieces(epoch: int) -> list[pa.Table]:
    """The epoch's rows in six pieces: every writer receives some."""
    table = epoch_table(epoch, ROWS)
    step = ROWS // 6
    return [table.slice(i * step, step) for i in range(6)]


def _victim(rt: SinkRuntime, nodes: Nodes, epoch: int, point: str, kind: str
            ) -> tuple[str, dict[str, object]]:
    """The node to remove and the fault context that holds ``epoch`` on it."""
    actors = rt._actors
    assert actors is not None
    coordinator = actors.node_of(COORDINATOR)
    assert coordinator in nodes.labelled(COORDINATOR_LABELS)
    if kind == "coordinator":
        return str(coordinator), {"epoch": epoch, **({"sink": "delta"}
                                                     if point == "sink.mid_commit" else {})}
    workers = set(nodes.cluster.workers())
    index = next(k for k in range(WRITERS)
                 if actors.node_of(("parquet", k)) in workers - {coordinator})
    return str(actors.node_of(("parquet", index))), {"epoch": epoch, "writer": index,
                                                     "sink": "parquet"}


def _lose_node_mid_epoch(rt: SinkRuntime, nodes: Nodes, name: str, epoch: int, point: str,
                         kind: str) -> float:
    """Write ``epoch`` while the node of the actor held at ``point`` is removed; the
    seconds from the removal to the epoch committed."""
    victim, when = _victim(rt, nodes, epoch, point, kind)
    arm_fault(name, point, action="sleep", seconds=120, when=when)
    thread, box = run_in_thread(lambda: rt.write_arrow(_pieces(epoch)))
    wait_fired(name, point)
    nodes.remove(victim)
    removed = time.monotonic()
    thread.join(120)
    assert not thread.is_alive(), f"epoch {epoch} never finished after the node loss"
    if "error" in box:
        raise box["error"]
    assert box["result"].epoch == epoch and box["result"].committed
    actors = rt._actors
    assert actors is not None
    placed = {actors.node_of(COORDINATOR)} | {
        actors.node_of((sink, k)) for sink in actors.writers for k in range(WRITERS)}
    assert victim not in placed, f"an actor is still placed on the lost node ({point})"
    return float(box["ended"]) - removed


def _read_committed_ids(broker: KafkaBroker, topic: str) -> list[int]:
    """The ids a ``read_committed`` reader sees; each partition's epochs in order."""
    messages = read_topic(broker.bootstrap, topic)
    rows = [json.loads(m.value()) for m in messages]
    by_partition: dict[int, list[int]] = {}
    for message, row in zip(messages, rows, strict=True):
        by_partition.setdefault(message.partition(), []).append(int(row["id"]) // 1_000_000)
    for partition, epochs in by_partition.items():
        assert epochs == sorted(epochs), f"partition {partition}: epochs out of order"
    return [int(row["id"]) for row in rows]


def test_nodes_lost_mid_epoch(nodes: Nodes, pg_server: PostgresServer, schema: str,
                              kafka_broker: KafkaBroker, tmp_path: Path, name: str) -> None:
    targets: dict[str, Target] = {"parquet": ParquetTarget(tmp_path / "parquet"),
                                  "delta": DeltaTarget(tmp_path / "delta"),
                                  "pg": PostgresTarget(pg_server, schema)}
    sinks = {sink: target.sink() for sink, target in targets.items()}
    topic = f"node-loss-{uuid.uuid4().hex[:8]}"
    sinks["kafka"] = KafkaSink(kafka_broker.bootstrap, topic, key="customer", partitions=3,
                               timeout=30.0)
    with SinkRuntime(name, sinks, writers=WRITERS, metastore=pg_server.dsn(), retry_cap=0.5,
                     placement=Placement(coordinator=COORDINATOR_LABELS),
                     progress=False) as rt:
        assert rt.write_arrow(_pieces(1)).committed
        for epoch, (point, kind) in enumerate(STEPS, start=2):
            seconds = _lose_node_mid_epoch(rt, nodes, name, epoch, point, kind)
            log.info("%s: node lost at %s; epoch %s committed %.2f s later", name, point,
                     epoch, seconds)
            nodes.restore()
        last = len(STEPS) + 2
        assert rt.write_arrow(_pieces(last)).committed
    for target in targets.values():
        assert_ids_exact(target.ids(), range(1, last + 1), ROWS)
    assert_ids_exact(_read_committed_ids(kafka_broker, topic), range(1, last + 1), ROWS)
