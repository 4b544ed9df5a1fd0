"""Continuous streams: ``feed = rt.stream()``, then ``feed.write(...)`` forever.

The driver's ``StreamController`` ticks every ``checkpoint_interval`` seconds: the
coordinator fixes the current epoch's members and gives each its barrier (its own
``BarrierInjector``); every epoch then commits on its own, as an ``EpochHandle`` does,
while the producers already write the next one. ``rt.close()`` ticks once more with
``DRAIN``: the producers close their last epoch, it commits, the stream ends (further
writes are a ``ConfigError``), and the writers close.

A ``StreamFeed`` polls the coordinator every ``poll_interval`` seconds from a thread:
the poll is its heartbeat and brings its barrier, which it applies at its next batch
boundary (or at once, from the poll, when it is idle). When an epoch fails (a producer
lost, a sink down past the retries), the stream *rewinds*: everything after the last
committed epoch is dropped and each producer's next ``write`` raises ``StreamRewind``.

The contract for producers: the producer owns its source offsets. It notes, durably and
per epoch, where in its source its writes into that epoch ended: in the ``on_sent``
callback of ``feed.write(data, on_sent=...)``, which gets the epoch the data went into
and runs before that epoch's part can be closed (noted after ``write`` returned, a crash
in between could leave a committed batch unnoted). On ``StreamRewind(committed=C)`` it
drops its notes for the epochs after ``C`` and seeks to where its writes into epochs up
to ``C`` ended. A producer that restarts does the same with ``C = feed.committed()``
(its first poll: after a restart that forced a rewind, it returns once the rewind
happened). ``C`` is the producer's *cut*: the last epoch committed when its later writes
were dropped, which the stream keeps telling it until it applied the rewind (other
producers' epochs may commit meanwhile). A source that cannot replay loses the rows of a
failed epoch: that is at-most-once, not raysink's guarantee.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from raysink._calls import get, short
from raysink.coordinator.barrier import BarrierFlags, CheckpointBarrier
from raysink.coordinator.stream import StreamPosition, StreamTick
from raysink.errors import ConfigError, EpochFailedError, StreamRewind
from raysink.feeds import Feed, FeedRoute
from raysink.handle import seal_writers, wait_for_feeds

if TYPE_CHECKING:
    from raysink._epoch import EpochDriver
    from raysink.actors.lifecycle import ActorSet
    from raysink.reports import EpochReport

__all__ = ["StreamController", "StreamFeed"]

log = logging.getLogger(__name__)


class StreamFeed:
    """A long-lived producer's feed of the runtime's stream (picklable; one per
    producer: its ``id`` numbers its messages)."""

    def __init__(self, route: FeedRoute, feed_id: int, poll_interval: float = 0.5) -> None:
        self.route, self.id, self.poll_interval = route, feed_id, poll_interval
        self._reset()

    def _reset(self) -> None:
        self._lock = threading.Lock()
        self._current: Feed | None = None
        self._seen: StreamPosition | None = None  # the newest poll
        self._barrier: tuple[CheckpointBarrier, int] | None = None  # claimed, not applied
        self._rewinds: int | None = None
        self._stop: threading.Event | None = None
        self._joined = False  # polled once from this process
        self.last_epoch: int | None = None  # the epoch the last write went into

    def __getstate__(self) -> dict[str, Any]:
        return {"route": self.route, "id": self.id, "poll_interval": self.poll_interval}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._reset()

    def __repr__(self) -> str:
        return f"StreamFeed({self.route.runtime!r}, id={self.id}, last_epoch={self.last_epoch})"

    def committed(self) -> int | None:
        """The last epoch every target holds, or, with a rewind not yet applied, this
        producer's cut (a restarted producer resumes after it; its first call returns
        once the rewind its restart forces has happened)."""
        position = self._poll()
        return None if position is None else position.committed

    def write(self, data: pa.Table | pa.RecordBatch | Sequence[Any], *,
              on_sent: Callable[[int], object] | None = None) -> int:
        """Send data into the stream's current epoch; returns the rows sent. ``on_sent``
        gets that epoch before the epoch's part can be closed: note your source offset
        there. Raises ``StreamRewind`` after a failed epoch (replay from its
        ``committed``)."""
        with self._lock:
            current = self._catch_up(raising=True)
            assert current is not None
            rows = current.write(data)
            self.last_epoch = current.epoch
            if on_sent is not None:
                on_sent(current.epoch)
            return rows

    def wait_committed(self, timeout: float = 300.0) -> None:
        """Block until the epoch of the last write is committed (a producer whose source
        ended calls it before it stops: until then a failed epoch may still need its
        rows). Raises ``StreamRewind`` when the stream rewinds meanwhile."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                self._catch_up(raising=True, start_epoch=False)
                seen = self._seen
                assert seen is not None
                if self.last_epoch is None or (
                        seen.committed is not None and seen.committed >= self.last_epoch):
                    return
            if time.monotonic() > deadline:
                raise EpochFailedError(
                    f"epoch {self.last_epoch} of the stream was not committed within "
                    f"{timeout:g} s", runtime=self.route.runtime, epoch=self.last_epoch)
            time.sleep(self.poll_interval)

    def close(self) -> None:
        """Leave the stream: the part of the current epoch written so far is closed with
        the epoch's barrier when the driver's next tick brings it (this waits for it)."""
        while True:
            with self._lock:
                if self._current is None:
                    break
                self._catch_up(raising=False)
            time.sleep(self.poll_interval)
        if self._stop is not None:
            self._stop.set()
        get(self.route.coordinator.stream_leave.remote(self.id))

    # ------------------------------------------------------------------ the position

    def _poll(self) -> StreamPosition | None:
        position: StreamPosition | None = get(self.route.coordinator.stream_poll.remote(
            self.id, not self._joined, self._rewinds))
        self._joined = True
        if self._stop is None:
            self._start_polling()
        if position is not None:
            self._seen = position
            if position.barrier is not None:
                self._barrier = (position.barrier, position.barrier_attempt)
        return position

    def _catch_up(self, *, raising: bool, start_epoch: bool = True) -> Feed | None:
        """Apply what the polls brought (under the lock): a rewind drops the epoch in
        progress (raising ``StreamRewind``), a barrier closes it; then the feed of the
        epoch to write."""
        if self._seen is None:
            self._poll()
        seen = self._seen
        if seen is None:
            raise ConfigError("the runtime has no stream; call rt.stream() on the driver")
        if self._rewinds is not None and seen.rewinds != self._rewinds:
            self._current, self._barrier = None, None
            self._rewinds = seen.rewinds
            if raising:
                raise StreamRewind(
                    f"an epoch of the stream failed; nothing after epoch {seen.committed} "
                    "is kept: replay your source from there and write on",
                    committed=seen.committed, epoch=seen.epoch, runtime=self.route.runtime)
        self._rewinds = seen.rewinds
        if self._barrier is not None:
            self._close_part(*self._barrier)
            self._barrier = None
        if self._current is None and raising and start_epoch:
            if seen.ended:
                raise ConfigError("the stream was drained (rt.close()); it takes no more data",
                                  runtime=self.route.runtime)
            self._current = Feed(self.route, epoch=seen.epoch, attempt=seen.attempt,
                                 feed_id=self.id, checkpoint_id=0)
        return self._current

    def _close_part(self, barrier: CheckpointBarrier, attempt: int) -> None:
        """Close this producer's part of ``barrier.epoch``: the barrier to the writers it
        sent data to; a member that wrote nothing in it closes an empty part."""
        current = self._current
        if current is not None and current.epoch == barrier.epoch:
            current.close(barrier.checkpoint_id)
            self._current = None
        else:
            get(self.route.coordinator.feed_closed.remote(barrier.epoch, attempt, self.id, {}))

    def _start_polling(self) -> None:
        stop = self._stop = threading.Event()

        def poll() -> None:
            while not stop.wait(self.poll_interval):
                try:
                    self._poll()
                except Exception as exc:  # the coordinator restarting: poll again
                    log.debug("%r: poll failed: %s", self, exc)
                    continue
                if self._barrier is not None and self._lock.acquire(blocking=False):
                    try:  # idle: close the epoch from here
                        self._catch_up(raising=False)
                    except Exception as exc:
                        log.warning("%r: closing its epoch: %s", self, short(exc))
                    finally:
                        self._lock.release()

        threading.Thread(target=poll, daemon=True, name=f"raysink-stream-{self.id}").start()


