"""The coordinator's books of producers: ``FeedRegistry`` (closed, failed, lost by lease)
and ``StreamBook`` (members, one barrier per member per tick, joins, rewinds, replays
owed at the drain)."""

from __future__ import annotations

import dataclasses

from raysink.coordinator.producers import FeedRegistry
from raysink.coordinator.stream_state import Owed, StreamBook
from raysink.protocol.barrier import BarrierFlags, CheckpointBarrier
from raysink.writer.mailbox import Mailbox, Verdict


def test_feeds_close_fail_and_are_lost_when_silent_past_the_lease() -> None:
    book = FeedRegistry()
    book.alive(1, 0, 1, now=0.0)
    book.alive(1, 0, 2, now=0.0)
    book.closed(1, 0, 1, {0: 3, 1: 2}, now=1.0)
    book.closed(1, 0, 1, {0: 9}, now=2.0)  # closing again (a retried producer) keeps the first
    book.failed(1, 0, 3, "ValueError: bad source")
    state = book.state(1, 0, [1, 2, 3, 4], lease=5.0, now=4.0)
    assert state.closed == {1: {0: 3, 1: 2}}
    assert state.lost == {3: "ValueError: bad source"}
    assert state.waiting == (2, 4) and state.done  # one lost: the attempt is given up
    late = book.state(1, 0, [1, 2, 4], lease=5.0, now=6.0)
    assert list(late.lost) == [2] and "no heartbeat" in late.lost[2]
    assert late.waiting == (4,)  # never heard from: not started yet, not lost
    assert book.state(1, 1, [1], lease=5.0, now=6.0).waiting == (1,)  # attempts apart
    book.forget(1)
    assert book.state(1, 0, [1], lease=5.0, now=6.0).waiting == (1,)


def test_a_closed_feed_cannot_fail_afterwards() -> None:
    book = FeedRegistry()
    book.closed(2, 0, 1, {}, now=0.0)
    book.failed(2, 0, 1, "late")
    assert book.state(2, 0, [1], lease=1.0, now=10.0).closed == {1: {}}


def test_each_member_claims_its_barrier_once_and_moves_on() -> None:
    stream = StreamBook(epoch=5, attempt=0)
    assert stream.poll(1, 0, committed=4).epoch == 5  # joins the current epoch
    assert stream.poll(2, 0, committed=4).barrier is None
    tick = stream.tick(checkpoint_id=7, next_attempt=0, generation=3)
    assert tick is not None and (tick.epoch, tick.members) == (5, (1, 2))
    assert tick.generation is None  # the first epoch was opened at the coordinator
    first = stream.poll(1, 0, committed=4)
    assert first.barrier == CheckpointBarrier(7, 5) and first.barrier_attempt == 0
    assert first.epoch == 6
    assert stream.poll(1, 0, committed=4).barrier is None  # claimed once
    assert stream.writing(2) == (5, 0)  # not claimed yet: still writes epoch 5
    assert stream.poll(3, 0, committed=4).epoch == 6  # a late joiner starts at the next
    second = stream.tick(checkpoint_id=8, next_attempt=0, generation=3)
    assert second is not None and second.members == (1, 3) and second.generation == 3


def test_a_tick_without_members_commits_nothing_and_drain_ends_the_stream() -> None:
    stream = StreamBook(epoch=1, attempt=0)
    assert stream.tick(1, 0, 1) is None and stream.epoch == 1
    stream.poll(1, 0, committed=None)
    drain = stream.tick(2, 0, 1, drain=True)
    assert drain is not None and drain.drain
    claimed = stream.poll(1, 0, committed=None)
    assert claimed.barrier is not None and claimed.barrier.flags is BarrierFlags.DRAIN
    assert not claimed.ended  # close the last part first
    assert stream.poll(1, 0, committed=1).ended
    assert stream.poll(9, 0, committed=1).ended  # nobody joins a drained stream
    assert not stream.poll(9, 0, committed=1).member


def test_a_rewind_clears_the_members_and_counts() -> None:
    stream = StreamBook(epoch=3, attempt=0)
    stream.poll(1, 0, committed=2)
    stream.tick(1, 0, 1)
    stream.rewind(3, 1, cut=2)
    told = stream.poll(1, 0, committed=2)  # not applied yet: told its cut, not a member
    assert (told.rewinds, told.rewound, told.committed, told.member) == (1, True, 2, False)
    position = stream.poll(1, 1, committed=2)  # applied: joins the reopened epoch
    assert (position.epoch, position.attempt, position.member) == (3, 1, True)
    tick = stream.tick(2, 0, 1)
    assert tick is not None and tick.generation is None  # reopened at the coordinator


