"""BarrierAligner and UnalignedCheckpointer (cases after LaminarDB's unaligned.rs tests)."""

from __future__ import annotations

import pickle
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from raysink.coordinator.alignment import (
    AlignAction,
    Aligned,
    AlignedSnapshot,
    BarrierAligner,
    BarrierOrderError,
    Blocked,
    Cancelled,
    CheckpointCancelled,
    Ignored,
    InFlightData,
    LateBarriersDone,
    Pass,
    UnalignedCheckpointer,
    UnalignedConfig,
    UnalignedSnapshot,
    Waiting,
)
from raysink.coordinator.barrier import BarrierFlags, CheckpointBarrier
from raysink.errors import ConfigError

F = BarrierFlags


def b(checkpoint_id: int, flags: BarrierFlags = F.NONE) -> CheckpointBarrier:
    """Barrier of ``checkpoint_id`` with epoch = id (what the driver does)."""
    return CheckpointBarrier(checkpoint_id, checkpoint_id, flags)


def cancel(checkpoint_id: int) -> CheckpointBarrier:
    return b(checkpoint_id, F.CANCEL)


# --- BarrierAligner --------------------------------------------------------------------

Step = tuple[int, CheckpointBarrier, AlignAction]

ALIGNER_CASES: list[tuple[int, list[Step]]] = [
    # one input: every barrier passes at once, cancels too
    (1, [(0, b(1), Pass(b(1))), (0, b(2), Pass(b(2))), (0, cancel(3), Pass(cancel(3)))]),
    # checkpoint 0 is a real checkpoint
    (2, [(0, b(0), Blocked(0, b(0))), (1, b(0), Aligned(b(0)))]),
    # three inputs align in any order
    (
        3,
        [
            (2, b(1), Blocked(2, b(1))),
            (0, b(1), Blocked(0, b(1))),
            (1, b(1), Aligned(b(1))),
            (1, b(2), Blocked(1, b(2))),
        ],
    ),
    # a newer barrier from the same input abandons the older alignment; late old ones are stale
    (
        2,
        [
            (0, b(1), Blocked(0, b(1))),
            (0, b(2), Blocked(0, b(2), frozenset({0}))),
            (1, b(1), Ignored(b(1))),
            (1, b(2), Aligned(b(2))),
        ],
    ),
    # a newer barrier from another input abandons the older alignment too
    (
        3,
        [
            (0, b(1), Blocked(0, b(1))),
            (1, b(1), Blocked(1, b(1))),
            (2, b(4), Blocked(2, b(4), frozenset({0, 1}))),
            (0, b(4), Blocked(0, b(4))),
            (1, b(4), Aligned(b(4))),
        ],
    ),
    # a barrier older than the one aligning is stale, even if never seen before
    (2, [(0, b(5), Blocked(0, b(5))), (1, b(3), Ignored(b(3))), (1, b(5), Aligned(b(5)))]),
    # CANCEL of the aligning checkpoint releases its inputs, is forwarded once, and makes
    # the remaining barriers and cancels of that checkpoint stale
    (
        3,
        [
            (0, b(1), Blocked(0, b(1))),
            (1, cancel(1), Cancelled(cancel(1), frozenset({0}))),
            (2, b(1), Ignored(b(1))),
            (0, cancel(1), Ignored(cancel(1))),
            (2, cancel(1), Ignored(cancel(1))),
            (0, b(2), Blocked(0, b(2))),
            (1, b(2), Blocked(1, b(2))),
            (2, b(2), Aligned(b(2))),
        ],
    ),
    # CANCEL with nothing in progress is forwarded once and pre-empts that checkpoint
    (
        2,
        [
            (0, cancel(1), Cancelled(cancel(1))),
            (1, cancel(1), Ignored(cancel(1))),
            (1, b(2), Blocked(1, b(2))),
            (0, b(2), Aligned(b(2))),
        ],
    ),
    # CANCEL of a newer checkpoint also drops the older alignment
    (
        2,
        [
            (0, b(1), Blocked(0, b(1))),
            (1, cancel(2), Cancelled(cancel(2), frozenset({0}))),
            (0, b(3), Blocked(0, b(3))),
            (1, b(3), Aligned(b(3))),
        ],
    ),
    # CANCEL of a checkpoint already aligned changes nothing
    (
        2,
        [
            (0, b(1), Blocked(0, b(1))),
            (1, b(1), Aligned(b(1))),
            (0, cancel(1), Ignored(cancel(1))),
        ],
    ),
    # flags of one checkpoint are or-ed across inputs
    (
        2,
        [
            (0, b(1, F.UNALIGNED), Blocked(0, b(1, F.UNALIGNED))),
            (1, b(1, F.DRAIN), Aligned(b(1, F.UNALIGNED | F.DRAIN))),
        ],
    ),
]


