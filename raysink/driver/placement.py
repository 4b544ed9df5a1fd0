"""Where a runtime's actors run on a Ray cluster.

Writers spread over the cluster's alive nodes: writer index ``k`` of every sink goes to
the node holding the fewest writer indexes of the runtime so far (ties: nodes other than
the driver's first, then by node id), so each node gets a writer before any node gets a
second, and the writers of all sinks that receive the same data share a node. Each is
pinned there with hard node affinity: Ray restarts a crashed writer on the same node, and
only the runtime moves one (``ActorSet.heal`` replaces a writer whose node stopped
answering, on another node). ``Placement(labels=..., resources=...)`` narrows the nodes a
writer may use; resources are also reserved by each writer, so Ray enforces them.

The coordinator runs on the driver's node, the node whose loss ends the job anyway (under
``ray job submit`` the driver runs on the head). With the embedded SQLite meta store on a
cluster of more than one node it is pinned there with hard node affinity: the decisions
live in a file on that node's disk, and a coordinator started elsewhere would open an empty
store. With a PostgreSQL meta store it may run anywhere: ``Placement(coordinator={...})``
names node labels to pin it to instead.

A node Ray still lists alive may be gone: Ray declares a lost node dead only after its
health checks time out (15-20 s with the defaults). So before a node is chosen, its
raylet's port must accept a connection (``REACH_TIMEOUT``; the answer is kept for
``REACH_TTL`` seconds), and a node where an actor stopped answering (``suspect``, by
``ActorSet.heal``) is left out for ``SUSPECT_SECONDS``: in every runtime of this driver,
not only the one that saw it. A replacement never goes back to the node it left.

Nothing here calls a remote actor: it reads ``ray.nodes()``, opens (and closes at once) a
TCP connection to a raylet, and returns Ray scheduling options.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from raysink.errors import ConfigError

__all__ = ["ClusterView", "NodeInfo", "Placement", "is_sqlite"]

log = logging.getLogger(__name__)

SUSPECT_SECONDS = 120.0
"""How long a node whose actors stopped answering is left out of placement (Ray declares
a lost node dead well within it; a node it still lists alive after that is trusted
again)."""
REACH_TIMEOUT = 0.5
"""Seconds a raylet's port may take to accept a connection before its node is suspect."""
REACH_TTL = 5.0
"""Seconds an answer of a raylet's port is trusted."""

_suspects: dict[str, float] = {}
_reached: dict[str, tuple[float, bool]] = {}
_lock = threading.Lock()


@dataclass(frozen=True, kw_only=True, slots=True)
class Placement:
    """Where a runtime's actors may run (``SinkRuntime(placement=...)``).

    ``labels``: writers only on nodes carrying every one of these labels (``ray start
    --labels='{"pool": "sink"}'``); ``resources``: writers only on nodes offering these
    custom resources, and each writer reserves them (so ``{"sink_slot": 1}`` with one
    ``sink_slot`` per node caps a node at one writer per sink). Writers spread over the
    matching nodes. ``coordinator``: ``"driver"`` (the default: the driver's node), or
    node labels to pin the coordinator to (needs a PostgreSQL meta store on a cluster).
    """

    labels: Mapping[str, str] = field(default_factory=dict)
    resources: Mapping[str, float] = field(default_factory=dict)
    coordinator: str | Mapping[str, str] = "driver"

    def __post_init__(self) -> None:
        for key, value in self.labels.items():
            if not isinstance(key, str) or not isinstance(value, str):
                raise ConfigError(f"placement labels map names to values, both strings; got "
                                  f"{key!r}: {value!r}")
        for key, amount in self.resources.items():
            if not isinstance(key, str) or not isinstance(amount, (int, float)) or amount <= 0:
                raise ConfigError(f"placement resources map names to positive amounts; got "
                                  f"{key!r}: {amount!r}")
        if isinstance(self.coordinator, str):
            if self.coordinator != "driver":
                raise ConfigError(f"placement coordinator is 'driver' or a mapping of node "
                                  f"labels; got {self.coordinator!r}")
        elif not self.coordinator:
            raise ConfigError("placement coordinator labels are empty; use 'driver' or give "
                              "at least one label")

    @property
    def coordinator_on_driver(self) -> bool:
        return isinstance(self.coordinator, str)


