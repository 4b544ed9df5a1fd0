"""CheckpointBarrier and BarrierInjector."""

from __future__ import annotations

import dataclasses
import pickle
import threading
import time
from typing import Any

import pytest

from raysink.errors import ConfigError
from raysink.protocol.barrier import (
    MAX_ID,
    BarrierFlags,
    BarrierInjector,
    CheckpointBarrier,
)

F = BarrierFlags


@pytest.mark.parametrize(
    ("flags", "drain", "cancel"),
    [
        (F.NONE, False, False),  # plain barrier asks for nothing
        (F.DRAIN, True, False),  # last barrier before shutdown
        (F.CANCEL, False, True),  # cancels its checkpoint
        (F.DRAIN | F.CANCEL, True, True),  # flags combine
    ],
)
def test_flag_properties(flags: BarrierFlags, drain: bool, cancel: bool) -> None:
    barrier = CheckpointBarrier(1, 1, flags)
    assert (barrier.is_drain, barrier.is_cancel) == (drain, cancel)


def test_defaults() -> None:
    plain = CheckpointBarrier(1, 1)
    assert plain.flags is F.NONE and not plain.is_drain and not plain.is_cancel


def test_int_flags_are_coerced_and_with_flags_adds() -> None:
    barrier = CheckpointBarrier(1, 2, 4)  # type: ignore[arg-type]
    assert barrier.flags == F.CANCEL
    assert isinstance(barrier.flags, BarrierFlags)
    assert barrier.with_flags(F.DRAIN).flags == F.DRAIN | F.CANCEL
    assert barrier.flags == F.CANCEL  # the original is unchanged


@pytest.mark.parametrize(
    ("checkpoint_id", "epoch", "flags"),
    [
        (-1, 0, F.NONE),  # negative checkpoint id
        (0, -5, F.NONE),  # negative epoch
        (MAX_ID + 1, 0, F.NONE),  # does not fit a signed 64-bit meta store column
        (True, 0, F.NONE),  # a bool is not an id
        ("1", 0, F.NONE),  # neither is a string
        (1.0, 0, F.NONE),  # nor a float
        (0, 0, 16),  # unknown flag bit
        (0, 0, 1),  # the full-snapshot bit is gone: no sink had a use for it
        (0, 0, -1),  # negative flags
        (0, 0, "DRAIN"),  # flags by name are only for JSON
    ],
)
def test_invalid_barriers_are_config_errors(checkpoint_id: Any, epoch: Any, flags: Any) -> None:
    with pytest.raises(ConfigError) as info:
        CheckpointBarrier(checkpoint_id, epoch, flags)
    assert isinstance(info.value, ValueError)


def test_barrier_is_frozen_hashable_and_picklable() -> None:
    barrier = CheckpointBarrier(7, 9, F.DRAIN | F.CANCEL)
    with pytest.raises(dataclasses.FrozenInstanceError):
        barrier.epoch = 10  # type: ignore[misc]
    assert {barrier, CheckpointBarrier(7, 9, F.DRAIN | F.CANCEL)} == {barrier}
    clone = pickle.loads(pickle.dumps(barrier))
    assert clone == barrier and clone.flags is barrier.flags


def test_poll_without_trigger_returns_none() -> None:
    injector = BarrierInjector()
    assert injector.handle().poll(0) is None
    assert injector.epoch == 0 and not injector.has_pending


def test_trigger_then_poll_claims_once() -> None:
    # Seed case: the barrier carries the trigger's id and flags and the poller's epoch.
    injector = BarrierInjector()
    handle = injector.handle()
    injector.trigger(42, F.DRAIN)
    assert injector.epoch == 1 and injector.has_pending
    assert handle.poll(1) == CheckpointBarrier(42, 1, F.DRAIN)
    assert handle.poll(1) is None
    assert not injector.has_pending


def test_checkpoint_zero_without_flags_is_delivered() -> None:
    # (0, NONE) is a real barrier, not an "empty" sentinel.
    injector = BarrierInjector()
    injector.trigger(0, F.NONE)
    assert injector.handle().poll(0) == CheckpointBarrier(0, 0)


def test_exactly_one_of_several_handles_claims() -> None:
    injector = BarrierInjector()
    handles = [injector.handle() for _ in range(4)]
    injector.trigger(1)
    results = [h.poll(1) for h in handles]
    assert [r for r in results if r is not None] == [CheckpointBarrier(1, 1)]


def test_later_trigger_supersedes_unclaimed() -> None:
    injector = BarrierInjector()
    handle = injector.handle()
    injector.trigger(1, F.NONE)
    injector.trigger(2, F.DRAIN)
    assert injector.epoch == 2
    assert handle.poll(5) == CheckpointBarrier(2, 5, F.DRAIN)
    assert handle.poll(5) is None


@pytest.mark.parametrize(
    ("checkpoint_id", "flags"),
    [
        (-1, F.NONE),  # negative id
        (MAX_ID + 1, F.NONE),  # too large
        (1, 32),  # unknown flag bits
        (None, F.NONE),  # not an int
    ],
)
def test_trigger_validates(checkpoint_id: Any, flags: Any) -> None:
    injector = BarrierInjector()
    with pytest.raises(ConfigError):
        injector.trigger(checkpoint_id, flags)
    assert injector.epoch == 0 and not injector.has_pending


def test_poll_validates_epoch_and_keeps_the_barrier() -> None:
    injector = BarrierInjector()
    handle = injector.handle()
    injector.trigger(3)
    with pytest.raises(ConfigError):
        handle.poll(-1)
    assert handle.poll(2) == CheckpointBarrier(3, 2)


class _ExplodingLock:
    def __enter__(self) -> None:
        raise AssertionError("the fast path must not take the lock")

    def __exit__(self, *exc: object) -> None:  # pragma: no cover - never entered
        return None


def test_fast_path_takes_no_lock() -> None:
    injector = BarrierInjector()
    handle = injector.handle()
    handle._slot.lock = _ExplodingLock()  # type: ignore[assignment]
    assert all(handle.poll(0) is None for _ in range(1000))


def test_concurrent_pollers_claim_each_barrier_exactly_once() -> None:
    injector = BarrierInjector()
    rounds, pollers = 100, 4
    claimed: list[list[int]] = [[] for _ in range(pollers)]
    done = threading.Event()

    def poll_loop(slot: int) -> None:
        handle = injector.handle()
        while not done.is_set() or injector.has_pending:
            barrier = handle.poll(0)
            if barrier is not None:
                claimed[slot].append(barrier.checkpoint_id)
            time.sleep(0)

    threads = [threading.Thread(target=poll_loop, args=(i,)) for i in range(pollers)]
    for thread in threads:
        thread.start()
    for checkpoint_id in range(rounds):
        injector.trigger(checkpoint_id)
        while injector.has_pending:  # wait for a claim so none is superseded
            time.sleep(0)
    done.set()
    for thread in threads:
        thread.join(timeout=10)
    assert sorted(c for per in claimed for c in per) == list(range(rounds))
