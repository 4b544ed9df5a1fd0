"""A writer of a sink that holds transactions pre-commits an epoch only after every
earlier epoch is committed to that sink (``raysink.writer.ordering``), told by the barrier
or asked of the coordinator (``CoordinatorActor.earlier_committed``, which answers at
the commit that completes them). No Ray: the coordinator is a list of answers, or
``CommitWaits`` over a status that changes.

The barrier's ``committed_through`` saves the coordinator call only when it covers every
epoch before the one sealed; an epoch still outstanding below it must hold the
pre-commit whatever the barrier says.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

import pytest

from raysink.coordinator.waits import CommitWaits
from raysink.errors import EpochFailedError
from raysink.reports import RuntimeStatus, SinkStatus
from raysink.writer.ordering import EarlierCommits


def _status(*, committed: int | None, pending: list[int],
            sink_committed: int | None = None, open_epoch: int | None = None
            ) -> RuntimeStatus:
    """The coordinator's answer: ``committed`` by every sink, ``pending`` decided,
    ``sink_committed`` the last epoch committed to sink ``main``, ``open_epoch`` the
    lowest epoch open."""
    done = committed if sink_committed is None else sink_committed
    return RuntimeStatus(name="rt", metastore="sqlite://", last_committed_epoch=committed,
                         pending_epochs=pending, open_epoch=open_epoch,
                         sinks={"main": SinkStatus(state="running",
                                                   last_committed_epoch=done,
                                                   last_error=None)})


class Coordinator:
    """Answers ``earlier_committed`` from ``answers`` in turn (the last one again and
    again), noting each question (the epoch, the wait)."""

    def __init__(self, *answers: RuntimeStatus) -> None:
        self.answers = list(answers)
        self.asked = 0
        self.questions: list[tuple[int, float]] = []

    def status(self, epoch: int, wait: float) -> RuntimeStatus:
        self.asked += 1
        self.questions.append((epoch, wait))
        return self.answers[min(self.asked, len(self.answers)) - 1]


def _earlier(coordinator: Coordinator, timeout: float = 5.0) -> EarlierCommits:
    return EarlierCommits(runtime="rt", sink="main", writer=0, timeout=timeout,
                          status=coordinator.status, lost=lambda: None, ask_every=2.0)


@pytest.fixture
def nothing_pending() -> Iterator[Coordinator]:
    yield Coordinator(_status(committed=4, pending=[]))


def test_a_barrier_that_covers_the_earlier_epochs_saves_the_status_call(
        nothing_pending: Coordinator) -> None:
    earlier = _earlier(nothing_pending)
    earlier.learn(4)
    earlier.wait(5)
    assert nothing_pending.asked == 0


def test_without_a_hint_the_coordinator_is_asked(nothing_pending: Coordinator) -> None:
    earlier = _earlier(nothing_pending)
    earlier.wait(5)
    assert nothing_pending.asked == 1
    earlier.wait(5)  # what the answer said is kept: every sink holds epoch 4
    assert nothing_pending.asked == 1


def test_an_earlier_epoch_outstanding_holds_the_pre_commit_despite_an_older_hint() -> None:
    """Epoch 5 is decided but not committed to the sink; the barrier of epoch 6 says only
    that epochs up to 4 are committed: the pre-commit waits until the status shows 5
    committed (here on the third answer)."""
    coordinator = Coordinator(_status(committed=4, pending=[5]),
                              _status(committed=4, pending=[5]),
                              _status(committed=4, pending=[5], sink_committed=5))
    earlier = _earlier(coordinator)
    earlier.learn(4)
    earlier.wait(6)
    assert coordinator.asked == 3


def test_an_earlier_epoch_that_never_commits_fails_the_pre_commit() -> None:
    coordinator = Coordinator(_status(committed=3, pending=[4, 5]))
    earlier = _earlier(coordinator, timeout=0.05)
    earlier.learn(3)
    with pytest.raises(EpochFailedError, match="epochs before 5 to be committed"):
        earlier.wait(5)
    assert coordinator.asked >= 1


def test_a_lower_hint_never_lowers_what_is_known(nothing_pending: Coordinator) -> None:
    """A late barrier (an older fact) leaves the newer one: commits are never undone."""
    earlier = _earlier(nothing_pending)
    earlier.learn(7)
    earlier.learn(2)
    earlier.learn(None)
    earlier.wait(8)
    assert (earlier.committed_through, nothing_pending.asked) == (7, 0)


def test_the_coordinator_is_asked_about_the_epoch_and_waits_at_most_the_time_left() -> None:
    """One question per answer that is not yet the one wanted, each naming the epoch and
    a wait within ``ask_every`` and the deadline: no polling loop of its own."""
    coordinator = Coordinator(_status(committed=4, pending=[5]),
                              _status(committed=5, pending=[]))
    _earlier(coordinator).wait(6)
    assert [epoch for epoch, _ in coordinator.questions] == [6, 6]
    assert all(0 < wait <= 2.0 for _, wait in coordinator.questions)


class _Snapshots(CommitWaits):
    """``CommitWaits`` over a status that changes, with the coordinator's wake."""

    def __init__(self, first: RuntimeStatus) -> None:
        self.now = first
        self.changed = asyncio.Condition()

    async def status(self) -> RuntimeStatus:
        return self.now

    async def _wait_change(self, timeout: float) -> None:
        async with self.changed:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.changed.wait(), timeout)

    async def commit(self, status: RuntimeStatus) -> None:
        self.now = status
        async with self.changed:
            self.changed.notify_all()


