"""Barrier alignment for operators fed by several inputs.

``BarrierAligner`` is the aligned protocol every sink writer uses: when an input delivers
the barrier of checkpoint ``c``, the operator holds back that input's further events (they
belong after ``c``) and keeps processing the other inputs until each has delivered ``c``;
then the checkpoint is *aligned* and the writer pre-commits. Rules, per call of
``on_barrier(input_id, barrier)``:

- one input: every barrier passes at once (``Pass``);
- barrier ids from one input must strictly increase (a repeat is ``BarrierOrderError``);
- the first barrier of ``c`` starts aligning ``c`` (``Blocked``), the last one completes
  it (``Aligned``, every input released);
- a barrier of a newer checkpoint abandons the older alignment: its blocked inputs are
  released (``Blocked.released``) and the newer one starts;
- a barrier of a checkpoint already completed, cancelled or abandoned is stale (``Ignored``);
- a ``CANCEL`` barrier drops the alignment of its checkpoint (and of any older one) and
  releases its inputs (``Cancelled``); later barriers of that checkpoint are stale.

In raysink the inputs are *feeds*: the producers of an epoch (``raysink.writer.mailbox``
aligns each epoch's feeds at every writer). There is no unaligned fallback (snapshot the
in-flight events when alignment takes too long): it serves operators between
sources and sinks, which raysink does not have, and a sink must never go unaligned (its
committables must be at the sink when it pre-commits). A writer that waits too long for
a feed's barrier fails the attempt instead (``feed_timeout``, ``barrier_timeout``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeAlias, TypeVar

from raysink.errors import BarrierOrderError, ConfigError
from raysink.protocol.barrier import CheckpointBarrier

__all__ = [
    "AlignAction",
    "Aligned",
    "BarrierAligner",
    "BarrierOrderError",
    "Blocked",
    "Cancelled",
    "Ignored",
    "Pass",
]

T = TypeVar("T")





def _check_num_inputs(num_inputs: object) -> int:
    if isinstance(num_inputs, bool) or not isinstance(num_inputs, int) or num_inputs < 1:
        raise ConfigError(f"num_inputs must be a positive int, got {num_inputs!r}")
    return num_inputs


def _check_input(input_id: object, num_inputs: int) -> int:
    if isinstance(input_id, bool) or not isinstance(input_id, int):
        raise ConfigError(f"input_id must be an int, got {input_id!r}")
    if not 0 <= input_id < num_inputs:
        raise ConfigError(f"input_id must be in [0, {num_inputs}), got {input_id!r}")
    return input_id


def _merge(
    current: CheckpointBarrier, incoming: CheckpointBarrier, input_id: int
) -> CheckpointBarrier:
    """The barrier of one checkpoint as seen from two inputs: same epoch, flags or-ed."""
    if incoming.epoch != current.epoch:
        raise BarrierOrderError(
            f"input {input_id} sent checkpoint {incoming.checkpoint_id} with epoch "
            f"{incoming.epoch}, other inputs sent epoch {current.epoch}",
            input_id=input_id,
            checkpoint_id=incoming.checkpoint_id,
            epoch=incoming.epoch,
        )
    return current.with_flags(incoming.flags)


# --- aligned ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Pass:
    """Single input: no alignment needed, act on ``barrier`` and forward it now."""

    barrier: CheckpointBarrier


@dataclass(frozen=True, slots=True)
class Blocked:
    """``input_id`` delivered ``barrier`` (flags merged so far): hold back its further
    events until ``Aligned`` or ``Cancelled``. If this barrier abandoned an older
    alignment, ``released`` names the inputs that were blocked for it: process what was
    held back from them first (then ``input_id`` is blocked again)."""

    input_id: int
    barrier: CheckpointBarrier
    released: frozenset[int] = frozenset()


@dataclass(frozen=True, slots=True)
class Aligned:
    """Every input delivered ``barrier``: snapshot / pre-commit now, then release all inputs."""

    barrier: CheckpointBarrier


@dataclass(frozen=True, slots=True)
class Cancelled:
    """The checkpoint of cancel barrier ``barrier`` is dropped: release ``released`` (process
    what was held back from them) and forward the cancel downstream once."""

    barrier: CheckpointBarrier
    released: frozenset[int] = frozenset()


@dataclass(frozen=True, slots=True)
class Ignored:
    """A barrier of a checkpoint already completed, cancelled or abandoned: nothing to do,
    keep processing the input."""

    barrier: CheckpointBarrier


AlignAction: TypeAlias = Pass | Blocked | Aligned | Cancelled | Ignored


class BarrierAligner:
    """Aligned barrier tracking for an operator fed by ``num_inputs`` inputs (ids
    ``0 .. num_inputs - 1``). Not thread-safe: one writer's event loop owns it."""

    def __init__(self, num_inputs: int) -> None:
        self._num_inputs = _check_num_inputs(num_inputs)
        self._last_seen: list[int | None] = []
        self._settled: int | None = None  # highest id completed, cancelled or abandoned
        self._current: CheckpointBarrier | None = None
        self._arrived: set[int] = set()
        self._clear()

    def _clear(self) -> None:
        self._last_seen = [None] * self._num_inputs
        self._settled = None
        self._current = None
        self._arrived = set()

    @property
    def num_inputs(self) -> int:
        """How many inputs feed the operator."""
        return self._num_inputs

    @property
    def pending(self) -> CheckpointBarrier | None:
        """The barrier being aligned (flags merged so far), or ``None``."""
        return self._current

    @property
    def blocked_inputs(self) -> frozenset[int]:
        """Inputs that delivered the pending barrier and whose events are held back."""
        return frozenset(self._arrived)

    def on_barrier(self, input_id: int, barrier: CheckpointBarrier) -> AlignAction:
        """Record that ``input_id`` delivered ``barrier``; return what the operator must do.

        Raises ``BarrierOrderError`` when the input repeats or regresses a barrier id, or
        its epoch disagrees with another input's for the same checkpoint.
        """
        _check_input(input_id, self._num_inputs)
        if barrier.is_cancel:
            return self._on_cancel(input_id, barrier)
        self._advance(input_id, barrier)
        if self._num_inputs == 1:
            self._settled = barrier.checkpoint_id
            return Pass(barrier)
        if self._is_stale(barrier.checkpoint_id):
            return Ignored(barrier)
        released = frozenset[int]()
        if self._current is not None and barrier.checkpoint_id > self._current.checkpoint_id:
            released = self._abandon()
        return self._arrive(input_id, barrier, released)

    def _advance(self, input_id: int, barrier: CheckpointBarrier) -> None:
        """Check that ``input_id``'s barrier ids strictly increase, and record this one."""
        last = self._last_seen[input_id]
        if last is not None and barrier.checkpoint_id <= last:
            raise BarrierOrderError(
                f"input {input_id} sent a barrier for checkpoint {barrier.checkpoint_id} "
                f"after one for checkpoint {last}; barrier ids from one input must increase",
                input_id=input_id,
                checkpoint_id=barrier.checkpoint_id,
                epoch=barrier.epoch,
            )
        self._last_seen[input_id] = barrier.checkpoint_id

    def _is_stale(self, checkpoint_id: int) -> bool:
        if self._settled is not None and checkpoint_id <= self._settled:
            return True
        return self._current is not None and checkpoint_id < self._current.checkpoint_id

    def _abandon(self) -> frozenset[int]:
        """Drop the alignment in progress; return the inputs it had blocked."""
        assert self._current is not None
        released = frozenset(self._arrived)
        self._settled = self._current.checkpoint_id
        self._current = None
        self._arrived.clear()
        return released

    def _arrive(
        self, input_id: int, barrier: CheckpointBarrier, released: frozenset[int]
    ) -> AlignAction:
        """Count ``input_id`` in the alignment of ``barrier``, starting it if needed."""
        if self._current is None:
            self._current = barrier
        else:
            self._current = _merge(self._current, barrier, input_id)
        self._arrived.add(input_id)
        if len(self._arrived) < self._num_inputs:
            return Blocked(input_id, self._current, released)
        aligned = self._current
        self._abandon()
        return Aligned(aligned)

    def _on_cancel(self, input_id: int, barrier: CheckpointBarrier) -> AlignAction:
        """A cancel drops its checkpoint's alignment (and any older one) exactly once."""
        cid = barrier.checkpoint_id
        last = self._last_seen[input_id]
        self._last_seen[input_id] = cid if last is None else max(last, cid)
        if self._num_inputs == 1:
            return Pass(barrier)
        if self._current is not None and cid >= self._current.checkpoint_id:
            released = self._abandon()
            self._settled = cid
            return Cancelled(barrier, released)
        if self._is_stale(cid):
            return Ignored(barrier)
        self._settled = cid
        return Cancelled(barrier)