@pytest.mark.parametrize(("num_inputs", "steps"), ALIGNER_CASES)
def test_aligner_scenarios(num_inputs: int, steps: list[Step]) -> None:
    aligner = BarrierAligner(num_inputs)
    for input_id, barrier, expected in steps:
        assert aligner.on_barrier(input_id, barrier) == expected, (input_id, barrier)


def test_blocked_inputs_follow_the_alignment() -> None:
    aligner = BarrierAligner(3)
    assert aligner.pending is None and aligner.blocked_inputs == frozenset()
    aligner.on_barrier(1, b(1))
    assert aligner.is_blocked(1) and not aligner.is_blocked(0)
    assert aligner.pending == b(1)
    aligner.on_barrier(0, b(1))
    assert aligner.blocked_inputs == frozenset({0, 1})
    aligner.on_barrier(2, b(1))
    assert aligner.blocked_inputs == frozenset() and aligner.pending is None


@pytest.mark.parametrize(
    ("num_inputs", "steps"),
    [
        (2, [(0, b(1)), (0, b(1))]),  # the same barrier twice while aligning
        (2, [(0, b(1)), (1, b(1)), (0, b(1))]),  # the same barrier after aligning
        (2, [(0, b(2)), (1, b(2)), (0, b(1))]),  # an input's ids go backwards
        (1, [(0, b(3)), (0, b(3))]),  # duplicates are errors on a single input too
        (2, [(0, cancel(1)), (0, b(1))]),  # a barrier after its own cancel on one input
        (2, [(0, CheckpointBarrier(1, 1)), (1, CheckpointBarrier(1, 2))]),  # epochs disagree
    ],
)
def test_aligner_protocol_errors(
    num_inputs: int, steps: list[tuple[int, CheckpointBarrier]]
) -> None:
    aligner = BarrierAligner(num_inputs)
    *ok, (bad_input, bad_barrier) = steps
    for input_id, barrier in ok:
        aligner.on_barrier(input_id, barrier)
    with pytest.raises(BarrierOrderError) as info:
        aligner.on_barrier(bad_input, bad_barrier)
    assert isinstance(info.value, ValueError)
    assert info.value.input_id == bad_input
    assert info.value.checkpoint_id == bad_barrier.checkpoint_id


@pytest.mark.parametrize(
    ("num_inputs", "input_id"),
    [(0, 0), (-1, 0), (2, 2), (2, -1), (True, 0)],  # bad sizes, out-of-range inputs
)
def test_aligner_argument_errors(num_inputs: Any, input_id: Any) -> None:
    with pytest.raises(ConfigError):
        BarrierAligner(num_inputs).on_barrier(input_id, b(1))


def test_reset_releases_and_forgets() -> None:
    aligner = BarrierAligner(2)
    aligner.on_barrier(0, b(5))
    assert aligner.reset() == frozenset({0})
    assert aligner.pending is None and not aligner.is_blocked(0)
    # forgotten history: the same id may come again (a restart replays from scratch)
    assert aligner.on_barrier(0, b(5)) == Blocked(0, b(5))


def test_order_error_pickles_with_fields() -> None:
    error = BarrierOrderError("dup", input_id=3, checkpoint_id=7, epoch=7)
    clone = pickle.loads(pickle.dumps(error))
    assert (clone.input_id, clone.checkpoint_id, clone.epoch) == (3, 7, 7)
    assert str(clone) == str(error)


