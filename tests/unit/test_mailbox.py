"""The writer's mailbox without Ray: feeds, epochs in flight, alignment, attempts."""

from __future__ import annotations

import threading

import pytest

from raysink.protocol.barrier import CheckpointBarrier
from raysink.writer.mailbox import Mailbox, Verdict


def _apply_all(box: Mailbox[str]) -> list[str]:
    """What a writer's drain would apply now, in order."""
    applied: list[str] = []
    while (claimed := box.take_ready()) is not None:
        key, run = claimed
        applied += [m for _, m in run]
        box.applied(key, [feed for feed, _ in run], 0)
    return applied


def _barrier(epoch: int) -> CheckpointBarrier:
    return CheckpointBarrier(epoch, epoch)


def test_two_feeds_align_before_the_epoch_is_sealed_ready() -> None:
    """Each feed has its own sequence; messages apply in order per feed whatever order
    they arrive in, and the epoch is ready once both feeds' barriers arrived (in any
    order) and their messages are applied."""
    box: Mailbox[str] = Mailbox()
    box.offer(1, 0, "a", 1, "a1")
    box.offer(1, 0, "b", 0, "b0")
    assert _apply_all(box) == ["b0"]  # a0 is missing: a1 waits
    box.close_feed(_barrier(1), 0, "b", 1)
    box.offer(1, 0, "a", 0, "a0")
    assert _apply_all(box) == ["a0", "a1"]
    box.close_feed(_barrier(1), 0, "a", 2)
    box.seal(1, 0, ["a", "b"])
    assert box.wait_sealed(1, 0, timeout=1.0) == "ready"


@pytest.mark.parametrize("missing", ["barrier", "message"])
def test_a_seal_missing_what_its_feeds_sent_is_lost_at_once(missing: str) -> None:
    """A seal comes only after its feeds closed, and a feed closes only once the writer
    took its every message and its barrier. A writer restarted in between has lost them
    with its previous process: the seal says so at once rather than waiting out the
    barrier timeout (600 s by default) while the new process answers every ping."""
    box: Mailbox[str] = Mailbox()
    box.offer(1, 0, "a", 0, "a0")
    if missing == "message":
        box.offer(1, 0, "b", 1, "b1")  # b0 went to the writer's previous process
        box.close_feed(_barrier(1), 0, "b", 2)
    box.close_feed(_barrier(1), 0, "a", 1)
    box.seal(1, 0, ["a", "b"])
    assert box.wait_sealed(1, 0, timeout=30.0) == "lost"
    slot = box.slots()[0]
    assert slot.incomplete() == ["b"]


def test_a_seal_over_a_subset_of_the_senders_is_refused() -> None:
    """Feed "b" sent data but the seal names only "a" (``ep.commit(feeds=[a])``): "b"'s
    rows were applied with "a"'s and cannot be taken back out, so the seal refuses."""
    box: Mailbox[str] = Mailbox()
    box.offer(1, 0, "a", 0, "a0")
    box.offer(1, 0, "b", 0, "b0")
    box.close_feed(_barrier(1), 0, "a", 1)
    box.close_feed(_barrier(1), 0, "b", 1)
    assert _apply_all(box) == ["a0", "b0"]
    box.seal(1, 0, ["a"])
    assert box.wait_sealed(1, 0, timeout=30.0) == "unsealed"
    assert box.slots()[0].unsealed_senders() == ["b"]


def test_a_seal_is_not_lost_while_its_messages_are_being_applied() -> None:
    """Messages claimed for applying are neither waiting nor counted yet: still here."""
    box: Mailbox[str] = Mailbox()
    box.offer(1, 0, "a", 0, "a0")
    box.offer(1, 0, "a", 1, "a1")
    box.close_feed(_barrier(1), 0, "a", 2)
    claimed = box.take_ready()
    assert claimed is not None
    box.seal(1, 0, ["a"])
    assert box.slots()[0].incomplete() == []
    box.applied(claimed[0], ["a", "a"], 0)
    assert box.wait_sealed(1, 0, timeout=1.0) == "ready"


def test_a_run_claimed_before_its_attempt_was_given_up_finds_no_live_slot() -> None:
    """The writer looks its claimed run's slot up again under the lock a rollback takes:
    once the attempt was cancelled, or replaced by a newer one, there is none, and the run
    is dropped rather than applied after the rollback."""
    box: Mailbox[str] = Mailbox()
    box.offer(1, 0, "a", 0, "a0")
    claimed = box.take_ready()
    assert claimed is not None and box.live_slot(1, 0) is not None
    box.cancel(1, 0)
    assert box.live_slot(*claimed[0]) is None
    box.applied(claimed[0], ["a"], 0)
    box.offer(2, 0, "a", 0, "b0")
    claimed = box.take_ready()
    assert claimed is not None
    box.offer(2, 1, "a", 0, "b0 again")  # a newer attempt replaces it
    assert box.live_slot(*claimed[0]) is None and box.live_slot(2, 1) is not None


