"""Typed calls to the runtime's actors: ``CoordinatorClient`` and ``WriterClient``.

Every process that talks to an actor goes through these (the driver, producers' feeds,
writers reporting to the coordinator), so each call names a real method and mypy checks
its arguments and its answer. A method returns a ``Call[T]``: the call, not sent yet.
``send()`` submits it and returns Ray's object ref; the driver's ``calls.result`` and
``calls.ask`` send it and wait, re-raising raysink errors as themselves (``ask`` sends
it again to a replaced actor: a client looks its actor up at every send).

::

    coordinator = CoordinatorClient.of(handle)     # or CoordinatorClient(lambda: handle)
    opened: OpenedEpoch = result(coordinator.open_epoch(None, timeout=60.0))
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

if TYPE_CHECKING:
    from raysink.coordinator.coordinator import CoordinatorConfig
    from raysink.coordinator.producers import FeedsState
    from raysink.coordinator.stream_state import Owed, StreamPosition, StreamState, StreamTick
    from raysink.protocol.barrier import CheckpointBarrier
    from raysink.protocol.messages import (
        BarrierAck,
        CommitRequest,
        CommitWait,
        DrainReport,
        OpenedEpoch,
    )
    from raysink.protocol.results import EpochSource, RecoveryState, Resolution, WriterLayout
    from raysink.reports import ActorProcess, RuntimeStatus
    from raysink.sinks._maintenance import MaintenanceReport
    from raysink.sinks.base import Held

__all__ = ["NAMESPACE", "Ask", "Call", "CoordinatorClient", "WriterClient", "answer"]

R = TypeVar("R")

NAMESPACE = "raysink"
"""The Ray namespace of every actor of every runtime."""


def answer(sent: Any, timeout: float) -> Any:
    """The answer of a call already sent (``Call.send()``'s ref), a raysink error raised
    in the actor re-raised as itself (not wrapped in Ray's ``RayTaskError``): for the
    actors' own calls to each other (the driver's ``calls.result`` and ``calls.ask`` add
    its deadlines and retries)."""
    import ray
    from ray.exceptions import RayTaskError

    from raysink.errors import RaySinkError

    try:
        return ray.get(sent, timeout=timeout)
    except RayTaskError as exc:
        cause = getattr(exc, "cause", None)
        if isinstance(cause, RaySinkError):
            raise cause from None
        raise


class Call(Generic[R]):
    """One actor call answering ``R``, not sent yet; ``send()`` may be called again (a
    retry goes to the actor the client finds then)."""

    __slots__ = ("_send",)

    def __init__(self, send: Callable[[], Any]) -> None:
        self._send = send

    def send(self) -> Any:
        """Submit the call; Ray's object ref of its answer."""
        return self._send()


class Ask(Protocol):
    """Sends a call and waits for its answer, again while its actor restarts (the
    driver's ``calls.ask`` with the runtime's deadline); ``what`` names it in errors."""

    def __call__(self, what: str, call: Call[R]) -> R: ...


@dataclass(frozen=True, slots=True)
class CoordinatorClient:
    """The coordinator actor's calls. ``actor`` returns its current handle."""

    actor: Callable[[], Any]

    @classmethod
    def of(cls, handle: Any) -> CoordinatorClient:
        return cls(lambda: handle)

    # the driver's epochs ---------------------------------------------------------------
    def ping(self) -> Call[int]:
        return Call(lambda: self.actor().ping.remote())

    def take_over(self, config: CoordinatorConfig) -> Call[int]:
        """A standby becomes the coordinator of ``config``; the generation it claimed."""
        return Call(lambda: self.actor().take_over.remote(config))

    def open_epoch(self, requested: int | None, timeout: float) -> Call[OpenedEpoch]:
        return Call(lambda: self.actor().open_epoch.remote(requested, timeout))

    def commit_epoch(self, epoch: int, attempt: int, requests: list[CommitRequest],
                     timeout: float, generation: int | None = None) -> Call[CommitWait]:
        return Call(lambda: self.actor().commit_epoch.remote(epoch, attempt, requests,
                                                             timeout, generation))

    def wait_committed(self, epoch: int, timeout: float,
                       attempt: int | None = None) -> Call[CommitWait]:
        return Call(lambda: self.actor().wait_committed.remote(epoch, timeout, attempt))

    def resolve(self, epoch: int, attempt: int | None = None) -> Call[Resolution]:
        return Call(lambda: self.actor().resolve.remote(epoch, attempt))

    def committed_through(self) -> Call[int | None]:
        return Call(lambda: self.actor().committed_through.remote())

    def set_layout(self, writers: int) -> Call[WriterLayout]:
        return Call(lambda: self.actor().set_layout.remote(writers))

    def status(self) -> Call[RuntimeStatus]:
        return Call(lambda: self.actor().status.remote())

    def earlier_committed(self, sink: str, epoch: int, wait: float) -> Call[RuntimeStatus]:
        return Call(lambda: self.actor().earlier_committed.remote(sink, epoch, wait))

    def maintain(self, sink: str | None, timeout: float) -> Call[list[MaintenanceReport]]:
        """A full maintenance pass of ``sink`` (every sink maintained: ``None``)."""
        return Call(lambda: self.actor().maintain.remote(sink, timeout))

    def recovery(self, timeout: float) -> Call[RecoveryState]:
        """Whether it has recovered, waiting up to ``timeout`` seconds for it."""
        return Call(lambda: self.actor().recovery.remote(timeout))

    def process(self) -> Call[ActorProcess]:
        """Where it runs (a standby's too: it is a coordinator not started yet)."""
        return Call(lambda: self.actor().process.remote())

    def close(self) -> Call[None]:
        return Call(lambda: self.actor().close.remote())

    # the epoch source (Structured Streaming) -------------------------------------------
    def epoch_source(self) -> Call[EpochSource | None]:
        return Call(lambda: self.actor().epoch_source.remote())

    def check_alignment(self, numbering: str, epoch_offset: int | None) -> Call[None]:
        return Call(lambda: self.actor().check_alignment.remote(numbering, epoch_offset))

    def bind_source(self, source: EpochSource) -> Call[None]:
        return Call(lambda: self.actor().bind_source.remote(source))

    # producers' feeds ------------------------------------------------------------------
    def feed_alive(self, epoch: int, attempt: int, feed: int) -> Call[None]:
        return Call(lambda: self.actor().feed_alive.remote(epoch, attempt, feed))

    def feed_closed(self, epoch: int, attempt: int, feed: int,
                    counts: Mapping[int, int]) -> Call[None]:
        return Call(lambda: self.actor().feed_closed.remote(epoch, attempt, feed,
                                                            dict(counts)))

    def feed_failed(self, epoch: int, attempt: int, feed: int, reason: str) -> Call[None]:
        return Call(lambda: self.actor().feed_failed.remote(epoch, attempt, feed, reason))

    def wait_feeds(self, epoch: int, attempt: int, feeds: list[int], timeout: float,
                   lease: float) -> Call[FeedsState]:
        return Call(lambda: self.actor().wait_feeds.remote(epoch, attempt, feeds, timeout,
                                                           lease))

    # the continuous stream -------------------------------------------------------------
    def stream_start(self, timeout: float) -> Call[StreamPosition]:
        return Call(lambda: self.actor().stream_start.remote(timeout))

    def stream_tick(self, checkpoint_id: int, drain: bool,
                    lease: float = 0.0) -> Call[StreamTick | None]:
        return Call(lambda: self.actor().stream_tick.remote(checkpoint_id, drain, lease))

    def stream_owed(self, lease: float) -> Call[Owed]:
        return Call(lambda: self.actor().stream_owed.remote(lease))

    def stream_rewind(self, epoch: int, timeout: float, state: StreamState | None = None,
                      writers: Mapping[str, Sequence[Any]] | None = None
                      ) -> Call[StreamState]:
        return Call(lambda: self.actor().stream_rewind.remote(epoch, timeout, state, writers))

    def stream_poll(self, feed: int, joining: bool = False,
                    applied_rewinds: int | None = None,
                    route: int | None = None, wrote: int | None = None,
                    seen: int | None = None) -> Call[StreamPosition | None]:
        return Call(lambda: self.actor().stream_poll.remote(feed, joining, applied_rewinds,
                                                            route, wrote, seen))

    def stream_leave(self, feed: int) -> Call[None]:
        return Call(lambda: self.actor().stream_leave.remote(feed))

    # writers ---------------------------------------------------------------------------
    def writer_health(self, sink: str, writer_id: int, error: str | None) -> Call[None]:
        return Call(lambda: self.actor().writer_health.remote(sink, writer_id, error))


@dataclass(frozen=True, slots=True)
class WriterClient:
    """One writer actor's calls."""

    actor: Any

    @classmethod
    def named(cls, name: str) -> WriterClient:
        """The writer actor of Ray name ``name`` (``ValueError`` when there is none)."""
        import ray

        return cls(ray.get_actor(name, namespace=NAMESPACE))

    def write(self, epoch: int, attempt: int, seq: int, refs: Sequence[Any],
              feed: Any = 0) -> Call[int]:
        return Call(lambda: self.actor.write.remote(epoch, attempt, seq, refs, feed))

    def feed_barrier(self, barrier: CheckpointBarrier, attempt: int, feed: Any,
                     last_seq: int) -> Call[None]:
        return Call(lambda: self.actor.feed_barrier.remote(barrier, attempt, feed, last_seq))

    def barrier(self, barrier: CheckpointBarrier, attempt: int, last_seq: int,
                committed_through: int | None = None) -> Call[BarrierAck]:
        return Call(lambda: self.actor.barrier.remote(barrier, attempt, last_seq,
                                                      committed_through))

    def seal(self, barrier: CheckpointBarrier, attempt: int, feeds: Sequence[Any],
             committed_through: int | None = None) -> Call[BarrierAck]:
        return Call(lambda: self.actor.seal.remote(barrier, attempt, feeds,
                                                   committed_through))

    def cancel(self, barrier: CheckpointBarrier, attempt: int) -> Call[None]:
        return Call(lambda: self.actor.cancel.remote(barrier, attempt))

    def drain(self, barrier: CheckpointBarrier) -> Call[DrainReport]:
        return Call(lambda: self.actor.drain.remote(barrier))

    def finish(self, epoch: int, attempt: int, commit: bool) -> Call[Held]:
        return Call(lambda: self.actor.finish.remote(epoch, attempt, commit))

    def ping(self) -> Call[int]:
        return Call(lambda: self.actor.ping.remote())

    def process(self) -> Call[ActorProcess]:
        """Where it runs, and its mailbox's state."""
        return Call(lambda: self.actor.process.remote())
