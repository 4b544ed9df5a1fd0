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

``UnalignedCheckpointer`` is for non-sink operators only (the router). It aligns like the
above but, when alignment takes longer than ``alignment_timeout``, falls back to an
unaligned snapshot that carries the in-flight events. Sinks never checkpoint unaligned:
committables must be at the sink on commit. See its docstring for the event lifecycle.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeAlias, TypeVar

from raysink.coordinator.barrier import BarrierFlags, CheckpointBarrier
from raysink.errors import BarrierOrderError, ConfigError

__all__ = [
    "AlignAction",
    "Aligned",
    "AlignedSnapshot",
    "BarrierAligner",
    "BarrierOrderError",
    "Blocked",
    "Cancelled",
    "CheckpointCancelled",
    "Ignored",
    "InFlightData",
    "LateBarriersDone",
    "Pass",
    "UnalignedAction",
    "UnalignedCheckpointer",
    "UnalignedConfig",
    "UnalignedSnapshot",
    "Waiting",
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

    def is_blocked(self, input_id: int) -> bool:
        """Whether events from ``input_id`` must be held back now."""
        return _check_input(input_id, self._num_inputs) in self._arrived

    def reset(self) -> frozenset[int]:
        """Forget everything (as after a restart); return the inputs that were blocked."""
        released = frozenset(self._arrived)
        self._clear()
        return released

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


# --- unaligned fallback ----------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class UnalignedConfig:
    """When an operator may give up aligning.

    ``enabled``: fall back to unaligned after ``alignment_timeout`` seconds of aligning;
    ``force``: go unaligned at the first barrier (needs ``enabled``; never for a sink);
    ``max_inflight_bytes``: bound on the events the checkpointer keeps per checkpoint.
    """

    enabled: bool = True
    alignment_timeout: float = 10.0
    max_inflight_bytes: int = 256 * 1024 * 1024
    force: bool = False

    def __post_init__(self) -> None:
        timeout = self.alignment_timeout
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
            raise ConfigError(f"alignment_timeout must be seconds, got {timeout!r}")
        if math.isnan(timeout) or timeout < 0:
            raise ConfigError(f"alignment_timeout must be >= 0 seconds, got {timeout!r}")
        limit = self.max_inflight_bytes
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
            raise ConfigError(f"max_inflight_bytes must be an int >= 0, got {limit!r}")
        if self.force and not self.enabled:
            raise ConfigError("force=True needs enabled=True: got enabled=False")


@dataclass(frozen=True, slots=True)
class InFlightData(Generic[T]):
    """Events of one input that precede its barrier and are not in the snapshot, in
    arrival order, with their total size."""

    input_id: int
    events: tuple[T, ...]
    size_bytes: int


@dataclass(frozen=True, slots=True)
class Waiting:
    """The checkpoint of ``barrier`` is still waiting for barriers; ``arrived`` have theirs."""

    barrier: CheckpointBarrier
    arrived: frozenset[int]


@dataclass(frozen=True, slots=True)
class AlignedSnapshot(Generic[T]):
    """Every barrier arrived in time: apply ``drained`` (they precede their barriers),
    then snapshot at ``barrier``."""

    barrier: CheckpointBarrier
    drained: tuple[InFlightData[T], ...] = ()


@dataclass(frozen=True, slots=True)
class UnalignedSnapshot(Generic[T]):
    """Snapshot now at ``barrier`` (``UNALIGNED`` set), store ``inflight`` with it as the
    channel state to replay on recovery, then apply ``inflight`` and forward the barrier.
    ``was_threshold_triggered`` is False when ``force`` made it unaligned."""

    barrier: CheckpointBarrier
    inflight: tuple[InFlightData[T], ...]
    total_size_bytes: int
    was_threshold_triggered: bool


@dataclass(frozen=True, slots=True)
class LateBarriersDone(Generic[T]):
    """The last late barrier of unaligned ``barrier`` arrived: append ``inflight`` (events
    recorded since the snapshot) to the checkpoint's channel state. ``overflowed`` means an
    event was refused, so the channel state is incomplete: do not recover from it."""

    barrier: CheckpointBarrier
    inflight: tuple[InFlightData[T], ...]
    overflowed: bool = False


@dataclass(frozen=True, slots=True)
class CheckpointCancelled(Generic[T]):
    """The checkpoint of cancel ``barrier`` is dropped: apply ``drained`` and forward."""

    barrier: CheckpointBarrier
    drained: tuple[InFlightData[T], ...] = ()


UnalignedAction: TypeAlias = (
    Waiting
    | AlignedSnapshot[T]
    | UnalignedSnapshot[T]
    | LateBarriersDone[T]
    | CheckpointCancelled[T]
)


@dataclass(slots=True)
class _Cycle(Generic[T]):
    """One checkpoint in progress: aligning (``unaligned`` False) or, after the unaligned
    snapshot, waiting for late barriers."""

    barrier: CheckpointBarrier
    started_at: float
    arrived: set[int]
    unaligned: bool = False
    overflowed: bool = False
    buffers: dict[int, list[T]] = field(default_factory=dict)
    buffered_bytes: int = 0
    sizes: dict[int, int] = field(default_factory=dict)

    def take(self) -> tuple[InFlightData[T], ...]:
        """Hand over and clear the buffered events, per input in input order."""
        taken = tuple(
            InFlightData(i, tuple(self.buffers[i]), self.sizes[i]) for i in sorted(self.buffers)
        )
        self.buffers.clear()
        self.sizes.clear()
        self.buffered_bytes = 0
        return taken


class UnalignedCheckpointer(Generic[T]):
    """Aligns barriers like ``BarrierAligner`` but may fall back to an unaligned snapshot.

    Lifecycle of one checkpoint (one at a time: hold back a newer barrier until
    ``is_checkpointing`` is False):

    1. The first barrier starts aligning (``Waiting``). Inputs that delivered the barrier
       are held back by the caller. Events that arrive from the other inputs and that the
       caller has not applied yet (its backlog) may be parked with ``buffer_event``.
    2. All barriers in time: ``AlignedSnapshot`` returns the parked events to apply before
       snapshotting.
    3. ``check_timeout`` (or a barrier) past ``alignment_timeout``: ``UnalignedSnapshot``
       carries the parked events as in-flight data and the barrier with ``UNALIGNED`` set.
       From then on, events from inputs still owing their barrier are applied by the caller
       and also recorded with ``buffer_event``; the last late barrier returns them
       (``LateBarriersDone``) and the cycle ends.

    ``buffer_event`` returns False when the event would exceed ``max_inflight_bytes``; it
    is not kept (the caller keeps it and the rest of that input behind it). Before the
    snapshot this pins the checkpoint to aligned mode: the seed answered with an aligned
    snapshot before all barriers arrived, which would mislabel a cut that is not aligned,
    so here the checkpoint simply keeps waiting. A sink never goes unaligned: with a
    timeout it keeps waiting aligned, and ``force`` on a sink is a ``ConfigError``.
    """

    def __init__(
        self,
        num_inputs: int,
        config: UnalignedConfig | None = None,
        *,
        is_sink: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._num_inputs = _check_num_inputs(num_inputs)
        self._config = config if config is not None else UnalignedConfig()
        if is_sink and self._config.force:
            raise ConfigError(
                "a sink never checkpoints unaligned (committables must be at the sink on "
                "commit): got force=True for a sink; drop force"
            )
        self._is_sink = is_sink
        self._clock = clock
        self._cycle: _Cycle[T] | None = None

    @property
    def config(self) -> UnalignedConfig:
        """The configuration in force."""
        return self._config

    @property
    def is_sink(self) -> bool:
        """Whether the operator is a sink (never unaligned)."""
        return self._is_sink

    @property
    def is_checkpointing(self) -> bool:
        """Whether a checkpoint is in progress (aligning or waiting for late barriers)."""
        return self._cycle is not None

    @property
    def is_unaligned(self) -> bool:
        """Whether the checkpoint in progress has taken its unaligned snapshot."""
        return self._cycle is not None and self._cycle.unaligned

    @property
    def aligned_count(self) -> int:
        """How many inputs delivered the barrier of the checkpoint in progress."""
        return 0 if self._cycle is None else len(self._cycle.arrived)

    @property
    def buffered_bytes(self) -> int:
        """Bytes of events kept for the checkpoint in progress."""
        return 0 if self._cycle is None else self._cycle.buffered_bytes

    def on_barrier(
        self, input_id: int, barrier: CheckpointBarrier, now: float | None = None
    ) -> UnalignedAction[T]:
        """Record that ``input_id`` delivered ``barrier``; ``now`` defaults to the clock.

        Raises ``BarrierOrderError`` for a repeated barrier, or a barrier of another
        checkpoint while one is in progress (a cancel is always accepted).
        """
        _check_input(input_id, self._num_inputs)
        now = self._clock() if now is None else now
        if barrier.is_cancel:
            return self._cancel(barrier)
        if self._cycle is None:
            return self._start(input_id, barrier, now)
        cycle = self._cycle
        self._check_same(cycle, input_id, barrier)
        if not cycle.unaligned:
            cycle.barrier = _merge(cycle.barrier, barrier, input_id)
        cycle.arrived.add(input_id)
        if cycle.unaligned:
            return self._late(cycle)
        if len(cycle.arrived) == self._num_inputs:
            return self._finish_aligned(cycle)
        if self._timed_out(cycle, now):
            return self._go_unaligned(cycle, was_threshold_triggered=True)
        return Waiting(cycle.barrier, frozenset(cycle.arrived))

    def check_timeout(self, now: float | None = None) -> UnalignedSnapshot[T] | None:
        """Take the unaligned snapshot if aligning has lasted ``alignment_timeout`` seconds
        (``now`` defaults to the clock); else ``None``. Never for a sink."""
        cycle = self._cycle
        if cycle is None or cycle.unaligned:
            return None
        if not self._timed_out(cycle, self._clock() if now is None else now):
            return None
        return self._go_unaligned(cycle, was_threshold_triggered=True)

    def buffer_event(self, input_id: int, event: T, size_bytes: int) -> bool:
        """Keep ``event`` from ``input_id``, an input still owing its barrier.

        Returns False, keeping nothing, when ``size_bytes`` more would exceed
        ``max_inflight_bytes``. Raises ``BarrierOrderError`` when no checkpoint is in
        progress or ``input_id`` already delivered its barrier (its events follow it).
        """
        _check_input(input_id, self._num_inputs)
        if isinstance(size_bytes, bool) or not isinstance(size_bytes, int) or size_bytes < 0:
            raise ConfigError(f"size_bytes must be an int >= 0, got {size_bytes!r}")
        cycle = self._require_open(input_id)
        if cycle.buffered_bytes + size_bytes > self._config.max_inflight_bytes:
            cycle.overflowed = True
            return False
        cycle.buffers.setdefault(input_id, []).append(event)
        cycle.sizes[input_id] = cycle.sizes.get(input_id, 0) + size_bytes
        cycle.buffered_bytes += size_bytes
        return True

    def reset(self) -> None:
        """Drop the checkpoint in progress and everything kept for it."""
        self._cycle = None

    def _require_open(self, input_id: int) -> _Cycle[T]:
        cycle = self._cycle
        if cycle is None:
            raise BarrierOrderError(
                f"no checkpoint in progress: events from input {input_id} are not in flight",
                input_id=input_id,
            )
        if input_id in cycle.arrived:
            raise BarrierOrderError(
                f"input {input_id} already delivered checkpoint "
                f"{cycle.barrier.checkpoint_id}: its events follow the barrier",
                input_id=input_id,
                checkpoint_id=cycle.barrier.checkpoint_id,
            )
        return cycle

    def _check_same(self, cycle: _Cycle[T], input_id: int, barrier: CheckpointBarrier) -> None:
        cid = cycle.barrier.checkpoint_id
        if barrier.checkpoint_id != cid:
            raise BarrierOrderError(
                f"input {input_id} sent checkpoint {barrier.checkpoint_id} while checkpoint "
                f"{cid} is in progress; hold it back until that one completes",
                input_id=input_id,
                checkpoint_id=barrier.checkpoint_id,
            )
        if input_id in cycle.arrived:
            raise BarrierOrderError(
                f"input {input_id} sent checkpoint {cid} twice",
                input_id=input_id,
                checkpoint_id=cid,
            )

    def _start(self, input_id: int, barrier: CheckpointBarrier, now: float) -> UnalignedAction[T]:
        if self._num_inputs == 1:
            return AlignedSnapshot(barrier)
        cycle = _Cycle[T](barrier, now, {input_id})
        self._cycle = cycle
        if self._config.force:
            return self._go_unaligned(cycle, was_threshold_triggered=False)
        return Waiting(barrier, frozenset(cycle.arrived))

    def _timed_out(self, cycle: _Cycle[T], now: float) -> bool:
        if self._is_sink or not self._config.enabled or cycle.overflowed:
            return False
        return now - cycle.started_at >= self._config.alignment_timeout

    def _finish_aligned(self, cycle: _Cycle[T]) -> AlignedSnapshot[T]:
        self._cycle = None
        return AlignedSnapshot(cycle.barrier, cycle.take())

    def _go_unaligned(
        self, cycle: _Cycle[T], *, was_threshold_triggered: bool
    ) -> UnalignedSnapshot[T]:
        total = cycle.buffered_bytes
        inflight = cycle.take()
        cycle.unaligned = True
        cycle.barrier = cycle.barrier.with_flags(BarrierFlags.UNALIGNED)
        return UnalignedSnapshot(cycle.barrier, inflight, total, was_threshold_triggered)

    def _late(self, cycle: _Cycle[T]) -> UnalignedAction[T]:
        if len(cycle.arrived) < self._num_inputs:
            return Waiting(cycle.barrier, frozenset(cycle.arrived))
        self._cycle = None
        return LateBarriersDone(cycle.barrier, cycle.take(), cycle.overflowed)

    def _cancel(self, barrier: CheckpointBarrier) -> CheckpointCancelled[T]:
        cycle = self._cycle
        if cycle is None or cycle.barrier.checkpoint_id != barrier.checkpoint_id:
            return CheckpointCancelled(barrier)
        self._cycle = None
        drained = () if cycle.unaligned else cycle.take()
        return CheckpointCancelled(barrier, drained)
