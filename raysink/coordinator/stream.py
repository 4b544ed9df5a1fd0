"""The continuous stream's position, kept by the coordinator (``rt.stream()``).

Long-lived producers write the stream's *current* epoch. Every ``checkpoint_interval``
the driver ticks: the current epoch's members are fixed, each member's own
``BarrierInjector`` gets the epoch's barrier, and the stream moves on to the next epoch.
Each producer claims its pending barrier once, at its next batch boundary (or, idle, from
its poll), closes its part of the epoch and writes the next one. A producer that joins
(first poll, or after a restart) writes the current epoch from then on.

After an epoch failed, the stream *rewinds*: the epoch is written again from the last
committed one, every producer leaves (its next write raises ``StreamRewind``: it replays
its source from there and joins again).

Pure bookkeeping; the coordinator serves it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from raysink.coordinator.barrier import BarrierFlags, BarrierInjector, CheckpointBarrier

__all__ = ["StreamBook", "StreamPosition", "StreamTick"]


@dataclass(frozen=True, kw_only=True, slots=True)
class StreamPosition:
    """What a producer's poll learns: write ``(epoch, attempt)``; ``barrier``: close
    your part of ``barrier.epoch`` first (claimed once); ``rewinds``: how many times the
    stream rewound (a change means: replay from ``committed``); ``ended``: the stream
    was drained, nothing more is taken."""

    epoch: int
    attempt: int
    rewinds: int
    committed: int | None
    barrier: CheckpointBarrier | None = None
    barrier_attempt: int = 0  # the attempt of ``barrier.epoch``
    ended: bool = False


@dataclass(frozen=True, kw_only=True, slots=True)
class StreamTick:
    """An epoch whose members must now close it: commit it over them."""

    epoch: int
    attempt: int
    members: tuple[int, ...]
    checkpoint_id: int
    next_attempt: int = 0  # of the epoch after it, which the members write next
    drain: bool = False
    generation: int | None = None  # the coordinator's, for an epoch not opened first


@dataclass(kw_only=True, slots=True)
class _Member:
    injector: BarrierInjector = field(default_factory=BarrierInjector)
    epoch: int = 0  # the epoch the member writes (its barrier closes it)


class StreamBook:
    """The stream's current epoch, its members, and each member's pending barrier."""

    def __init__(self, epoch: int, attempt: int) -> None:
        self.epoch, self.attempt = epoch, attempt
        self.opened = epoch  # the epoch opened at the coordinator; the later ones are not
        self.rewinds = 0
        self.ended = False
        self._closing_attempt = attempt  # of the epoch ticked last, still being closed
        self._members: dict[int, _Member] = {}
        self._left: set[int] = set()  # feeds that left on purpose

    def poll(self, feed: int, committed: int | None) -> StreamPosition:
        """A member's poll (joining when it is not one): its pending barrier, claimed."""
        member = self._members.get(feed)
        if member is None and not self.ended and feed not in self._left:
            member = self._members[feed] = _Member(epoch=self.epoch)
        barrier, barrier_attempt = None, 0
        if member is not None:
            if member.injector.has_pending:
                barrier = member.injector.handle().poll(member.epoch)
            if barrier is not None:
                barrier_attempt = self._attempt_of(barrier.epoch)
                member.epoch = max(barrier.epoch + 1, self.epoch)
        epoch = self.epoch if member is None else member.epoch
        return StreamPosition(epoch=epoch, attempt=self._attempt_of(epoch),
                              rewinds=self.rewinds, committed=committed, barrier=barrier,
                              barrier_attempt=barrier_attempt,
                              ended=self.ended and (member is None or barrier is None))

    def position(self, committed: int | None) -> StreamPosition:
        """Where the stream is, for the driver (nobody joins)."""
        return StreamPosition(epoch=self.epoch, attempt=self.attempt, rewinds=self.rewinds,
                              committed=committed, ended=self.ended)

    def writing(self, feed: int) -> tuple[int, int] | None:
        """The ``(epoch, attempt)`` member ``feed`` writes now (its heartbeat's)."""
        member = self._members.get(feed)
        return None if member is None else (member.epoch, self._attempt_of(member.epoch))

    def _attempt_of(self, epoch: int) -> int:
        return self.attempt if epoch == self.epoch else self._closing_attempt

    def tick(self, checkpoint_id: int, next_attempt: int, generation: int, *,
             drain: bool = False) -> StreamTick | None:
        """Close the current epoch: its members get its barrier; the stream goes on with
        the next epoch (``next_attempt``), or, with ``drain``, ends. ``None`` when the
        epoch has no members (nothing to commit; the stream stays on it)."""
        members = tuple(sorted(f for f, m in self._members.items() if m.epoch == self.epoch))
        if not members:
            self.ended = self.ended or drain
            return None
        flags = BarrierFlags.DRAIN if drain else BarrierFlags.NONE
        for feed in members:
            self._members[feed].injector.trigger(checkpoint_id, flags)
        tick = StreamTick(epoch=self.epoch, attempt=self.attempt, members=members,
                          checkpoint_id=checkpoint_id, drain=drain, next_attempt=next_attempt,
                          generation=None if self.epoch == self.opened else generation)
        self._closing_attempt = self.attempt
        self.epoch, self.attempt = self.epoch + 1, next_attempt
        self.ended = drain
        return tick

    def rewind(self, epoch: int, attempt: int) -> None:
        """``epoch`` failed: write it again (``attempt``); every producer leaves and
        replays from the last committed epoch."""
        self.epoch, self.attempt = epoch, attempt
        self.opened = epoch
        self.rewinds += 1
        self._members.clear()

    def leave(self, feed: int) -> tuple[int, int] | None:
        """A producer left the stream on purpose (``feed.close()``, after closing what it
        wrote): it never joins again. Returns the ``(epoch, attempt)`` a tick gave it
        a barrier of that it did not claim: it wrote nothing there, and closes it empty."""
        self._left.add(feed)
        member = self._members.pop(feed, None)
        if member is None or not member.injector.has_pending:
            return None
        return member.epoch, self._attempt_of(member.epoch)
