"""A multi-node Ray on this machine: the cluster test layer's and ``bench/node_loss.py``'s.

``LocalCluster`` wraps ``ray.cluster_utils.Cluster``: a head raylet (the driver's node,
custom resource ``head``) and worker raylets with small object stores, each worker
offering one ``spark_slot`` (so RayDP puts at most one executor on it, see
``SPARK_CONFIGS``). ``remove(node)`` takes a worker away without grace (its raylet and
every process on it are SIGKILLed), the closest this machine gets to a lost machine;
``add_worker()`` brings a fresh one.

No other process on the machine may join this cluster by accident (a bare
``ray.init()`` reads the address file the head writes): the cluster lives under a private
``RAY_TMPDIR`` for its whole life, so its address file is never the machine's default one,
and ``close()`` (always run it: a ``with`` block or ``finally``) ends every raylet and
removes the directory.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Mapping
from types import TracebackType
from typing import Any

__all__ = ["SPARK_CONFIGS", "LocalCluster"]

log = logging.getLogger(__name__)

_MIB = 1024 * 1024

SPARK_CONFIGS = {
    # RayDP's app master on the head (the driver's node: losing it ends the job anyway),
    # one executor per worker node (each worker offers one spark_slot)
    "spark.ray.raydp_spark_master.actor.resource.head": "1",
    "spark.ray.raydp_spark_executor.actor.resource.spark_slot": "1",
    "spark.ui.showConsoleProgress": "false",
    "spark.ui.enabled": "false",
    "spark.sql.shuffle.partitions": "4",
}
"""``init_spark(configs=...)`` for a RayDP session on a ``LocalCluster``."""


class LocalCluster:
    """A head and ``workers`` worker raylets on this machine; ``ray.init`` connects to it.

    ``labels`` (per worker, in order) are node labels; every worker has ``worker_cpus``
    logical CPUs and one ``spark_slot``."""

    def __init__(self, workers: int = 3, *, worker_cpus: int = 2, head_cpus: int = 2,
                 labels: list[Mapping[str, str]] | None = None,
                 object_store_mib: int = 100) -> None:
        self._want = workers
        self._worker_cpus = worker_cpus
        self._head_cpus = head_cpus
        self._labels = list(labels or [])
        self._store = object_store_mib * _MIB
        self._cluster: Any = None
        self._nodes: dict[str, Any] = {}
        self._tmp: str | None = None
        self._saved_tmpdir: str | None = None

    # ------------------------------------------------------------------ life

    def __enter__(self) -> LocalCluster:
        self.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.close()

    def start(self) -> None:
        import ray
        from ray.cluster_utils import Cluster

        if ray.is_initialized():
            if "raysink.spark.session" in sys.modules:  # the Spark layer's shared session
                from raysink.spark import stop_spark

                stop_spark()
            ray.shutdown()  # a single-node Ray of this process (another test layer's)
        self._tmp = tempfile.mkdtemp(prefix="rsc-", dir="/tmp")  # short: socket paths
        self._saved_tmpdir = os.environ.get("RAY_TMPDIR")
        os.environ["RAY_TMPDIR"] = self._tmp
        try:
            self._cluster = Cluster(initialize_head=True, head_node_args={
                "num_cpus": self._head_cpus, "resources": {"head": 100},
                "object_store_memory": self._store, "include_dashboard": False})
            for index in range(self._want):
                labels = self._labels[index] if index < len(self._labels) else None
                self.add_worker(labels=labels)
            ray.init(address=self._cluster.address, log_to_driver=False)
            self._cluster.wait_for_nodes()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """End the driver's connection and every raylet; idempotent."""
        import ray

        try:
            ray.shutdown()
        finally:
            if self._cluster is not None:
                self._cluster.shutdown()
                self._cluster = None
            self._nodes.clear()
            if self._saved_tmpdir is None:
                os.environ.pop("RAY_TMPDIR", None)
            else:
                os.environ["RAY_TMPDIR"] = self._saved_tmpdir
            if self._tmp is not None:
                shutil.rmtree(self._tmp, ignore_errors=True)
                self._tmp = None

    # ------------------------------------------------------------------ nodes

    @property
    def head(self) -> str:
        return str(self._cluster.head_node.node_id)

    def workers(self) -> list[str]:
        """Worker node ids, oldest first."""
        return list(self._nodes)

    def add_worker(self, *, labels: Mapping[str, str] | None = None,
                   resources: Mapping[str, float] | None = None) -> str:
        """A new worker raylet; returns its node id once the cluster lists it."""
        args: dict[str, Any] = {"num_cpus": self._worker_cpus,
                                "object_store_memory": self._store,
                                "resources": {"spark_slot": 1, **dict(resources or {})}}
        if labels:
            args["labels"] = dict(labels)
        node = self._cluster.add_node(**args)
        self._nodes[str(node.node_id)] = node
        return str(node.node_id)

    def ensure_workers(self, count: int) -> None:
        while len(self._nodes) < count:
            self.add_worker()

    def remove(self, node_id: str) -> float:
        """SIGKILL every process of worker ``node_id`` (no grace); the seconds it took."""
        node = self._nodes.pop(node_id)
        started = time.monotonic()
        self._cluster.remove_node(node, allow_graceful=False)
        log.info("removed node %s", node_id[:8])
        return time.monotonic() - started

    @staticmethod
    def node_of_actor(name: str, namespace: str | None = None) -> str:
        """The node the live actor named ``name`` runs on."""
        import ray

        handle = ray.get_actor(name, namespace=namespace)
        state = ray._private.state.actors(actor_id=handle._actor_id.hex())  # type: ignore[attr-defined]
        return str(state["Address"]["NodeID"])
