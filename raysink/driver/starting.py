"""Starting a runtime's actors (``rt.start()``), in the driver.

``start_actors`` runs these steps in order; when one fails, what the earlier ones started
is ended again and the lease given up, so a failed start leaves nothing running::

    check_metastore   the meta store is reachable and writable, and the sink set is what
                      it was (or changed on purpose: add_sinks, drop_sinks); refused here,
                      before any actor starts
    lease             one live driver per runtime (raysink.driver.lease)
    Sink.validate     each sink checks its target
    ActorSet.start    the coordinator and the writers, placed; each answers a ping
    recovery          the coordinator swept open attempts and checked the targets' markers
                      against the meta store: a deleted target or marker fails start()
"""

from __future__ import annotations

from collections.abc import Mapping

from raysink.coordinator.metastore.base import MetaStore
from raysink.driver.calls import ask
from raysink.driver.lease import LeaseKeeper
from raysink.driver.lifecycle import ActorSet
from raysink.driver.runtime_options import RuntimeOptions
from raysink.sinks.base import Sink

__all__ = ["START_SECONDS", "check_metastore", "start_actors"]

START_SECONDS = 300.0
"""How long ``start()`` waits at least for the actors to start and recover."""


def start_actors(name: str, sinks: Mapping[str, Sink], options: RuntimeOptions,
                 metastore: str) -> tuple[ActorSet, LeaseKeeper]:
    """Start runtime ``name``'s actors with its meta store at URL ``metastore`` (Ray is
    started first when it is not); returns them, recovered, and the lease this driver
    holds."""
    import ray

    if not ray.is_initialized():
        ray.init(namespace="raysink")
    lease = LeaseKeeper(check_metastore(name, metastore, sinks, options), name,
                        options.lease_timeout)
    actors: ActorSet | None = None
    try:
        lease.acquire()  # before anything starts: one driver at a time
        for sink in sinks.values():
            sink.validate()
        actors = options.actor_set(name, sinks, metastore, lease.holder)
        wait = max(options.commit_timeout, START_SECONDS)
        actors.start(timeout=wait)
        _await_recovery(actors, wait)
    except BaseException:
        if actors is not None:
            actors.stop()
        lease.close()
        raise
    return actors, lease


def _await_recovery(actors: ActorSet, timeout: float) -> None:
    """Wait until the coordinator recovered (open attempts swept, markers checked against
    the meta store); its errors are start()'s. ``epoch_source`` is the cheapest call that
    waits for it."""
    ask(actors.coordinator_client.epoch_source(), what="waiting for recovery",
        runtime=actors.runtime, heal=actors.heal, timeout=timeout)


def check_metastore(name: str, metastore: str, sinks: Mapping[str, Sink],
                    options: RuntimeOptions) -> MetaStore:
    """The meta store at URL ``metastore``, open: reachable and writable, and runtime
    ``name``'s sink set is what it was, or changed as ``options`` allow
    (``ConfigError`` naming the sinks otherwise)."""
    from raysink.coordinator.metastore import check_sink_set, open_metastore

    store = open_metastore(metastore, name)
    try:
        record = store.load(name)
        if record is not None:
            check_sink_set(name, record.sinks, {n: s.kind for n, s in sinks.items()},
                           options.add_sinks, options.drop_sinks)
    except BaseException:
        store.close()
        raise
    return store
