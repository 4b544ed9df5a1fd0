"""The writer's mailbox, without Ray: epochs in flight, feeds, sequence order, poisoning.

A writer takes data from one or more *feeds* (the driver, or the producers of an epoch
handle or a stream), for one or more epochs at once: the data of epoch E+1 may arrive
while epoch E is still being written. Every data message carries ``(epoch, attempt,
feed, seq)``: Ray keeps call order only within one concurrency group, threaded actors
reorder calls even from one caller, and different callers have no order at all.

``Mailbox`` keeps a slot per ``(epoch, attempt)`` and, in it, a lane per feed that puts
the feed's messages back in ``seq`` order. Only the *current* slot (the oldest) is applied
to the sink writer; the slots after it wait (the sink writer writes one epoch at a time).
A feed's barrier gives its ``last_seq`` (how many messages it sent this writer). The seal
of an epoch names its feeds; a ``BarrierAligner`` over them (an aligned checkpoint
whose inputs are feeds) says when the last one's barrier arrived, and the epoch may
be pre-committed once aligned and every message before the barriers is applied.

The waiting messages are bounded in bytes (``max_bytes``), over every slot: an early
message that would go over is refused (``Verdict.FULL``) and its sender sends it again
later. A message the current slot needs next is always taken, so the mailbox always
drains.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from raysink.protocol.alignment import Aligned, BarrierAligner, Pass
from raysink.protocol.barrier import CheckpointBarrier

__all__ = ["EpochSlot", "FeedId", "FeedLane", "Mailbox", "Verdict"]

T = TypeVar("T")
Key = tuple[int, int]
FeedId = Hashable
"""A feed as a writer knows it: its id (0 is the driver; producers from 1)."""


class Verdict(str, enum.Enum):
    """What ``Mailbox.offer`` did with a message."""

    ACCEPTED = "accepted"
    DUPLICATE = "duplicate"
    STALE = "stale"
    FULL = "full"


@dataclass(kw_only=True, slots=True)
class FeedLane(Generic[T]):
    """One feed's messages within one epoch attempt."""

    next_seq: int = 0
    waiting: dict[int, tuple[T, int]] = field(default_factory=dict)
    claimed: int = 0  # messages taken for applying, not yet counted in next_seq
    last_seq: int | None = None  # the feed's barrier: its message count
    barrier: CheckpointBarrier | None = None

    @property
    def done(self) -> bool:
        return self.last_seq is not None and self.next_seq >= self.last_seq

    @property
    def complete(self) -> bool:
        """The barrier is here and every message before it is applied, being applied or
        waiting: nothing of the feed is still to come."""
        if self.last_seq is None:
            return False
        return all(seq in self.waiting
                   for seq in range(self.next_seq + self.claimed, self.last_seq))