def test_the_coordinator_answers_at_the_commit_that_completes_the_earlier_epochs() -> None:
    async def scenario() -> tuple[RuntimeStatus, RuntimeStatus]:
        waits = _Snapshots(_status(committed=4, pending=[5]))
        asked = asyncio.ensure_future(waits.earlier_committed("main", 6, wait=60.0))
        await asyncio.sleep(0.05)
        assert not asked.done()  # epoch 5 is not committed yet: the call waits
        await waits.commit(_status(committed=5, pending=[]))
        answer = await asyncio.wait_for(asked, 30.0)
        stale = await waits.earlier_committed("main", 7, wait=0.0)
        return answer, stale

    answer, stale = asyncio.run(scenario())
    assert answer.committed_before("main", 6)
    assert stale.committed_before("main", 7)  # nothing pending: answered at once


def test_the_coordinator_answers_after_the_wait_whatever_the_status() -> None:
    waits = _Snapshots(_status(committed=3, pending=[4]))
    answer = asyncio.run(waits.earlier_committed("main", 5, wait=0.1))
    assert not answer.committed_before("main", 5)  # the writer asks again


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_now_answers_from_what_is_known_without_asking(nothing_pending: Coordinator) -> None:
    earlier = _earlier(nothing_pending)
    earlier.learn(4)
    assert earlier.now(5)
    assert nothing_pending.asked == 0


def test_now_asks_without_waiting_and_at_most_once_a_second() -> None:
    """An early start asks the coordinator without a wait; it is told no while epoch 5 is
    not committed everywhere, and does not ask again within the second."""
    coordinator = Coordinator(_status(committed=4, pending=[5]),
                              _status(committed=5, pending=[]))
    clock = _Clock()
    earlier = EarlierCommits(runtime="rt", sink="main", writer=0, timeout=5.0,
                             status=coordinator.status, lost=lambda: None, clock=clock)
    assert not earlier.now(6)
    assert coordinator.questions == [(6, 0.0)]
    clock.now += 0.5
    assert not earlier.now(6)
    assert coordinator.asked == 1
    clock.now += 0.6
    assert earlier.now(6)
    assert coordinator.questions == [(6, 0.0), (6, 0.0)]


def test_now_asks_at_once_about_a_new_epoch() -> None:
    """The next epoch's first table comes within the second of the last question (one
    epoch after another through ``rt.write*``): it is asked about at once."""
    coordinator = Coordinator(_status(committed=5, pending=[], open_epoch=6),
                              _status(committed=6, pending=[], open_epoch=7))
    clock = _Clock()
    earlier = EarlierCommits(runtime="rt", sink="main", writer=0, timeout=5.0,
                             status=coordinator.status, lost=lambda: None, clock=clock)
    assert earlier.now(6)
    clock.now += 0.05
    assert earlier.now(7)
    assert [q for q, _ in coordinator.questions] == [6, 7]


def test_now_needs_every_earlier_epoch_committed_not_only_the_decided_ones() -> None:
    """Epoch 5 is still being gathered (not decided, so not pending): ``wait`` would let
    a pre-commit of 6 go (its own barrier follows 5's at every writer), but an early start
    of 6 could put its records before 5's, so ``now`` says no until 5 is committed."""
    coordinator = Coordinator(_status(committed=4, pending=[]))
    earlier = _earlier(coordinator)
    assert not earlier.now(6)
    assert earlier.now(5)


def test_now_is_no_when_the_coordinator_cannot_answer() -> None:
    lost: list[bool] = []

    def failing(epoch: int, wait: float) -> RuntimeStatus:
        raise TimeoutError("no answer in 2 s")

    earlier = EarlierCommits(runtime="rt", sink="main", writer=0, timeout=5.0,
                             status=failing, lost=lambda: lost.append(True))
    assert not earlier.now(3)
    assert lost == [True]


@pytest.mark.parametrize(("status", "epoch", "early"), [
    (_status(committed=None, pending=[], open_epoch=1), 1, True),  # a fresh runtime
    (_status(committed=3, pending=[], open_epoch=7), 7, True),  # 4-6 never opened/aborted
    (_status(committed=3, pending=[5], open_epoch=7), 7, False),  # 5 decided, to commit
    (_status(committed=None, pending=[], open_epoch=5), 6, False),  # 5 open below 6
    (_status(committed=None, pending=[], open_epoch=None), 2, False),  # 2 not open: unknown
])
def test_now_for_the_lowest_open_epoch_with_nothing_below_it_to_commit(
        status: RuntimeStatus, epoch: int, early: bool) -> None:
    assert _earlier(Coordinator(status)).now(epoch) is early