@st.composite
def interleavings(draw: st.DrawFn) -> tuple[int, list[tuple[int, int]]]:
    """Per-input increasing checkpoint ids, merged in a random order."""
    num_inputs = draw(st.integers(min_value=1, max_value=4))
    queues = [
        sorted(draw(st.sets(st.integers(min_value=0, max_value=6), max_size=5)))
        for _ in range(num_inputs)
    ]
    merged: list[tuple[int, int]] = []
    while any(queues):
        input_id = draw(st.sampled_from([i for i, q in enumerate(queues) if q]))
        merged.append((input_id, queues[input_id].pop(0)))
    return num_inputs, merged


@given(interleavings())
def test_aligner_never_aligns_wrongly(case: tuple[int, list[tuple[int, int]]]) -> None:
    num_inputs, merged = case
    aligner = BarrierAligner(num_inputs)
    delivered: dict[int, set[int]] = {}
    completed: list[int] = []
    for input_id, checkpoint_id in merged:
        delivered.setdefault(checkpoint_id, set()).add(input_id)
        action = aligner.on_barrier(input_id, b(checkpoint_id))
        if isinstance(action, (Aligned, Pass)):
            assert delivered[checkpoint_id] == set(range(num_inputs))
            completed.append(checkpoint_id)
        assert aligner.blocked_inputs <= delivered.get(
            aligner.pending.checkpoint_id if aligner.pending else -1, set()
        )
    assert completed == sorted(set(completed))  # each at most once, in order


# --- UnalignedCheckpointer -------------------------------------------------------------


def config(**overrides: Any) -> UnalignedConfig:
    """The seed's test config: 100 ms timeout, 1 MiB in flight."""
    options: dict[str, Any] = {"alignment_timeout": 0.1, "max_inflight_bytes": 1024 * 1024}
    return UnalignedConfig(**{**options, **overrides})


def test_aligned_fast_path() -> None:
    ckpt: UnalignedCheckpointer[str] = UnalignedCheckpointer(2, config())
    assert ckpt.on_barrier(0, b(1), now=0.0) == Waiting(b(1), frozenset({0}))
    assert ckpt.is_checkpointing and ckpt.aligned_count == 1
    assert ckpt.on_barrier(1, b(1), now=0.05) == AlignedSnapshot(b(1))
    assert not ckpt.is_checkpointing and ckpt.aligned_count == 0


def test_single_input_immediate_aligned() -> None:
    ckpt: UnalignedCheckpointer[str] = UnalignedCheckpointer(1, config())
    assert ckpt.on_barrier(0, b(1)) == AlignedSnapshot(b(1))
    assert not ckpt.is_checkpointing


def test_timeout_triggers_unaligned() -> None:
    ckpt: UnalignedCheckpointer[str] = UnalignedCheckpointer(3, config(alignment_timeout=0.001))
    assert isinstance(ckpt.on_barrier(0, b(1), now=10.0), Waiting)
    assert ckpt.check_timeout(now=10.0005) is None  # not yet
    snap = ckpt.check_timeout(now=10.005)
    assert isinstance(snap, UnalignedSnapshot)
    assert snap.barrier.is_unaligned and snap.barrier.checkpoint_id == 1
    assert snap.was_threshold_triggered
    assert ckpt.is_unaligned and ckpt.check_timeout(now=99.0) is None  # once per checkpoint


def test_timeout_also_noticed_when_a_barrier_arrives() -> None:
    ckpt: UnalignedCheckpointer[str] = UnalignedCheckpointer(3, config())
    ckpt.on_barrier(0, b(1), now=0.0)
    action = ckpt.on_barrier(1, b(1), now=0.2)
    assert isinstance(action, UnalignedSnapshot) and action.barrier.is_unaligned


def test_inflight_capture() -> None:
    ckpt: UnalignedCheckpointer[str] = UnalignedCheckpointer(2, config(alignment_timeout=0.001))
    ckpt.on_barrier(0, b(1), now=0.0)
    assert ckpt.buffer_event(1, "event-1", 7)
    assert ckpt.buffer_event(1, "event-2", 7)
    assert ckpt.buffered_bytes == 14
    snap = ckpt.check_timeout(now=0.005)
    assert snap == UnalignedSnapshot(
        b(1, F.UNALIGNED), (InFlightData(1, ("event-1", "event-2"), 14),), 14, True
    )
    assert ckpt.buffered_bytes == 0


