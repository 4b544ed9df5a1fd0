"""The writer's mailbox state, without Ray: epoch, attempt, sequence order, poisoning.

Ray keeps call order only within one concurrency group, and threaded actors reorder calls
even from one caller, so every data message carries ``(epoch, attempt, seq)``. ``Mailbox``
puts them back in ``seq`` order: a message arriving early waits in a small reorder buffer;
duplicates and messages of a stale attempt are dropped. A barrier carries the epoch's
``last_seq`` (the number of data messages) and may pre-commit only once every message
before it is applied.

The reorder buffer is bounded in bytes (``max_bytes``): an early message that would take
it over the bound is refused (``Verdict.FULL``) and its sender sends it again later. The
message the writer needs next is always taken, so a full buffer always drains.
"""

from __future__ import annotations

import enum
import threading
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

__all__ = ["EpochSlot", "Mailbox", "Verdict"]

T = TypeVar("T")


class Verdict(str, enum.Enum):
    """What ``Mailbox.offer`` did with a message."""

    ACCEPTED = "accepted"
    DUPLICATE = "duplicate"
    STALE = "stale"
    FULL = "full"


@dataclass(kw_only=True, slots=True)
class EpochSlot(Generic[T]):
    """The current ``(epoch, attempt)`` of one writer and its reorder buffer."""

    epoch: int
    attempt: int
    next_seq: int = 0
    waiting: dict[int, T] = field(default_factory=dict)
    sizes: dict[int, int] = field(default_factory=dict)
    waiting_bytes: int = 0
    rows: int = 0
    schema: Any = None
    poison: BaseException | None = None
    cancelled: bool = False

    def clear_waiting(self) -> None:
        self.waiting.clear()
        self.sizes.clear()
        self.waiting_bytes = 0


class Mailbox(Generic[T]):
    """Sequencing of one writer's data messages; thread-safe.

    ``offer`` files a message; ``ready`` hands out, in order, the messages that can be
    applied now; the caller applies them and calls ``applied``. ``wait_applied`` blocks a
    barrier until ``last_seq`` messages are applied, the epoch is poisoned or cancelled,
    or the timeout passes.
    """

    def __init__(self, max_bytes: int | None = None) -> None:
        self._cond = threading.Condition()
        self._slot: EpochSlot[T] | None = None
        self._applying = False
        self.max_bytes = max_bytes

    @property
    def slot(self) -> EpochSlot[T] | None:
        return self._slot

    def begin(self, epoch: int, attempt: int) -> EpochSlot[T] | None:
        """Make ``(epoch, attempt)`` current; returns the slot it replaced, if any."""
        with self._cond:
            old = self._slot
            if old is not None and (old.epoch, old.attempt) == (epoch, attempt):
                return None
            self._slot = EpochSlot(epoch=epoch, attempt=attempt)
            self._cond.notify_all()
            return old

    def is_stale(self, epoch: int, attempt: int) -> bool:
        slot = self._slot
        return slot is not None and (epoch, attempt) < (slot.epoch, slot.attempt)

    def offer(self, epoch: int, attempt: int, seq: int, message: T, size: int = 0) -> Verdict:
        """File ``message`` (``size`` bytes). An early one that would take the reorder
        buffer over ``max_bytes`` is refused with ``FULL``; the next one is always taken."""
        with self._cond:
            slot = self._slot
            if slot is None or (epoch, attempt) != (slot.epoch, slot.attempt):
                return Verdict.STALE
            if seq < slot.next_seq or seq in slot.waiting:
                return Verdict.DUPLICATE
            early = seq != slot.next_seq
            if early and self.max_bytes is not None and (
                    slot.waiting_bytes + size > self.max_bytes):
                return Verdict.FULL
            slot.waiting[seq] = message
            slot.sizes[seq] = size
            slot.waiting_bytes += size
            return Verdict.ACCEPTED

    def take_ready(self) -> list[tuple[int, T]]:
        """Claim the in-order run of messages that can be applied now (one claimant at a
        time; others get an empty list and leave the work to the claimant)."""
        with self._cond:
            slot = self._slot
            if slot is None or self._applying:
                return []
            run: list[tuple[int, T]] = []
            seq = slot.next_seq
            while seq in slot.waiting:
                run.append((seq, slot.waiting.pop(seq)))
                slot.waiting_bytes -= slot.sizes.pop(seq, 0)
                seq += 1
            if run:
                self._applying = True
            return run

    def applied(self, epoch: int, attempt: int, count: int, rows: int) -> None:
        """``count`` messages of ``(epoch, attempt)`` were applied, holding ``rows`` rows."""
        with self._cond:
            self._applying = False
            slot = self._slot
            if slot is not None and (slot.epoch, slot.attempt) == (epoch, attempt):
                slot.next_seq += count
                slot.rows += rows
            self._cond.notify_all()

    def poison(self, epoch: int, attempt: int, error: BaseException) -> None:
        with self._cond:
            slot = self._slot
            if slot is not None and (slot.epoch, slot.attempt) == (epoch, attempt):
                if slot.poison is None:
                    slot.poison = error
                slot.clear_waiting()
            self._cond.notify_all()

    def cancel(self, epoch: int, attempt: int) -> None:
        with self._cond:
            slot = self._slot
            if slot is not None and (slot.epoch, slot.attempt) <= (epoch, attempt):
                slot.cancelled = True
                slot.clear_waiting()
            self._cond.notify_all()

    def wait_applied(self, epoch: int, attempt: int, last_seq: int, timeout: float) -> str:
        """Block until the epoch's ``last_seq`` messages are applied.

        Returns ``"ready"``, ``"poisoned"``, ``"cancelled"``, ``"stale"`` or ``"timeout"``.
        """
        with self._cond:
            def state() -> str | None:
                slot = self._slot
                if slot is None or (slot.epoch, slot.attempt) != (epoch, attempt):
                    return "stale"
                if slot.poison is not None:
                    return "poisoned"
                if slot.cancelled:
                    return "cancelled"
                if slot.next_seq >= last_seq and not self._applying:
                    return "ready"
                return None

            result = self._cond.wait_for(state, timeout)
            return result if result is not None else "timeout"

    def drop(self, epoch: int, attempt: int) -> EpochSlot[T] | None:
        """Forget ``(epoch, attempt)`` (after its ack, or a rollback) if it is current; a
        newer attempt that replaced it is left alone."""
        with self._cond:
            old = self._slot
            if old is None or (old.epoch, old.attempt) != (epoch, attempt):
                return None
            self._slot = None
            self._cond.notify_all()
            return old