@dataclass(frozen=True, slots=True)
class NodeInfo:
    """One alive node as placement sees it."""

    node_id: str
    labels: Mapping[str, str]
    resources: Mapping[str, float]

    def matches(self, labels: Mapping[str, str], resources: Mapping[str, float]) -> bool:
        return (all(self.labels.get(k) == v for k, v in labels.items())
                and all(self.resources.get(k, 0.0) >= amount
                        for k, amount in resources.items()))


def is_sqlite(url: str) -> bool:
    return url.startswith("sqlite:")


class ClusterView:
    """The cluster's alive nodes, the nodes under suspicion, and scheduling options.

    ``nodes`` (tests) replaces ``ray.nodes()``; ``driver_node`` the driver's node id;
    ``suspects`` the book of suspect nodes (by default the one every view of this process
    shares)."""

    def __init__(self, *, driver_node: str | None = None,
                 nodes: Iterable[Mapping[str, Any]] | None = None,
                 suspects: dict[str, float] | None = None) -> None:
        self._driver_node = driver_node
        self._fixed = None if nodes is None else list(nodes)
        self._suspects = _suspects if suspects is None else suspects
        self._rows: tuple[float, dict[str, Mapping[str, Any]]] | None = None

    @property
    def driver_node(self) -> str:
        if self._driver_node is None:
            import ray

            self._driver_node = ray.get_runtime_context().get_node_id()
        return self._driver_node

    def alive(self, *, suspects: bool = False) -> list[NodeInfo]:
        """Alive nodes Ray lists that are not under suspicion (``suspects``: those too):
        nodes other than the driver's first (by node id), then the driver's."""
        now = time.monotonic()
        with _lock:
            for node, since in list(self._suspects.items()):
                if now - since >= SUSPECT_SECONDS:
                    del self._suspects[node]
        rows = self._fixed if self._fixed is not None else _ray_nodes()
        nodes = []
        for row in rows:
            node = str(row["NodeID"])
            if not row.get("Alive") or (not suspects and self.is_suspect(node)):
                continue
            if not suspects and node != self.driver_node and not _raylet_answers(row):
                self.suspect(node)
                continue
            nodes.append(NodeInfo(node, dict(row.get("Labels") or {}),
                                  {k: float(v) for k, v in (row.get("Resources") or {}).items()}))
        return sorted(nodes, key=lambda n: (n.node_id == self.driver_node, n.node_id))

    def suspect(self, node: str | None) -> None:
        """Leave ``node`` out of placement for a while: an actor on it did not answer."""
        if node is not None:
            with _lock:
                known = node in self._suspects
                self._suspects[node] = time.monotonic()
            if not known:
                log.info("node %s is suspect: left out of placement for %.0f s", node[:8],
                         SUSPECT_SECONDS)

    def lost(self, node: str) -> bool:
        """Whether ``node`` is gone: Ray lists it dead or not at all, or its raylet does
        not accept a connection now (asked afresh). A lost node becomes suspect."""
        rows = self._fixed if self._fixed is not None else _ray_nodes()
        row = next((r for r in rows if str(r["NodeID"]) == node), None)
        gone = row is None or not row.get("Alive") or not _raylet_answers(row, fresh=True)
        if gone:
            self.suspect(node)
        return gone

    def refuses(self, node: str) -> bool:
        """Whether ``node``'s raylet refuses a connection now (nothing listens on its port:
        the node is lost, and becomes suspect). Unlike ``lost``, a slow answer does not
        count and Ray's node list is read at most every ``REACH_TTL`` seconds, so this is
        cheap enough to ask while waiting for every call."""
        row = self._row(node)
        if row is None or not _raylet_refuses(row):
            return False
        self.suspect(node)
        return True

    def _row(self, node: str) -> Mapping[str, Any] | None:
        now = time.monotonic()
        if self._rows is None or now - self._rows[0] >= REACH_TTL or node not in self._rows[1]:
            rows = self._fixed if self._fixed is not None else _ray_nodes()
            self._rows = (now, {str(r["NodeID"]): r for r in rows})
        return self._rows[1].get(node)

    def is_suspect(self, node: str) -> bool:
        with _lock:
            return node in self._suspects

    def size(self) -> int:
        return len(self.alive())

    def choose(self, load: Mapping[str, int], labels: Mapping[str, str],
               resources: Mapping[str, float]) -> str:
        """The matching node holding the fewest of ``load`` (suspects only when no other
        node matches); ``ConfigError`` when no alive node matches."""
        nodes = [n for n in self.alive() if n.matches(labels, resources)]
        if not nodes and self._suspects:
            nodes = [n for n in self.alive(suspects=True) if n.matches(labels, resources)]
        if not nodes:
            raise ConfigError(
                f"no alive node of the Ray cluster matches the placement (labels "
                f"{dict(labels)}, resources {dict(resources)}); alive nodes: "
                f"{[(n.node_id[:8], dict(n.labels)) for n in self.alive()]}. Start nodes "
                "with those labels/resources or change placement=")
        return min(nodes, key=lambda n: load.get(n.node_id, 0)).node_id