def test_max_buffer_exceeded() -> None:
    ckpt: UnalignedCheckpointer[str] = UnalignedCheckpointer(2, config(max_inflight_bytes=10))
    ckpt.on_barrier(0, b(1), now=0.0)
    assert ckpt.buffer_event(1, "12345", 5)
    assert ckpt.buffer_event(1, "12345", 5)
    assert not ckpt.buffer_event(1, "x", 1)  # would exceed 10 bytes: not kept
    assert ckpt.buffered_bytes == 10


def test_overflow_keeps_the_checkpoint_aligned() -> None:
    # The seed answered an overflow with an aligned snapshot before all barriers arrived;
    # here the checkpoint keeps waiting and completes aligned, draining what it kept.
    ckpt: UnalignedCheckpointer[str] = UnalignedCheckpointer(2, config(max_inflight_bytes=4))
    ckpt.on_barrier(0, b(1), now=0.0)
    assert ckpt.buffer_event(1, "abcd", 4)
    assert not ckpt.buffer_event(1, "e", 1)
    assert ckpt.check_timeout(now=100.0) is None
    assert ckpt.on_barrier(1, b(1), now=100.0) == AlignedSnapshot(
        b(1), (InFlightData(1, ("abcd",), 4),)
    )


def test_force_unaligned_mode() -> None:
    ckpt: UnalignedCheckpointer[str] = UnalignedCheckpointer(3, config(force=True))
    snap = ckpt.on_barrier(0, b(1))
    assert isinstance(snap, UnalignedSnapshot)
    assert snap.barrier.is_unaligned and not snap.was_threshold_triggered


def test_sink_cannot_force_unaligned() -> None:
    # The seed silently ignored force for a sink; a sink configured to force is an error.
    with pytest.raises(ConfigError, match="sink"):
        UnalignedCheckpointer(2, config(alignment_timeout=0.001, force=True), is_sink=True)


def test_sink_with_timeout_keeps_waiting_aligned() -> None:
    ckpt: UnalignedCheckpointer[str] = UnalignedCheckpointer(
        2, config(alignment_timeout=0.001), is_sink=True
    )
    assert isinstance(ckpt.on_barrier(0, b(1), now=0.0), Waiting)
    assert ckpt.check_timeout(now=5.0) is None
    assert ckpt.on_barrier(1, b(1), now=10.0) == AlignedSnapshot(b(1))


def test_disabled_never_goes_unaligned() -> None:
    ckpt: UnalignedCheckpointer[str] = UnalignedCheckpointer(2, config(enabled=False))
    ckpt.on_barrier(0, b(1), now=0.0)
    assert ckpt.check_timeout(now=1e9) is None


def test_late_barriers_complete_cycle() -> None:
    ckpt: UnalignedCheckpointer[str] = UnalignedCheckpointer(3, config(alignment_timeout=0.001))
    ckpt.on_barrier(0, b(1), now=0.0)
    assert isinstance(ckpt.check_timeout(now=0.005), UnalignedSnapshot)
    assert ckpt.is_checkpointing
    late = b(1, F.UNALIGNED)
    assert ckpt.on_barrier(1, b(1)) == Waiting(late, frozenset({0, 1}))
    assert ckpt.is_checkpointing  # still waiting for input 2
    assert ckpt.on_barrier(2, b(1)) == LateBarriersDone(late, ())
    assert not ckpt.is_checkpointing


def test_events_after_the_snapshot_are_returned_by_the_last_late_barrier() -> None:
    ckpt: UnalignedCheckpointer[str] = UnalignedCheckpointer(3, config(max_inflight_bytes=6))
    ckpt.on_barrier(0, b(1), now=0.0)
    assert ckpt.buffer_event(2, "pre", 3)
    snap = ckpt.check_timeout(now=1.0)
    assert snap is not None and snap.inflight == (InFlightData(2, ("pre",), 3),)
    assert ckpt.buffer_event(1, "a", 1) and ckpt.buffer_event(2, "b", 2)
    ckpt.on_barrier(1, b(1))
    with pytest.raises(BarrierOrderError):
        ckpt.buffer_event(1, "after its barrier", 1)
    assert ckpt.on_barrier(2, b(1)) == LateBarriersDone(
        b(1, F.UNALIGNED), (InFlightData(1, ("a",), 1), InFlightData(2, ("b",), 2))
    )