def test_a_given_up_epoch_after_the_current_one_does_not_block_its_replay() -> None:
    box: Mailbox[str] = Mailbox()
    assert box.offer(3, 0, 1, 0, "a")[0] is Verdict.ACCEPTED
    assert box.offer(4, 0, 1, 0, "b")[0] is Verdict.ACCEPTED
    box.cancel(3, 0)
    box.cancel(4, 0)  # the stream rewinds to epoch 3 and gives up 4 too
    assert box.offer(3, 1, 1, 0, "a2")[0] is Verdict.ACCEPTED  # the replay
    assert box.offer(4, 0, 1, 1, "late")[0] is Verdict.STALE
    assert box.offer(4, 1, 1, 0, "b2")[0] is Verdict.ACCEPTED


def test_a_sealed_slot_says_which_feeds_it_waits_for() -> None:
    box: Mailbox[str] = Mailbox()
    box.offer(1, 0, 7, 0, "x")
    box.close_feed(CheckpointBarrier(1, 1), 0, 7, 1)
    box.seal(1, 0, [7, 8, 9])
    [slot] = box.slots()
    assert slot.waiting_for() == [8, 9]
    box.close_feed(CheckpointBarrier(1, 1), 0, 8, 0)
    box.close_feed(CheckpointBarrier(1, 1), 0, 9, 0)
    assert slot.waiting_for() == []


def test_a_leaving_member_owes_an_empty_close_for_a_tick_it_did_not_claim() -> None:
    stream = StreamBook(epoch=1, attempt=0)
    stream.poll(1, 0, committed=None)
    stream.poll(2, 0, committed=None)
    assert stream.leave(2) is None  # nothing ticked for it yet
    tick = stream.tick(1, 0, 1)
    assert tick is not None and tick.members == (1,)
    assert stream.leave(1) == (1, 0)  # ticked, unclaimed: closed empty for it
    assert stream.poll(1, 0, committed=None).barrier is None  # a late poll does not rejoin
    assert stream.tick(2, 0, 1) is None


def test_a_rewound_member_is_told_its_cut_until_it_applied_the_rewind() -> None:
    stream = StreamBook(epoch=3, attempt=0)
    stream.poll(1, committed=2, applied_rewinds=0)
    stream.poll(2, committed=2, applied_rewinds=0)
    stream.tick(1, 0, 1)
    stream.rewind(3, 1, cut=2)
    assert stream.has_cut(1) and stream.has_cut(2)
    assert stream.poll(2, committed=2, applied_rewinds=1).committed == 2  # applied
    assert not stream.has_cut(2)
    stream.tick(2, 0, 1)  # epochs 3 and 4 commit with member 2 alone
    assert stream.poll(1, committed=4, applied_rewinds=0).committed == 2  # its cut still
    assert stream.poll(1, committed=4, applied_rewinds=None).committed == 2  # restarted
    stream.rewind(5, 0, cut=4)  # a second rewind before it applied the first
    assert stream.poll(1, committed=4, applied_rewinds=0).committed == 2  # still its cut
    # applied the first but wrote nothing since (it never joined): nothing of it after its
    # cut is decided, so it may resume from the last decided epoch
    late = stream.poll(1, committed=4, applied_rewinds=1)
    assert (late.committed, late.rewound, late.member) == (4, False, False)
    assert stream.poll(1, committed=4, applied_rewinds=2).committed == 4
    assert not stream.has_cut(1)


def test_a_rewound_member_rejoins_only_once_it_applied_the_rewind() -> None:
    """A sparse producer's poll thread keeps polling after a rewind while the producer has
    not written since (so it has not replayed): it must not be a member again before it
    applied the rewind, or the next tick hands it a barrier of the reopened epoch, which
    its poll thread closes for it as if it had replayed, and its cut is forgotten."""
    stream = StreamBook(epoch=3, attempt=0)
    stream.poll(1, committed=2, applied_rewinds=0)
    stream.poll(2, committed=2, applied_rewinds=0)
    stream.tick(1, 0, 1)
    stream.rewind(3, 1, cut=2)
    stream.poll(2, committed=2, applied_rewinds=1)  # replayed: back in
    sparse = stream.poll(1, committed=2, applied_rewinds=0)  # its poll thread
    assert sparse.committed == 2 and sparse.barrier is None
    tick = stream.tick(2, 0, 1)
    assert tick is not None and tick.members == (2,), (
        f"members {tick.members}: the producer that did not replay yet is one again")
    assert stream.has_cut(1)