def test_a_feed_closing_twice_changes_nothing() -> None:
    """A producer retried by Ray closes again, with the same count: ignored."""
    box: Mailbox[str] = Mailbox()
    box.close_feed(_barrier(1), 0, "a", 1)
    box.close_feed(_barrier(1), 0, "a", 1)
    box.seal(1, 0, ["a"])
    assert box.offer(1, 0, "a", 0, "a0")[0] is Verdict.ACCEPTED
    assert box.offer(1, 0, "a", 0, "a0 again")[0] is Verdict.DUPLICATE  # deduplicated
    assert _apply_all(box) == ["a0"]
    assert box.wait_sealed(1, 0, timeout=1.0) == "ready"


def test_the_next_epoch_waits_for_this_one() -> None:
    """Data of epoch 2 that arrives first is held (not applied) until epoch 1 is done."""
    box: Mailbox[str] = Mailbox()
    box.offer(2, 0, 0, 0, "e2")
    box.offer(1, 0, 0, 0, "e1")
    assert _apply_all(box) == ["e1"]
    box.close_feed(_barrier(1), 0, 0, 1)
    box.seal(1, 0, [0])
    assert box.wait_sealed(1, 0, timeout=1.0) == "ready"
    assert box.finish(1, 0) is not None
    assert _apply_all(box) == ["e2"]
    assert box.offer(1, 0, 0, 1, "late e1")[0] is Verdict.STALE


def test_a_new_attempt_replaces_the_old_one() -> None:
    box: Mailbox[str] = Mailbox()
    box.offer(1, 0, 0, 0, "old")
    verdict, replaced = box.offer(1, 1, 0, 0, "new")
    assert verdict is Verdict.ACCEPTED and replaced == [(1, 0)]
    assert box.offer(1, 0, 0, 1, "old again")[0] is Verdict.STALE
    assert _apply_all(box) == ["new"]


def test_cancel_wakes_a_waiting_seal_and_drops_the_attempt() -> None:
    box: Mailbox[str] = Mailbox()
    box.offer(1, 0, 0, 0, "e1")  # epoch 1 is current: epoch 2's seal waits for it
    box.close_feed(_barrier(2), 0, 0, 0)
    box.seal(2, 0, [0])
    outcome: list[str] = []
    waiter = threading.Thread(target=lambda: outcome.append(box.wait_sealed(2, 0, 10.0)))
    waiter.start()
    dropped = box.cancel(2, 0)
    waiter.join(timeout=5)
    assert [s.key for s in dropped] == [(2, 0)] and outcome == ["stale"]
    assert box.offer(2, 0, 0, 0, "late")[0] is Verdict.STALE


def test_bytes_are_bounded_over_every_epoch_in_flight() -> None:
    """The next epoch's data counts against the bound too; the current epoch's next
    message is always taken."""
    box: Mailbox[str] = Mailbox(max_bytes=100)
    assert box.offer(2, 0, 0, 0, "e2-0", 60)[0] is Verdict.ACCEPTED
    assert box.offer(2, 0, 0, 1, "e2-1", 60)[0] is Verdict.FULL
    assert box.offer(1, 0, 0, 0, "e1-0", 500)[0] is Verdict.ACCEPTED  # needed next


def test_depth_and_status_while_messages_of_new_feeds_arrive() -> None:
    """The writer reads its mailbox's depth after each drain and for its status while
    other threads file messages of feeds it has not seen (each adds a lane): counting
    over the lanes unlocked failed with "dictionary changed size during iteration",
    which failed the epoch's barrier (a 60-minute soak saw it 6 times in 4,013 epochs)."""
    box: Mailbox[str] = Mailbox()
    stop = threading.Event()
    errors: list[BaseException] = []

    def file_messages() -> None:
        feed = 0
        while not stop.is_set():
            box.offer(1, 0, f"feed-{feed}", 1, "m")  # seq 1: waits for seq 0, kept
            feed += 1

    def read() -> None:
        try:
            while not stop.is_set():
                box.depth()
                box.waiting_for()
                box.why_unready((1, 0))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=file_messages), threading.Thread(target=read)]
    for thread in threads:
        thread.start()
    stop.wait(1.0)
    stop.set()
    for thread in threads:
        thread.join()
    assert not errors, errors
    assert box.depth() > 0


def test_is_stale_is_asked_safely_while_other_threads_file_and_cancel_attempts() -> None:
    """A writer asks ``is_stale`` before it fetches a message's data, outside its lock,
    while its other data thread files messages of new attempts and its barrier thread
    cancels old ones. Asked without the mailbox's lock, its look over the slots raised
    ``RuntimeError: dictionary changed size during iteration`` when a slot came or went
    meanwhile, and the write failed its attempt (the cluster layer's node-loss test:
    "epoch 6 attempt 1 failed: RuntimeError: dictionary changed size during iteration")."""
    import sys

    box: Mailbox[str] = Mailbox()
    for epoch in range(1, 400):  # many slots in flight: each look over them is long
        box.offer(epoch, 0, 0, 0, "m")
    errors: list[BaseException] = []
    stop = threading.Event()

    def churn() -> None:
        attempt = 1
        while not stop.is_set():
            box.offer(1000, attempt, 0, 0, "m")  # a new slot (replacing the previous one)
            box.cancel(1000, attempt)
            attempt += 1

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    thread = threading.Thread(target=churn, daemon=True)
    thread.start()
    try:
        for _ in range(3000):
            try:
                box.is_stale(500, 0)
            except RuntimeError as exc:
                errors.append(exc)
                break
    finally:
        stop.set()
        thread.join()
        sys.setswitchinterval(interval)
    assert errors == []