@dataclass(kw_only=True, slots=True)
class EpochSlot(Generic[T]):
    """One ``(epoch, attempt)`` at one writer."""

    epoch: int
    attempt: int
    lanes: dict[FeedId, FeedLane[T]] = field(default_factory=dict)
    rows: int = 0
    schema: Any = None
    poison: BaseException | None = None
    cancelled: bool = False
    sealed: tuple[FeedId, ...] | None = None  # the feeds the epoch has, once sealed
    aligner: BarrierAligner | None = None
    aligned: bool = False

    def align(self, feed: FeedId, barrier: CheckpointBarrier) -> None:
        """Count ``feed``'s barrier in the alignment (once the epoch is sealed)."""
        if self.aligner is None or self.sealed is None or feed not in self.sealed:
            return
        action = self.aligner.on_barrier(self.sealed.index(feed), barrier)
        if isinstance(action, Aligned | Pass):
            self.aligned = True

    @property
    def key(self) -> Key:
        return self.epoch, self.attempt

    def waiting_for(self) -> list[FeedId]:
        """The sealed feeds whose barrier has not arrived yet (the writer's status)."""
        if self.sealed is None or self.aligned or self.aligner is None:
            return []
        arrived = self.aligner.blocked_inputs
        return [feed for index, feed in enumerate(self.sealed) if index not in arrived]

    def lane(self, feed: FeedId) -> FeedLane[T]:
        return self.lanes.setdefault(feed, FeedLane())

    def waiting_count(self) -> int:
        return sum(len(lane.waiting) for lane in self.lanes.values())

    def incomplete(self) -> list[FeedId]:
        """The sealed feeds whose barrier or messages are not all here. A seal comes only
        after each of its feeds closed, and a feed closes only once the writer took every
        message and the barrier: what is missing then went to a previous process of this
        writer (restarted since) and never comes."""
        if self.sealed is None or self.poison is not None or self.cancelled:
            return []
        return [feed for feed in self.sealed if not self.lane(feed).complete]

    def unsealed_senders(self) -> list[FeedId]:
        """Feeds that sent this attempt data but are not among its sealed feeds (a commit
        over a subset of the feeds handed out): their rows may already be in the sink
        writer, and a writer cannot take rows of one feed back out of an attempt."""
        if self.sealed is None:
            return []
        return [feed for feed, lane in self.lanes.items() if feed not in self.sealed
                and (lane.next_seq or lane.claimed or lane.waiting)]


