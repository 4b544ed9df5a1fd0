"""BarrierAligner (raysink has no unaligned fallback: see the alignment module's
docstring)."""

from __future__ import annotations

import pickle
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from raysink.errors import ConfigError
from raysink.protocol.alignment import (
    AlignAction,
    Aligned,
    BarrierAligner,
    BarrierOrderError,
    Blocked,
    Cancelled,
    Ignored,
    Pass,
)
from raysink.protocol.barrier import BarrierFlags, CheckpointBarrier

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
            (0, b(1, F.DRAIN), Blocked(0, b(1, F.DRAIN))),
            (1, b(1), Aligned(b(1, F.DRAIN))),
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
    assert aligner.blocked_inputs == frozenset({1})
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
