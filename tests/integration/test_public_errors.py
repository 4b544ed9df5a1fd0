"""Every public door outside ``SinkRuntime``'s own methods raises raysink errors only:
``Feed.write``/``close``, ``EpochHandle.commit``/``abort``, the datasink's hooks and a
``StreamFeed``'s calls. An actor that cannot be reached is ``RuntimeUnavailableError``; a
fault in an actor (a bug: the same call fails the same way) is not retried; either way the
Ray error is the ``__cause__`` and the message says what to do. And nothing of the stream
waits for ever: ``StreamFeed.close`` has a deadline and names what held it; a poll or
tick thread that dies is told at the next call.

Before these, each door let Ray's ``ActorDiedError`` or ``RayTaskError`` through, a
stream feed sent a call that raised in the coordinator again for ``timeout`` (300 s), and
``close()`` waited for a barrier that never came as long as the process lived.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
import ray
from ray.exceptions import RayError

from raysink import SinkRuntime
from raysink.coordinator.stream_state import StreamPosition
from raysink.driver.feed import FeedRoute
from raysink.driver.stream_feed import StreamFeed
from raysink.errors import EpochFailedError, RaySinkError, RuntimeUnavailableError
from tests.integration.helpers import end_for_good, epoch_table
from tests.integration.real_targets import ParquetTarget

pytestmark = pytest.mark.usefixtures("ray_session")


def _runtime(tmp_path: Path, name: str, **options: Any) -> SinkRuntime:
    return SinkRuntime(name, ParquetTarget(tmp_path / "table").sink(), writers=2,
                       metastore=f"sqlite:///{tmp_path / 'meta.db'}", progress=False,
                       **options)


def _typed(error: BaseException, kind: type[RaySinkError], says: str) -> None:
    """``error`` is a raysink error of ``kind`` (not Ray's, nor a class of both),
    whose message says ``says``, with a Ray error behind it."""
    assert isinstance(error, kind), repr(error)
    assert not isinstance(error, RayError), repr(error)
    assert says in str(error), str(error)
    assert isinstance(error.__cause__, RayError), repr(error.__cause__)


def test_a_feed_whose_writer_is_gone_raises_runtime_unavailable(tmp_path: Path,
                                                                name: str) -> None:
    """Writer 0 ended for good while two feeds of an epoch are open: writes (once one
    is settled: a full credit window), and a close after a write, raise
    ``RuntimeUnavailableError`` (was: ``ActorDiedError``); the handle's ``abort`` then
    leaves nothing, and the epoch can be written again."""
    with _runtime(tmp_path, name) as rt:
        ep = rt.open_epoch()
        writing, closing = ep.feed(), ep.feed()
        closing.write(epoch_table(1, 100))
        end_for_good(rt, writer=0)
        with pytest.raises(RaySinkError) as wrote:  # raised once a send is settled
            for _ in range(100):
                writing.write(epoch_table(1, 100))
        _typed(wrote.value, RuntimeUnavailableError, "could not be reached")
        assert "open the epoch again and feed it again" in str(wrote.value)
        with pytest.raises(RaySinkError) as closed:
            closing.close()
        _typed(closed.value, RuntimeUnavailableError, "could not be reached")
        ep.abort()
        assert rt.write_arrow(epoch_table(1, 100), epoch=1).committed


@ray.remote(max_restarts=0)
class _BrokenCoordinator:
    """A coordinator whose stream calls raise (a bug in it): the same call fails the
    same way, however often it is sent."""

    def __init__(self) -> None:
        self.polls = 0

    def stream_poll(self, *args: Any) -> None:
        self.polls += 1
        raise ZeroDivisionError("a bug in the coordinator")

    def stream_leave(self, *args: Any) -> None:
        raise ZeroDivisionError("a bug in the coordinator")

    def count(self) -> int:
        return self.polls


@ray.remote(max_restarts=0)
class _FailingCoordinator:
    """A coordinator that answers a feed's first poll, then raises at every poll."""

    def __init__(self) -> None:
        self.polls = 0

    def stream_poll(self, *args: Any) -> StreamPosition:
        self.polls += 1
        if self.polls > 1:
            raise ZeroDivisionError("a bug in the coordinator")
        return StreamPosition(epoch=1, attempt=0, rewinds=0, committed=None)


def _route(coordinator: Any) -> FeedRoute:
    return FeedRoute(runtime="broken", writers={"main": []}, coordinator=coordinator,
                     key=None, bitmaps=(), max_batch_bytes=None, credits=1)


def _within(seconds: float, call: Any) -> BaseException:
    """Run ``call`` in a thread; what it raised, which it must within ``seconds``."""
    box: dict[str, BaseException] = {}

    def run() -> None:
        try:
            call()
        except BaseException as exc:
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still waiting after {seconds:g} s"
    assert "error" in box, "returned"
    return box["error"]


def test_a_stream_feed_does_not_retry_a_call_that_raised_in_the_coordinator() -> None:
    """A poll the coordinator ran and that raised is a bug, not an outage: the feed's
    call raises ``EpochFailedError`` at once, the ``RayTaskError`` its cause, after one
    poll (was: the same poll sent again for the feed's whole ``timeout``, 300 s)."""
    coordinator = _BrokenCoordinator.remote()  # type: ignore[attr-defined]
    feed = StreamFeed(_route(coordinator), 1, poll_interval=0.05, timeout=300.0)
    error = _within(20.0, feed.committed)
    _typed(error, EpochFailedError, "ZeroDivisionError: a bug in the coordinator")
    assert ray.get(coordinator.count.remote()) == 1
    ray.kill(coordinator)


def test_a_poll_thread_whose_polls_keep_failing_ends_and_the_next_call_raises() -> None:
    """The coordinator answers the feed's first poll, then every poll raises: the poll
    thread logs each failure and, after ``_POLL_FAILURES`` in a row, ends; the feed's
    next call raises ``RuntimeUnavailableError`` saying its poll ended, the last
    failure its cause (was: the thread swallowed every failure, and the call sent the
    failing poll again for 300 s)."""
    coordinator = _FailingCoordinator.remote()  # type: ignore[attr-defined]
    feed = StreamFeed(_route(coordinator), 1, poll_interval=0.05, timeout=300.0)
    assert feed.committed() is None  # the first poll: the thread starts
    time.sleep(2.0)  # the thread's polls fail (0.05 s apart)
    error = _within(20.0, feed.committed)
    assert isinstance(error, RuntimeUnavailableError), repr(error)
    assert "its poll of the coordinator" in str(error)
    assert isinstance(error.__cause__, EpochFailedError), repr(error.__cause__)
    assert "ZeroDivisionError" in str(error.__cause__)
    ray.kill(coordinator)


def test_a_stream_feed_whose_coordinator_is_gone_raises_within_its_deadline() -> None:
    """The coordinator ended for good (and no other takes its name): the feed's call
    raises ``RuntimeUnavailableError`` once its deadline passed (``close``'s own
    ``timeout``; the feed's for the others, not one look-up of the name past it), never
    Ray's error."""
    coordinator = _BrokenCoordinator.remote()  # type: ignore[attr-defined]
    ray.kill(coordinator)
    feed = StreamFeed(_route(coordinator), 1, poll_interval=0.05, timeout=3.0)
    for call in (feed.committed, lambda: feed.close(timeout=2.0)):
        started = time.monotonic()
        error = _within(30.0, call)
        _typed(error, RuntimeUnavailableError, "the coordinator did not answer")
        assert time.monotonic() - started < 4.5


class _TickKilled(BaseException):
    """Injected into the stream's tick thread: not an ``Exception``, so nothing on the
    way catches it."""


def test_a_dead_tick_thread_is_told_and_close_raises_within_its_deadline(
        tmp_path: Path, name: str) -> None:
    """The driver's tick thread dies of an injected ``BaseException`` while a producer
    has written into an epoch: ``feed.close()`` raises ``RuntimeUnavailableError``
    within the feed's deadline (here 4 s), naming the epoch whose barrier did not come
    (was: it waited for ever); ``rt.stream()`` raises the thread's death, the error its
    cause. Ticking again (a new thread), the same feed closes, and ``rt.close()`` commits
    what it wrote."""
    target = ParquetTarget(tmp_path / "table")
    rt = SinkRuntime(name, target.sink(), writers=2, progress=False,
                     metastore=f"sqlite:///{tmp_path / 'meta.db'}", checkpoint_interval=0.5)
    with rt:
        feed = rt.stream(poll_interval=0.1)
        stream = rt._stream
        assert stream is not None and stream._thread is not None
        tick = stream._tick

        def killed(*, drain: bool) -> None:
            raise _TickKilled("injected into the tick thread")

        stream._tick = killed  # type: ignore[method-assign]
        stream._thread.join(10)
        assert not stream._thread.is_alive(), "the tick thread did not die"
        feed.write(pa.table({"id": pa.array(range(10), pa.int64())}))
        written, feed.timeout = feed.last_epoch, 4.0
        started = time.monotonic()
        error = _within(30.0, feed.close)
        assert isinstance(error, RuntimeUnavailableError), repr(error)
        assert f"the barrier of epoch {written} did not come" in str(error)
        assert 3.5 < time.monotonic() - started < 15.0
        with pytest.raises(RuntimeUnavailableError, match="tick thread died") as told:
            rt.stream()
        assert isinstance(told.value.__cause__, _TickKilled)
        stream._tick = tick  # type: ignore[method-assign]
        stream.died = None
        stream._thread = threading.Thread(target=stream._loop, daemon=True)
        stream._thread.start()
        feed.close(timeout=60.0)
    assert sorted(target.ids()) == list(range(10))