class StreamController:
    """The driver's side of the stream: ticks, commits each epoch, rewinds on failure."""

    def __init__(self, driver: EpochDriver, actors: ActorSet, *, interval: float,
                 feed_timeout: float, commit_timeout: float) -> None:
        self._driver, self._actors = driver, actors
        self.interval = interval
        self._feed_timeout, self._commit_timeout = feed_timeout, commit_timeout
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.reports: list[EpochReport] = []
        self.failures: list[str] = []
        self._ids = 0

    def start(self) -> None:
        get(self._actors.coordinator.stream_start.remote(self._commit_timeout))
        self._thread = threading.Thread(target=self._loop, daemon=True,
                                        name="raysink-stream-ticks")
        self._thread.start()

    def next_feed_id(self) -> int:
        self._ids += 1
        return self._ids

    def drain(self) -> None:
        """Stop ticking; one last ``DRAIN`` tick closes and commits the last epoch."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._epoch(drain=True)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self._epoch(drain=False)
            except Exception as exc:  # keep ticking: the next epoch may well commit
                log.warning("stream tick failed: %s", short(exc))

    def _epoch(self, *, drain: bool) -> None:
        tick: StreamTick | None = get(self._actors.coordinator.stream_tick.remote(
            self._driver.next_checkpoint(), drain))
        if tick is None:
            return
        started = time.monotonic()
        state = wait_for_feeds(self._actors, tick.epoch, tick.attempt, list(tick.members),
                               timeout=self._commit_timeout, lease=self._feed_timeout)
        if state.lost or state.waiting:
            why = "; ".join(f"feed {f}: {w}" for f, w in sorted(state.lost.items())) or (
                f"feeds {list(state.waiting)} did not close in time")
            self._rewind(tick, why)
            return
        try:
            rows, outcome = self._driver.commit_barriers(
                self._actors, tick.epoch, tick.attempt,
                seal_writers(self._actors, self._barrier(tick), tick.attempt, state),
                tick.generation)
        except Exception as exc:
            if self._driver.recover_attempt(self._actors, tick.epoch, tick.attempt):
                self.reports.append(self._driver.settled(self._actors, tick.epoch, started))
                return
            self._rewind(tick, short(exc))
            return
        self.reports.append(self._driver.visible(tick.epoch, rows, started, outcome))

    @staticmethod
    def _barrier(tick: StreamTick) -> CheckpointBarrier:
        """The seal's barrier (the writers close on the runtime's DRAIN afterwards)."""
        return CheckpointBarrier(tick.checkpoint_id, tick.epoch, BarrierFlags.NONE)

    def _rewind(self, tick: StreamTick, why: str) -> None:
        """Give up the failed epoch and what the producers wrote after it; open it again;
        producers replay from the last committed epoch."""
        log.warning("stream epoch %s failed (%s); rewinding: producers replay from the "
                    "last committed epoch", tick.epoch, why)
        self.failures.append(f"epoch {tick.epoch}: {why}")
        self._actors.metrics.rewound()
        self._driver.give_up(self._actors, tick.epoch, tick.attempt)
        self._driver.give_up(self._actors, tick.epoch + 1, tick.next_attempt)
        if tick.drain:
            raise EpochFailedError(f"the stream's last epoch {tick.epoch} failed: {why}",
                                   epoch=tick.epoch)
        get(self._actors.coordinator.stream_rewind.remote(tick.epoch, self._commit_timeout))