class Mailbox(Generic[T]):
    """Sequencing of one writer's data messages; thread-safe.

    ``offer`` files a message; ``take_ready`` hands out, in order, the messages of the
    current slot that can be applied now; the caller applies them and calls ``applied``.
    ``wait_sealed`` blocks a seal until the slot is current and the feeds it names are
    done, or the slot is poisoned, cancelled or replaced, or the timeout passes.
    """

    def __init__(self, max_bytes: int | None = None) -> None:
        self._cond = threading.Condition()
        self._slots: dict[Key, EpochSlot[T]] = {}
        self._done: Key = (-1, -1)  # the newest attempt pre-committed or rolled back
        self._cancelled: dict[int, int] = {}  # per epoch, its newest attempt given up
        self._applying = False
        self._bytes = 0
        self.max_bytes = max_bytes

    # ------------------------------------------------------------------ state

    @property
    def current(self) -> EpochSlot[T] | None:
        """The slot applied now: the oldest one."""
        with self._cond:
            return self._current()

    def _current(self) -> EpochSlot[T] | None:
        return self._slots[min(self._slots)] if self._slots else None

    @property
    def waiting_bytes(self) -> int:
        return self._bytes

    def slots(self) -> list[EpochSlot[T]]:
        with self._cond:
            return [self._slots[k] for k in sorted(self._slots)]

    def depth(self) -> int:
        """Messages waiting in every slot. Under the lock: a message arriving meanwhile
        adds a lane, and counting over the lanes unlocked fails the caller."""
        with self._cond:
            return sum(slot.waiting_count() for slot in self._slots.values())

    def why_unready(self, key: Key) -> tuple[list[FeedId], list[FeedId]]:
        """For a slot that did not get ready: its sealed feeds whose data went to a
        previous process of this writer, and the feeds outside its seal that sent data
        (under the lock, like ``depth``)."""
        with self._cond:
            slot = self._slots.get(key)
            if slot is None:
                return [], []
            return slot.incomplete(), slot.unsealed_senders()

    def waiting_for(self) -> dict[str, list[FeedId]]:
        """Per ``"epoch/attempt"``, the sealed feeds whose barrier is not here (under the
        lock, like ``depth``)."""
        with self._cond:
            waiting = {f"{s.epoch}/{s.attempt}": s.waiting_for() for s in self._slots.values()}
        return {key: feeds for key, feeds in waiting.items() if feeds}

    def live_slot(self, epoch: int, attempt: int) -> EpochSlot[T] | None:
        """The slot of ``(epoch, attempt)`` while it is here and not cancelled; ``None``
        once the attempt was given up or replaced (its slot forgotten)."""
        with self._cond:
            slot = self._slots.get((epoch, attempt))
            return None if slot is None or slot.cancelled else slot

    def is_stale(self, epoch: int, attempt: int) -> bool:
        """At or below what is done, an attempt given up (a stream's rewind gives up an
        epoch after one it then writes again), or one a newer attempt replaced. Under
        the lock: a writer asks before it fetches a message, while its other threads add
        and drop slots."""
        with self._cond:
            key = (epoch, attempt)
            return key <= self._done or attempt <= self._cancelled.get(epoch, -1) or any(
                k[0] == epoch and k[1] > attempt for k in self._slots)

    def _slot(self, epoch: int, attempt: int) -> tuple[EpochSlot[T] | None, list[Key]]:
        """The slot of ``(epoch, attempt)``, made when new; an older attempt of the epoch
        it replaces is dropped and returned (its staging must be rolled back)."""
        if self.is_stale(epoch, attempt):
            return None, []
        replaced = [k for k in self._slots if k[0] == epoch and k[1] < attempt]
        for key in replaced:
            self._forget(key)
        slot = self._slots.get((epoch, attempt))
        if slot is None:
            slot = self._slots[(epoch, attempt)] = EpochSlot(epoch=epoch, attempt=attempt)
        return slot, replaced

    def _forget(self, key: Key) -> EpochSlot[T] | None:
        slot = self._slots.pop(key, None)
        if slot is not None:
            self._bytes -= sum(size for lane in slot.lanes.values()
                               for _, size in lane.waiting.values())
        self._cond.notify_all()
        return slot

    # ------------------------------------------------------------------ data

    def offer(self, epoch: int, attempt: int, feed: FeedId, seq: int, message: T,
              size: int = 0) -> tuple[Verdict, list[Key]]:
        """File a message; also returns the older attempts of its epoch it replaced."""
        with self._cond:
            slot, replaced = self._slot(epoch, attempt)
            if slot is None or slot.cancelled:
                return Verdict.STALE, replaced
            lane = slot.lane(feed)
            if seq < lane.next_seq or seq in lane.waiting:
                return Verdict.DUPLICATE, replaced
            needed = slot is self._current() and seq == lane.next_seq
            if not needed and self.max_bytes is not None and (
                    self._bytes + size > self.max_bytes):
                return Verdict.FULL, replaced
            lane.waiting[seq] = (message, size)
            self._bytes += size
            return Verdict.ACCEPTED, replaced

    def take_ready(self) -> tuple[Key, list[tuple[FeedId, T]]] | None:
        """Claim the in-order runs of the current slot's lanes that can be applied now
        (one claimant at a time; others get ``None`` and leave the work to it)."""
        with self._cond:
            slot = self._current()
            if slot is None or self._applying or slot.poison is not None:
                return None
            run: list[tuple[FeedId, T]] = []
            for feed, lane in slot.lanes.items():
                seq = lane.next_seq
                while seq in lane.waiting:
                    message, size = lane.waiting.pop(seq)
                    self._bytes -= size
                    run.append((feed, message))
                    seq += 1
                lane.claimed = seq - lane.next_seq
            if not run:
                return None
            self._applying = True
            return slot.key, run

    def applied(self, key: Key, feeds: Iterable[FeedId], rows: int) -> None:
        """The messages of ``feeds`` (one entry per message) were applied to ``key``."""
        with self._cond:
            self._applying = False
            slot = self._slots.get(key)
            if slot is not None:
                for feed in feeds:
                    lane = slot.lane(feed)
                    lane.next_seq += 1
                    lane.claimed = max(0, lane.claimed - 1)
                slot.rows += rows
            self._cond.notify_all()

    def close_feed(self, barrier: CheckpointBarrier, attempt: int, feed: FeedId,
                   last_seq: int) -> list[Key]:
        """A feed's barrier: it sent ``last_seq`` messages of ``(barrier.epoch, attempt)``.
        Again (a producer retried by Ray closes again): nothing changes."""
        with self._cond:
            slot, replaced = self._slot(barrier.epoch, attempt)
            if slot is not None:
                lane = slot.lane(feed)
                if lane.barrier is None:
                    lane.last_seq, lane.barrier = last_seq, barrier
                    slot.align(feed, barrier)
            self._cond.notify_all()
            return replaced

    def seal(self, epoch: int, attempt: int, feeds: Iterable[FeedId]) -> list[Key]:
        """The epoch has these feeds: align their barriers (those already here, and those
        to come). Returns the older attempts of the epoch this replaced."""
        with self._cond:
            slot, replaced = self._slot(epoch, attempt)
            if slot is not None and slot.sealed is None:
                slot.sealed = tuple(feeds)
                slot.aligner = BarrierAligner(max(1, len(slot.sealed)))
                slot.aligned = not slot.sealed
                for feed in slot.sealed:
                    barrier = slot.lane(feed).barrier
                    if barrier is not None:
                        slot.align(feed, barrier)
            self._cond.notify_all()
            return replaced

    # ------------------------------------------------------------------ end of an epoch

    def poison(self, key: Key, error: BaseException) -> None:
        with self._cond:
            slot = self._slots.get(key)
            if slot is not None:
                if slot.poison is None:
                    slot.poison = error
                self._bytes -= sum(size for lane in slot.lanes.values()
                                   for _, size in lane.waiting.values())
                for lane in slot.lanes.values():
                    lane.waiting.clear()
            self._cond.notify_all()

    def cancel(self, epoch: int, attempt: int) -> list[EpochSlot[T]]:
        """Give up ``(epoch, attempt)`` and older attempts of the epoch: returns their slots
        (the caller rolls back what the current one applied). Later messages are stale."""
        with self._cond:
            keys = [k for k in self._slots if k[0] == epoch and k[1] <= attempt]
            dropped = [s for k in keys if (s := self._forget(k)) is not None]
            self._cancelled[epoch] = max(attempt, self._cancelled.get(epoch, -1))
            return dropped

    def wait_sealed(self, epoch: int, attempt: int, timeout: float) -> str:
        """Block until the sealed ``(epoch, attempt)`` is the current slot, aligned, with
        every message before its feeds' barriers applied. Returns ``"ready"``,
        ``"poisoned"``, ``"cancelled"``, ``"stale"``, ``"timeout"``; at once ``"lost"``
        when a sealed feed's barrier or messages went to a previous process of this
        writer (``EpochSlot.incomplete``: waiting would only run into the timeout), or
        ``"unsealed"`` when a feed outside the seal sent data (``unsealed_senders``)."""
        key = (epoch, attempt)

        def state() -> str | None:
            slot = self._slots.get(key)
            if slot is None:
                return "stale" if self.is_stale(epoch, attempt) else None
            if slot.poison is not None:
                return "poisoned"
            if slot.cancelled:
                return "cancelled"
            if slot.incomplete():
                return "lost"
            if slot.unsealed_senders():
                return "unsealed"
            ready = (slot.aligned and slot is self._current() and not self._applying
                     and all(slot.lane(f).done for f in slot.sealed or ()))
            return "ready" if ready else None

        with self._cond:
            result = self._cond.wait_for(state, timeout)
            return result if result is not None else "timeout"

    def finish(self, epoch: int, attempt: int) -> EpochSlot[T] | None:
        """``(epoch, attempt)`` is pre-committed or rolled back: forget it; the next slot
        becomes current."""
        with self._cond:
            self._done = max(self._done, (epoch, attempt))
            for old in [e for e in self._cancelled if e < self._done[0]]:
                del self._cancelled[old]
            return self._forget((epoch, attempt))
