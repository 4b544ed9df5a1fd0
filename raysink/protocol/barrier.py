"""Checkpoint barriers, the messages that carry them, and the injector that publishes them.

A barrier ``CheckpointBarrier(checkpoint_id, epoch, flags)`` flows through the stream with
the events: everything before it belongs to the checkpoint, everything after it to the
next. ``BarrierFlags`` modify what a barrier asks for:

- ``DRAIN``: the last barrier before shutdown: a writer closes its sink writer after it
  (on an epoch's barrier: after pre-committing it; alone, from ``rt.close()``: at once,
  dropping what an undecided attempt staged);
- ``CANCEL``: the attempt was abandoned: a writer stops waiting for it and drops what it
  staged (what the runtime sends every writer after an attempt failed);

Stream messages that carry events, watermarks and barriers in one channel are not
used: data and barriers travel as separate actor calls, ordered by sequence numbers
(``raysink.writer.mailbox``), and raysink has no event-time operators.

``BarrierInjector.trigger()`` publishes a pending barrier; every ``BarrierPollHandle`` from
the same injector may ``poll()`` it, and exactly one poll across all handles claims it. A
later ``trigger()`` supersedes a barrier nobody has claimed yet (only the latest checkpoint
matters). Polling when nothing is pending is one attribute read, no lock. Injector and
handles share memory: they work across threads of one process, not across Ray actors.
"""

from __future__ import annotations

import enum
import threading
from dataclasses import dataclass

from raysink.errors import ConfigError

__all__ = [
    "MAX_ID",
    "BarrierFlags",
    "BarrierInjector",
    "BarrierPollHandle",
    "CheckpointBarrier",
]


#: Largest checkpoint id or epoch: both must fit a signed 64-bit integer in the meta store.
MAX_ID = 2**63 - 1


class BarrierFlags(enum.IntFlag):
    """What a barrier asks of the operators it passes (bits may be combined)."""

    NONE = 0
    DRAIN = 2
    CANCEL = 4
    # no UNALIGNED flag: sinks never checkpoint unaligned (see alignment.py)


_ALL_FLAGS = BarrierFlags.DRAIN | BarrierFlags.CANCEL


def _check_id(name: str, value: object) -> int:
    """Return ``value`` if it is an int in ``[0, MAX_ID]``, else raise ``ConfigError``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an int, got {value!r}")
    if not 0 <= value <= MAX_ID:
        raise ConfigError(f"{name} must be between 0 and 2**63 - 1, got {value!r}")
    return value


def _check_flags(value: object) -> BarrierFlags:
    """Return ``value`` as ``BarrierFlags`` if it holds only known bits, else raise."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"barrier flags must be BarrierFlags or an int, got {value!r}")
    if value < 0 or value & ~int(_ALL_FLAGS):
        raise ConfigError(
            f"barrier flags hold unknown bits: got {value!r}, known bits are {int(_ALL_FLAGS)}"
        )
    return BarrierFlags(value)


@dataclass(frozen=True, slots=True)
class CheckpointBarrier:
    """A checkpoint barrier: ``checkpoint_id`` names the checkpoint, ``epoch`` is the
    monotonic epoch it closes, ``flags`` what it asks for. Both numbers are in
    ``[0, 2**63 - 1]``; 0 is a valid id. Immutable, hashable and picklable."""

    checkpoint_id: int
    epoch: int
    flags: BarrierFlags = BarrierFlags.NONE

    def __post_init__(self) -> None:
        _check_id("checkpoint_id", self.checkpoint_id)
        _check_id("epoch", self.epoch)
        object.__setattr__(self, "flags", _check_flags(self.flags))

    @property
    def is_drain(self) -> bool:
        """Whether this is the last barrier before shutdown."""
        return bool(self.flags & BarrierFlags.DRAIN)

    @property
    def is_cancel(self) -> bool:
        """Whether this barrier cancels the in-progress checkpoint with its id."""
        return bool(self.flags & BarrierFlags.CANCEL)

    def with_flags(self, flags: BarrierFlags) -> CheckpointBarrier:
        """A copy with ``flags`` added to this barrier's flags."""
        return CheckpointBarrier(self.checkpoint_id, self.epoch, self.flags | flags)


class _Slot:
    """State shared by an injector and its handles.

    ``pending`` is ``None`` or ``(checkpoint_id, flags)``; it is written only under
    ``lock``. Readers may look at it without the lock (an attribute read is atomic in
    CPython) but claim it only under the lock.
    """

    __slots__ = ("lock", "pending", "triggers")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pending: tuple[int, BarrierFlags] | None = None
        self.triggers = 0


class BarrierInjector:
    """Publishes checkpoint barriers to the sources polling its handles.

    Thread-safe. ``trigger`` replaces any pending, unclaimed barrier; ``epoch`` counts the
    triggers so far. Not picklable (it holds a lock): keep it in one process.
    """

    __slots__ = ("_slot",)

    def __init__(self) -> None:
        self._slot = _Slot()

    def trigger(self, checkpoint_id: int, flags: BarrierFlags = BarrierFlags.NONE) -> None:
        """Publish a barrier for ``checkpoint_id``; the next poll on any handle claims it.

        Raises ``ConfigError`` for a negative or non-int id or unknown flag bits.
        """
        command = (_check_id("checkpoint_id", checkpoint_id), _check_flags(flags))
        with self._slot.lock:
            self._slot.pending = command
            self._slot.triggers += 1

    @property
    def epoch(self) -> int:
        """How many barriers have been triggered (claimed or not)."""
        return self._slot.triggers

    @property
    def has_pending(self) -> bool:
        """Whether a triggered barrier is waiting to be claimed."""
        return self._slot.pending is not None

    def handle(self) -> BarrierPollHandle:
        """A new handle for a source to poll; all handles share this injector's barrier."""
        return BarrierPollHandle(self._slot)


class BarrierPollHandle:
    """A source's view of a ``BarrierInjector``; cheap to poll on every loop iteration."""

    __slots__ = ("_slot",)

    def __init__(self, slot: _Slot) -> None:
        self._slot = slot

    def poll(self, epoch: int) -> CheckpointBarrier | None:
        """Claim the pending barrier, stamped with the caller's ``epoch``.

        Returns ``None`` when nothing is pending or another poll claimed it first; each
        triggered barrier is returned by at most one poll across all handles. The fast path
        (nothing pending) takes no lock.
        """
        if self._slot.pending is None:
            return None
        return self._claim(epoch)

    def _claim(self, epoch: int) -> CheckpointBarrier | None:
        """Slow path: take the pending barrier under the lock, if it is still there."""
        _check_id("epoch", epoch)
        with self._slot.lock:
            command, self._slot.pending = self._slot.pending, None
        if command is None:
            return None
        checkpoint_id, flags = command
        return CheckpointBarrier(checkpoint_id, epoch, flags)
