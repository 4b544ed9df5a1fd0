"""Ending a runtime's actors in order (``rt.close()``).

``close_actors`` runs four steps: the continuous stream drains (its producers close their
last epoch; it commits), the decided epochs are committed, every writer gets the DRAIN
barrier (it drops what an undecided attempt staged and closes its sink writer), and the
coordinator pauses its sinks and closes its connections and the meta store. Then
``end_actors`` ends the processes, gives the runtime's lease up and closes the progress
line.

Close commits what was decided or raises: a close that returns has nothing decided left
behind. So the decided epochs are taken from a coordinator that says it has recovered
(before, it knows none of them: a coordinator Ray just restarted, or one retrying its
recovery while the meta store fails over), and they are committed before any writer is
told to close (a Kafka writer still holds a decided epoch's transaction until then). The
first two steps raise, after the other steps ran: the stream's last epoch not drained,
or a producer still owing the replay of rows a failed epoch dropped (``EpochFailedError``
naming its feed: ``StreamController.drain``); the coordinator not recovered within ``timeout``
(``RuntimeUnavailableError`` naming why) or stopped for good (its own error, such as
``FencedError`` when a second runtime of the name took the sink over); a decided epoch
still uncommitted (``SinkUnavailableError`` naming the sink, or
``RuntimeUnavailableError``; the epoch stays decided in the meta store and the runtime's
next start commits it). The last two are housekeeping: their failure is logged.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from raysink.driver.calls import result, results, short
from raysink.driver.epoch import EpochDriver
from raysink.driver.lease import LeaseKeeper
from raysink.driver.lifecycle import ActorSet
from raysink.driver.stream_controller import StreamController
from raysink.driver.stream_feed import stop_polls
from raysink.errors import RaySinkError, RuntimeUnavailableError, SinkUnavailableError
from raysink.progress import Progress
from raysink.protocol.barrier import BarrierFlags, CheckpointBarrier
from raysink.protocol.clients import Ask, CoordinatorClient
from raysink.protocol.messages import CommitWait
from raysink.protocol.results import RecoveryState

__all__ = ["close_actors", "end_actors"]

log = logging.getLogger(__name__)

_CLOSE_SECONDS = 30.0
_SLICE_SECONDS = 5.0
"""Longest single wait asked of the coordinator: each ask stays well inside its own
deadline, and a coordinator replaced meanwhile is asked again."""


def close_actors(name: str, actors: ActorSet, epochs: EpochDriver,
                 stream: StreamController | None, *, timeout: float, ask: Ask) -> None:
    """Drain the stream, commit the decided epochs, drain the writers and close the
    coordinator. Every step runs; then the first failure of the first two is raised (see
    the module docstring). The actors keep running (``stop``)."""
    def drain_stream() -> None:
        if stream is not None:
            stream.drain()

    def commit_decided() -> None:
        commit_decided_epochs(name, actors.coordinator_client, timeout=timeout, ask=ask)

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

    steps: tuple[tuple[str, Callable[[], None], bool], ...] = (
        ("draining the stream", drain_stream, True),
        ("committing the decided epochs", commit_decided, True),
        ("draining the writers", drain_writers, False),
        ("closing the coordinator", close_coordinator, False))
    failures: list[RaySinkError] = []
    for what, step, must in steps:
        try:
            step()
        except Exception as exc:
            log.warning("%s: close: %s failed: %s", name, what, short(exc))
            if must:
                failures.append(_typed(name, what, exc))
    if failures:
        raise failures[0]


def commit_decided_epochs(name: str, coordinator: CoordinatorClient, *, timeout: float,
                          ask: Ask) -> None:
    """Wait (up to ``timeout``) for the coordinator to have recovered, then (up to
    ``timeout`` again) for every epoch it holds decided to be committed; raise naming
    what is left otherwise."""
    state = _recovered(coordinator, time.monotonic() + timeout, ask)
    if not state.recovered:
        if state.fatal is not None:  # stopped for good (fenced, a target deleted): its
            # own error says why and what to do; a call that needs it recovered raises it
            ask("the coordinator's error", coordinator.committed_through())
        why = state.fatal or state.retrying or "still recovering"
        raise RuntimeUnavailableError(
            f"close: the coordinator has not recovered within {timeout:.0f}s ({why}), so "
            f"the epochs it holds decided are not known to be committed; the next start "
            f"of runtime {name!r} commits them", runtime=name)
    if not state.pending_epochs:
        return
    last = max(state.pending_epochs)
    deadline = time.monotonic() + timeout
    wait = CommitWait(committed=False)
    while not wait.committed and not wait.aborted:
        left = deadline - time.monotonic()
        wait = ask(f"committing decided epoch {last}",
                   coordinator.wait_committed(last, min(_SLICE_SECONDS, max(0.0, left))))
        if left <= _SLICE_SECONDS:
            break
    if wait.committed:
        return
    left_pending = ask("the decided epochs", coordinator.recovery(0.0)).pending_epochs
    epoch = min(left_pending, default=last)
    where = "; ".join(f"sink {s!r}: {e}" for s, e in sorted(wait.errors.items()))
    message = (f"close: epoch {epoch} is decided but not committed to every sink within "
               f"{timeout:.0f}s{f' ({where})' if where else ''}; it stays decided in the "
               f"meta store and the next start of runtime {name!r} commits it")
    if wait.errors:
        raise SinkUnavailableError(message, runtime=name, sink=min(wait.errors), epoch=epoch)
    raise RuntimeUnavailableError(message, runtime=name, epoch=epoch)


def _recovered(coordinator: CoordinatorClient, deadline: float, ask: Ask) -> RecoveryState:
    """The coordinator's recovery state once it recovered, stopped for good, or
    ``deadline`` passed."""
    while True:
        left = deadline - time.monotonic()
        state = ask("waiting for the coordinator's recovery",
                    coordinator.recovery(min(_SLICE_SECONDS, max(0.0, left))))
        if state.recovered or state.fatal is not None or left <= _SLICE_SECONDS:
            return state


def _typed(name: str, what: str, exc: Exception) -> RaySinkError:
    if isinstance(exc, RaySinkError):
        return exc
    error = RuntimeUnavailableError(f"close: {what} failed: {short(exc)}", runtime=name)
    error.__cause__ = exc
    return error


def end_actors(actors: ActorSet, lease: LeaseKeeper | None, progress: Progress | None) -> None:
    """End every actor (their names are free again), then give the lease up and close the
    progress line, even when ending the actors failed; the poll threads of this process's
    feeds of the runtime end too."""
    try:
        actors.stop()
    finally:
        stop_polls(actors.runtime)
        if lease is not None:
            lease.close()
        if progress is not None:
            progress.close()
