"""Draining a continuous stream (``rt.close()``) while a producer is idle: its poll thread
alone talks to the stream, and only the producer's own calls apply a rewind. A producer
whose rows were given up by a failed epoch and that made no call since must not lose them
silently: ``close()`` raises naming its feed, and the target holds exactly the epochs
committed; a producer that calls ``feed.close()`` after the failure gets ``StreamRewind``
and replays, every row exactly once; with no failure, the idle producer's last epoch is
closed by its poll thread and committed. The producer here is the driver itself (a feed
of ``rt.stream()`` in the test's process)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from examples.replayable_stream import ROWS_PER_BATCH, source_batch
from raysink import EpochFailedError, SinkRuntime, StreamFeed, StreamRewind
from raysink.testing import arm_fault
from tests.integration.real_targets import ParquetTarget
from tests.integration.stream_support import table_ids

pytestmark = pytest.mark.usefixtures("ray_session")


def _runtime(tmp_path: Path, name: str) -> SinkRuntime:
    return SinkRuntime(name, ParquetTarget(tmp_path / "table").sink(), writers=2,
                       metastore=f"sqlite:///{tmp_path / 'meta.db'}", progress=False,
                       checkpoint_interval=0.3, feed_timeout=3.0, commit_timeout=20.0)


def _await(condition: Any, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout:g} s: {what}"
        time.sleep(0.05)


def _ids(batches: list[int]) -> list[int]:
    return sorted(i for b in batches for i in range(b * ROWS_PER_BATCH, (b + 1) * ROWS_PER_BATCH))


def _write(feed: StreamFeed, batch: int, epochs: dict[int, int]) -> int:
    """Write ``batch`` of producer 0's log; note the epoch it went into."""
    noted: list[int] = []
    feed.write(source_batch(0, batch), on_sent=noted.append)
    epochs[batch] = noted[0]
    return noted[0]


def _fail_the_epoch_of_batch_1(rt: SinkRuntime, name: str, feed: StreamFeed,
                               epochs: dict[int, int]) -> None:
    """Batch 0 is committed; batch 1 goes into an epoch whose seal fails (a writer's
    pre-commit raises); the stream rewinds while the producer makes no call."""
    first = _write(feed, 0, epochs)
    _await(lambda: (rt.status().last_committed_epoch or -1) >= first, "batch 0 committed")
    stream = rt._stream
    assert stream is not None
    arm_fault(name, "writer.after_pre_commit", action="raise")
    _write(feed, 1, epochs)
    _await(lambda: bool(stream.failures), "the epoch of batch 1 failed")
    _await(lambda: stream._record.rewinds >= 1, "the stream rewound")
    time.sleep(1.0)  # a few ticks more: the producer stays idle through them


def test_an_idle_producer_whose_epoch_failed_makes_close_raise_naming_its_feed(
        tmp_path: Path, name: str) -> None:
    """Before: ``close()`` returned and batch 1 was gone, nobody told (the rewind had cut
    the producer, so the drain found no member and ended the stream)."""
    target = ParquetTarget(tmp_path / "table")
    rt = _runtime(tmp_path, name).start()
    epochs: dict[int, int] = {}
    try:
        feed = rt.stream(poll_interval=0.1)
        _fail_the_epoch_of_batch_1(rt, name, feed, epochs)
    except BaseException:
        rt.close()
        raise
    polls = _poll_threads(feed)
    assert polls, "the idle feed's poll thread"
    with pytest.raises(EpochFailedError, match=rf"feed {feed.id}\b.*replay") as failed:
        rt.close()
    assert f"epoch {epochs[1]}" in str(failed.value)
    assert table_ids(target) == _ids([0])  # exactly the committed epochs
    # its coordinator is gone: polling it on (for the feed's timeout) would outlive the
    # test, and a poll after ray.shutdown() ends the process (a CI worker, once)
    _await(lambda: not any(t.is_alive() for t in polls), "the poll thread ended",
           timeout=15.0)


def _poll_threads(feed: StreamFeed) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == f"raysink-stream-{feed.id}"]


def test_a_producer_closing_after_its_epoch_failed_gets_the_rewind_and_replays(
        tmp_path: Path, name: str) -> None:
    """Before: ``feed.close()`` returned (its part was closed by the poll thread, so it
    had nothing to close) and the rewind was never told."""
    target = ParquetTarget(tmp_path / "table")
    epochs: dict[int, int] = {}
    with _runtime(tmp_path, name).start() as rt:
        feed = rt.stream(poll_interval=0.1)
        _fail_the_epoch_of_batch_1(rt, name, feed, epochs)
        with pytest.raises(StreamRewind) as rewind:
            feed.close()
        committed = rewind.value.committed
        assert committed is not None and epochs[0] <= committed < epochs[1]
        for batch in sorted(b for b, e in epochs.items() if e > committed):
            _write(feed, batch, epochs)  # the replay
        feed.close()
    assert table_ids(target) == _ids([0, 1])


def test_a_producer_that_replays_while_close_waits_for_it_is_drained_exactly_once(
        tmp_path: Path, name: str) -> None:
    """``rt.close()`` waits for the producer owing a replay; the producer's next call
    (here ``feed.close()``, meanwhile) raises ``StreamRewind``; it replays, and the drain
    takes its rows into the last epoch."""
    target = ParquetTarget(tmp_path / "table")
    rt = _runtime(tmp_path, name).start()
    epochs: dict[int, int] = {}
    closed: list[BaseException | None] = []

    def close() -> None:
        try:
            rt.close()
            closed.append(None)
        except BaseException as exc:
            closed.append(exc)

    closer = threading.Thread(target=close, daemon=True)
    try:
        feed = rt.stream(poll_interval=0.1)
        _fail_the_epoch_of_batch_1(rt, name, feed, epochs)
        closer.start()
        time.sleep(0.5)  # the drain waits for feed 1
        with pytest.raises(StreamRewind) as rewind:
            feed.close()
        committed = rewind.value.committed
        assert committed is not None
        for batch in sorted(b for b, e in epochs.items() if e > committed):
            feed.write(source_batch(0, batch))  # the replay
        feed.close()
    finally:
        closer.join(60.0)
        if not closed:
            rt.close()
    assert closed == [None], f"rt.close(): {closed}"
    assert table_ids(target) == _ids([0, 1])


def test_an_idle_producer_with_no_failure_is_drained_by_its_poll_thread(
        tmp_path: Path, name: str) -> None:
    target = ParquetTarget(tmp_path / "table")
    with _runtime(tmp_path, name).start() as rt:
        feed = rt.stream(poll_interval=0.1)
        _write(feed, 0, {})
        time.sleep(0.5)  # idle: no close, no write; rt.close() drains it
    assert table_ids(target) == _ids([0])