def test_a_drain_waits_for_a_cut_feed_that_wrote_into_a_dropped_epoch() -> None:
    """Feed 1 wrote into epoch 3 and went idle (its poll thread reports it); the epoch
    fails and the stream rewinds to 2. The drain must not end the stream while feed 1
    owes that replay: only its own next call tells it. Feed 2, a member that wrote
    nothing after its cut, owes nothing; feed 3 left on purpose."""
    stream = StreamBook(epoch=3, attempt=0)
    for feed in (1, 2, 3):
        stream.poll(feed, 0, committed=2, wrote=3 if feed == 1 else 2, seen=0, now=1.0)
    stream.tick(1, 0, 1)
    stream.rewind(3, 1, cut=2)
    stream.leave(3)
    for feed in (1, 2):  # the idle producers' poll threads, having seen the rewind
        stream.poll(feed, 0, committed=2, wrote=3 if feed == 1 else 2, seen=1, now=2.0)
    owed = stream.owed(now=2.0, lease=5.0)
    assert (owed.ended, [(o.feed, o.cut, o.wrote) for o in owed.feeds], owed.unknown) == (
        False, [(1, 2, 3)], ())
    assert stream.tick(2, 0, 1, drain=True, now=2.0, lease=5.0) is None
    assert not stream.ended  # open for the replay
    stream.poll(1, 1, committed=2, wrote=3, seen=1, now=3.0)  # replayed: applied, joined
    assert stream.owed(now=3.0, lease=5.0).feeds == ()
    tick = stream.tick(3, 0, 1, drain=True, now=3.0, lease=5.0)
    assert tick is not None and tick.members == (1,) and stream.ended
    assert stream.owed(now=3.0, lease=5.0).ended


def test_a_cut_feed_not_heard_from_since_its_cut_holds_the_drain_for_the_lease() -> None:
    """A feed's last report came before it saw the rewind: a write may have ended after
    it, so the drain waits for its next poll, up to the lease (a feed silent past it is
    lost, as in an epoch)."""
    stream = StreamBook(epoch=3, attempt=0)
    stream.poll(1, 0, committed=2, wrote=2, seen=0, now=1.0)
    stream.tick(1, 0, 1)
    stream.rewind(3, 1, cut=2)
    assert stream.owed(now=2.0, lease=5.0).unknown == (1,)
    assert stream.owed(now=7.0, lease=5.0).unknown == ()  # silent past the lease
    stream.poll(1, 0, committed=2, wrote=2, seen=1, now=2.5)  # nothing after its cut
    assert stream.owed(now=2.5, lease=5.0) == Owed(ended=False)
    tick = stream.tick(2, 0, 1, drain=True, now=2.5, lease=5.0)
    assert tick is None and stream.ended  # no member, nothing owed: drained


def test_a_failed_drain_reopens_the_stream_for_its_members_replay() -> None:
    stream = StreamBook(epoch=3, attempt=0)
    stream.poll(1, 0, committed=2, wrote=3, seen=0, now=1.0)
    assert stream.tick(1, 0, 1, drain=True, now=1.0, lease=5.0) is not None
    assert stream.ended
    stream.rewind(3, 1, cut=2)  # the drained epoch failed
    assert not stream.ended
    assert [o.feed for o in stream.owed(now=1.5, lease=5.0).feeds] == [1]
    assert stream.poll(1, 1, committed=2, now=2.0).member  # it replays into epoch 3


def test_a_successor_drain_does_not_wait_for_feeds_that_left_before_the_takeover() -> None:
    """Feeds 1 and 2 were handed out; feed 2 left (``feed.close()``) before the
    coordinator was lost. The successor cuts every feed handed out; it waits at the drain
    for feed 1 (not heard from since the takeover, up to the lease), never for feed 2:
    the state the driver kept says it left."""
    stream = StreamBook(epoch=3, attempt=0)
    for feed in (1, 2):
        stream.poll(feed, 0, committed=2, wrote=3, seen=0, now=1.0)
    stream.leave(2)
    state = dataclasses.replace(stream.state(), feeds=2)
    successor = StreamBook.taken_over(state, 4, 0, 3, opened=True, now=10.0)
    assert successor.owed(now=11.0, lease=5.0).unknown == (1,)
    assert successor.owed(now=16.0, lease=5.0) == Owed(ended=False)
