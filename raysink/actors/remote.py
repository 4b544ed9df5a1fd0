"""The runtime's actor classes as Ray actor classes, made once per driver process.

Ray exports a class to the cluster once per job, but disassembles it again for each new
``ray.remote`` of it (about 60 ms of driver CPU per writer started, measured with 16
writers), so ``raysink.actors.lifecycle`` takes them from here. A writer's methods run in
concurrency groups: data (``write``, ``feed_barrier``), one barrier thread (``barrier``,
``seal``) and control (the rest: ``cancel``, ``drain``, ``ping``, ``status``).
"""

from __future__ import annotations

import functools
from typing import Any

from raysink.actors.standby import StandbyCoordinatorActor
from raysink.actors.writer import SinkWriterActor
from raysink.coordinator.coordinator import CoordinatorActor

__all__ = ["coordinator_class", "writer_class"]

_WRITER_GROUPS = {"data": 2, "barrier": 1, "control": 4}
_WRITER_METHOD_GROUPS = {"write": "data", "feed_barrier": "data", "barrier": "barrier",
                         "seal": "barrier"}
_WRITER_METHODS = ("write", "feed_barrier", "barrier", "seal", "cancel", "drain", "ping",
                   "status")


@functools.cache
def writer_class() -> Any:
    """``SinkWriterActor`` as a Ray actor class, with its concurrency groups."""
    import ray

    for method in _WRITER_METHODS:
        group = _WRITER_METHOD_GROUPS.get(method, "control")
        ray.method(concurrency_group=group)(getattr(SinkWriterActor, method))
    remote = ray.remote(concurrency_groups=_WRITER_GROUPS)  # type: ignore[call-overload]
    return remote(SinkWriterActor)


@functools.cache
def coordinator_class(standby: bool = False) -> Any:
    """``CoordinatorActor`` (``standby``: ``StandbyCoordinatorActor``) as a Ray actor class."""
    import ray

    return ray.remote(StandbyCoordinatorActor if standby else CoordinatorActor)
