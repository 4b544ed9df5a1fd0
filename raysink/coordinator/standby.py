"""A coordinator started ahead of need, so that losing the coordinator costs no process start.

Starting a coordinator is a new Python process, its imports and the coordinator's own
start: 2-5 s measured on this (loaded) machine, most of the recovery from a lost
coordinator's node. When node labels pin the coordinator (``Placement(coordinator=...)``,
the deployment where its node may be lost while the job goes on) the runtime keeps one
standby: a ``StandbyCoordinatorActor`` idle on another node matching the labels (the same
node when no other matches), its modules imported, holding nothing of the runtime: it has
neither opened the meta store nor claimed the runtime. ``take_over`` runs a coordinator's
start in it (it opens the meta store and claims a new generation, so the lost coordinator
is fenced like any replaced one) and from then on it is the coordinator; the driver starts
a new standby behind it. A standby that is gone or does not answer is dropped, and a new
coordinator is started as before.

Where it runs: the class runs in the standby's process; the driver's ``ActorSet``
(``raysink.driver.lifecycle``) starts standbys and calls ``take_over``
(``raysink.driver.remote.take_over``).
"""

from __future__ import annotations

import asyncio
import logging
import os

from raysink.coordinator.coordinator import CoordinatorActor, CoordinatorConfig
from raysink.reports import ActorProcess

__all__ = ["StandbyCoordinatorActor"]

log = logging.getLogger(__name__)


class StandbyCoordinatorActor(CoordinatorActor):
    """A coordinator that starts only when told (``take_over``); until then it answers
    ``ping`` (with 0: no generation) and ``process`` (as a standby), nothing else."""

    def __init__(self, config: CoordinatorConfig) -> None:  # the coordinator's start: later
        import importlib

        importlib.import_module("raysink.coordinator.metastore")  # what a start imports
        if (config.metastore or "").startswith("postgres"):
            importlib.import_module("psycopg")
        self._standby_of = config.runtime
        self._taking: asyncio.Future[None] | None = None

    async def take_over(self, config: CoordinatorConfig) -> int:
        """Become the coordinator of ``config`` (the current layout): the coordinator's
        start, once however often it is asked. Returns the generation claimed."""
        if self._taking is None:
            log.info("standby coordinator of %s (pid %s) takes over", self._standby_of,
                     os.getpid())
            self._taking = asyncio.ensure_future(
                asyncio.to_thread(CoordinatorActor.__init__, self, config))
        await asyncio.shield(self._taking)
        return await super().ping()

    async def ping(self) -> int:
        if not self._took_over:
            return 0
        return await super().ping()

    async def process(self) -> ActorProcess:
        return ActorProcess.here("coordinator" if self._took_over else "standby")

    @property
    def _took_over(self) -> bool:
        return self._taking is not None and self._taking.done()