def test_overflow_after_the_snapshot_marks_the_capture_incomplete() -> None:
    ckpt: UnalignedCheckpointer[str] = UnalignedCheckpointer(2, config(max_inflight_bytes=2))
    ckpt.on_barrier(0, b(1), now=0.0)
    ckpt.check_timeout(now=1.0)
    assert not ckpt.buffer_event(1, "too big", 3)
    done = ckpt.on_barrier(1, b(1))
    assert isinstance(done, LateBarriersDone) and done.overflowed


@pytest.mark.parametrize(
    ("phase", "barrier", "expected_drained"),
    [
        ("aligning", cancel(1), (InFlightData(1, ("x",), 1),)),  # parked events come back
        ("unaligned", cancel(1), ()),  # recorded copies were applied already
        ("aligning", cancel(9), None),  # another checkpoint's cancel: forwarded, no effect
    ],
)
def test_cancel(phase: str, barrier: CheckpointBarrier, expected_drained: Any) -> None:
    ckpt: UnalignedCheckpointer[str] = UnalignedCheckpointer(2, config())
    ckpt.on_barrier(0, b(1), now=0.0)
    ckpt.buffer_event(1, "x", 1)
    if phase == "unaligned":
        ckpt.check_timeout(now=1.0)
    action = ckpt.on_barrier(1, barrier)
    assert isinstance(action, CheckpointCancelled)
    if expected_drained is None:
        assert action.drained == () and ckpt.is_checkpointing
    else:
        assert action.drained == expected_drained and not ckpt.is_checkpointing


@pytest.mark.parametrize(
    ("steps", "bad"),
    [
        ([(0, b(1))], (0, b(1))),  # the same input twice while aligning
        ([(0, b(1))], (1, b(2))),  # another checkpoint while one is in progress
        ([(0, CheckpointBarrier(1, 1))], (1, CheckpointBarrier(1, 2))),  # epochs disagree
    ],
)
def test_unaligned_protocol_errors(
    steps: list[tuple[int, CheckpointBarrier]], bad: tuple[int, CheckpointBarrier]
) -> None:
    ckpt: UnalignedCheckpointer[str] = UnalignedCheckpointer(3, config())
    for input_id, barrier in steps:
        ckpt.on_barrier(input_id, barrier, now=0.0)
    with pytest.raises(BarrierOrderError):
        ckpt.on_barrier(*bad, now=0.0)


def test_buffer_event_needs_a_checkpoint_and_a_waiting_input() -> None:
    ckpt: UnalignedCheckpointer[str] = UnalignedCheckpointer(2, config())
    with pytest.raises(BarrierOrderError):
        ckpt.buffer_event(0, "idle", 1)  # nothing in flight when idle
    ckpt.on_barrier(0, b(1), now=0.0)
    with pytest.raises(BarrierOrderError):
        ckpt.buffer_event(0, "follows the barrier", 1)
    with pytest.raises(ConfigError):
        ckpt.buffer_event(1, "negative size", -1)


def test_clock_is_injectable_and_reset_drops_everything() -> None:
    now = [100.0]
    ckpt: UnalignedCheckpointer[str] = UnalignedCheckpointer(2, config(), clock=lambda: now[0])
    ckpt.on_barrier(0, b(1))
    ckpt.buffer_event(1, "x", 1)
    assert ckpt.check_timeout() is None
    now[0] = 100.2
    assert isinstance(ckpt.check_timeout(), UnalignedSnapshot)
    ckpt.reset()
    assert not ckpt.is_checkpointing and ckpt.buffered_bytes == 0


@pytest.mark.parametrize(
    "options",
    [
        {"alignment_timeout": -1.0},  # negative timeout
        {"alignment_timeout": float("nan")},  # NaN timeout
        {"alignment_timeout": "10"},  # not a number
        {"max_inflight_bytes": -1},  # negative budget
        {"max_inflight_bytes": 1.5},  # fractional bytes
        {"force": True, "enabled": False},  # force needs enabled
    ],
)
def test_config_validation(options: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        UnalignedConfig(**options)


def test_config_defaults_follow_the_seed() -> None:
    default = UnalignedConfig()
    assert (default.enabled, default.alignment_timeout, default.force) == (True, 10.0, False)
    assert default.max_inflight_bytes == 256 * 1024 * 1024