def affinity(node: str, *, soft: bool) -> dict[str, Any]:
    """Ray actor options pinning an actor to ``node``."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node_id=node, soft=soft)}


def coordinator_node(view: ClusterView, placement: Placement, metastore: str,
                     runtime: str, avoid: str | None = None) -> tuple[str, bool]:
    """The coordinator's node and whether the affinity is hard.

    On the driver's node by default; hard there with SQLite on more than one node (with
    a warning), soft otherwise. Labels: the first matching node other than ``avoid``
    (``avoid`` when no other matches), hard; refused with the SQLite meta store on a
    cluster (its file is on the driver's node)."""
    nodes = view.size()
    sqlite = is_sqlite(metastore)
    if placement.coordinator_on_driver:
        if sqlite and nodes > 1:
            log.warning(
                "%s: the meta store is the embedded SQLite file %s on this driver's node, "
                "so the coordinator is pinned to this node (%d nodes in the cluster). A job "
                "that must survive the loss of this node needs a PostgreSQL meta store "
                "(metastore='postgresql://...')", runtime, metastore, nodes)
            return view.driver_node, True
        return view.driver_node, False
    labels = placement.coordinator if isinstance(placement.coordinator, Mapping) else {}
    if sqlite and nodes > 1:
        raise ConfigError(
            f"placement coordinator={dict(labels)} moves the coordinator off "
            f"the driver's node, but the meta store {metastore} is a SQLite file on the "
            "driver's node: use a PostgreSQL meta store (metastore='postgresql://...') or "
            "coordinator='driver'", runtime=runtime)
    return view.choose({avoid: 1} if avoid else {}, labels, {}), True


def _raylet_answers(row: Mapping[str, Any], *, fresh: bool = False) -> bool:
    """Whether the node's raylet accepts a TCP connection (a row without an address, in
    tests, is trusted). Answers are kept ``REACH_TTL`` seconds unless ``fresh``."""
    address, port = row.get("NodeManagerAddress"), row.get("NodeManagerPort")
    if not address or not port:
        return True
    node, now = str(row["NodeID"]), time.monotonic()
    with _lock:
        known = _reached.get(node)
    if not fresh and known is not None and now - known[0] < REACH_TTL:
        return known[1]
    try:
        with socket.create_connection((str(address), int(port)), timeout=REACH_TIMEOUT):
            answered = True
    except OSError:
        answered = False
    with _lock:
        _reached[node] = (time.monotonic(), answered)
    return answered


def _raylet_refuses(row: Mapping[str, Any]) -> bool:
    """Whether the node's raylet port refuses a connection now (a row without an address,
    in tests, never does). A connection that is slow to open does not count."""
    address, port = row.get("NodeManagerAddress"), row.get("NodeManagerPort")
    if not address or not port:
        return False
    try:
        with socket.create_connection((str(address), int(port)), timeout=REACH_TIMEOUT):
            return False
    except ConnectionRefusedError:
        return True
    except OSError:
        return False


def _ray_nodes() -> list[dict[str, Any]]:
    import ray

    nodes: list[dict[str, Any]] = ray.nodes()  # type: ignore[no-untyped-call]
    return nodes
