"""Ending a runtime's actors in order (``rt.close()``).

``close_actors`` runs four steps, each logged and skipped past when it fails: the
continuous stream drains (its producers close their last epoch; it commits), the epochs
still outstanding at the coordinator finish or stay durably decided, every writer gets
the DRAIN barrier (it drops what an undecided attempt staged and closes its sink writer),
and the coordinator pauses its sinks and closes its connections and the meta store.
Then ``end_actors`` ends the processes, gives the runtime's lease up and closes the
progress line.
"""

from __future__ import annotations

import logging

from raysink.driver.calls import result, results, short
from raysink.driver.epoch import EpochDriver
from raysink.driver.lease import LeaseKeeper
from raysink.driver.lifecycle import ActorSet
from raysink.driver.stream_controller import StreamController
from raysink.progress import Progress
from raysink.protocol.barrier import BarrierFlags, CheckpointBarrier
from raysink.protocol.clients import Ask

__all__ = ["close_actors", "end_actors"]

log = logging.getLogger(__name__)

_CLOSE_SECONDS = 30.0


def close_actors(name: str, actors: ActorSet, epochs: EpochDriver,
                 stream: StreamController | None, *, timeout: float, ask: Ask) -> None:
    """Drain the stream, the outstanding epochs, the writers and the coordinator; a step
    that fails is logged and the rest still run. The actors keep running (``stop``)."""
    def drain_stream() -> None:
        if stream is not None:
            stream.drain()

    def drain_outstanding() -> None:
        coordinator = actors.coordinator_client
        pending = ask("status", coordinator.status()).pending_epochs
        if pending:
            ask("waiting for outstanding epochs",
                coordinator.wait_committed(max(pending), timeout))

    def drain_writers() -> None:
        # a writer Ray is restarting is waited for first (a call sent meanwhile would fail)
        actors.await_writers(actors.starting_writers(), timeout=timeout)
        barrier = CheckpointBarrier(epochs.next_checkpoint(), 0, BarrierFlags.DRAIN)
        reports = results((w.drain(barrier) for w in actors.writer_clients()), timeout=timeout)
        swept = [(r.sink, r.writer, r.swept) for r in reports if r.swept is not None]
        if swept:
            log.info("%s: drained; undecided attempts dropped: %s", name, swept)

    def close_coordinator() -> None:
        result(actors.coordinator_client.close(), timeout=_CLOSE_SECONDS)

    steps = (("draining the stream", drain_stream),
             ("finishing outstanding epochs", drain_outstanding),
             ("draining the writers", drain_writers),
             ("closing the coordinator", close_coordinator))
    for what, step in steps:
        try:
            step()
        except Exception as exc:
            log.warning("%s: close: %s failed: %s", name, what, short(exc))



def end_actors(actors: ActorSet, lease: LeaseKeeper | None, progress: Progress | None) -> None:
    """End every actor (their names are free again), then give the lease up and close the
    progress line, even when ending the actors failed."""
    try:
        actors.stop()
    finally:
        if lease is not None:
            lease.close()
        if progress is not None:
            progress.close()
