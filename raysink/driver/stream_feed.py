"""Continuous streams: ``feed = rt.stream()``, then ``feed.write(...)`` forever.

The driver ticks every ``checkpoint_interval`` seconds (``raysink.driver.stream_controller``): the
coordinator fixes the current epoch's members and gives each its barrier; every epoch
then commits on its own, as an ``EpochHandle`` does, while the producers already write the
next one. ``rt.close()`` ticks once more with ``DRAIN``: the producers close their last
epoch, it commits, the stream ends (further writes are a ``ConfigError``).

A ``StreamFeed`` polls the coordinator every ``poll_interval`` seconds from a thread: the
poll is its heartbeat and brings its barrier, which it applies at its next batch boundary
(or at once, from the poll, when it is idle). When an epoch fails, the stream *rewinds*:
everything after the last *decided* epoch is dropped and each producer's next ``write``
(or ``wait_committed``, or ``close``) raises ``StreamRewind``; only the producer's own
calls apply a rewind, never its poll thread.

The contract for producers: the producer owns its source offsets. It notes, durably and
per epoch, where in its source its writes into that epoch ended: in the ``on_sent``
callback of ``feed.write(data, on_sent=...)``, which gets the epoch the data went into
and runs before that epoch's part can be closed (noted after ``write`` returned, a crash
in between could leave a committed batch unnoted). On ``StreamRewind(committed=C)`` it
drops its notes for the epochs after ``C`` and seeks to where its writes into epochs up
to ``C`` ended. A producer that restarts does the same with ``C = feed.committed()``
(its first poll: after a restart that forced a rewind, it returns once the rewind
happened); a restarted producer that writes without asking gets ``StreamRewind`` at its
first write. ``C`` is the producer's *cut*: the last epoch decided (committed, or
decided and still committing: a decided epoch is never given up) when its later writes
were dropped, which the stream keeps telling it until it wrote again (other producers'
epochs may commit meanwhile). A source that cannot replay loses the rows of a failed
epoch: that is at-most-once, not raysink's guarantee.

A producer that goes idle (no more calls) is still told: its poll thread closes its
parts, and a rewind that dropped what it wrote reaches it at its next call, ``close``
included (with no part open, ``close`` raises ``StreamRewind`` when the rewind dropped
an epoch this process wrote into; replay, then close). A producer that makes no call at
all after such a rewind *owes a replay*: its polls report the last epoch it wrote into,
and ``rt.close()`` does not end the stream over it. The drain waits up to
``feed_timeout`` for it to replay, then raises ``EpochFailedError`` naming its feed and
the epochs given up; the target holds exactly the epochs committed. Rows a rewind
dropped are never lost silently: call ``feed.write`` or ``feed.close`` before
``rt.close()`` (and replay on ``StreamRewind``), or open the runtime again and resume
from ``feed.committed()``.

What the runtime does meanwhile, and guarantees:

- a writer killed (Ray restarts it, empty) or replaced (the runtime re-creates it, on a
  lost node say): the epochs it held data of fail and the stream rewinds; a producer
  whose send to it failed reports its part lost and its call raises ``StreamRewind``
  once the stream rewound (never Ray's error); producers then send to the writers as
  they are now (the route comes with their next poll);
- the coordinator lost: the driver re-creates it (or Ray restarts it) and hands the
  stream over to it; the producers find it by its name, and every one rewinds to the
  last epoch decided before the loss (undecided epochs were lost with it);
- ``rt.rescale()`` while a stream runs is refused (``RescaleRefusedError``): producers
  route by the layout they joined with at every moment. Rescale between streams: close
  the runtime, open it with ``writers=N``, start the stream again (producers resume from
  ``feed.committed()``).

Every epoch is committed exactly once: its rows reach every target once, whatever of the
above happens, provided producers follow the contract.

Nothing waits for ever, and only raysink errors come out: ``close`` waits for its barrier
up to a deadline (the runtime's options give the default), then names what held it (no
tick, the coordinator or a writer silent). A call is sent again only while the
coordinator cannot be reached; one that raised there is a fault and would fail again. A
poll thread that dies (its polls failing ``_POLL_FAILURES`` times in a row, or anything
else) is raised by the producer's next call, which polls anew: a producer that learns of
it late would otherwise wait for barriers that no poll brings.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NoReturn, TypeVar

import pyarrow as pa

from raysink.coordinator.stream_state import StreamPosition
from raysink.driver.calls import public_error, result, short, unreachable
from raysink.driver.feed import Feed, FeedRoute
from raysink.errors import (
    ConfigError,
    EpochFailedError,
    RaySinkError,
    RuntimeUnavailableError,
    StreamRewind,
)
from raysink.protocol.barrier import CheckpointBarrier
from raysink.protocol.clients import Call, CoordinatorClient

__all__ = ["StreamFeed", "stop_polls"]

log = logging.getLogger(__name__)
R = TypeVar("R")

_POLL_FAILURES = 5
"""Polls failing in a row (each after the coordinator answered with an error, or after
``timeout`` unreachable) that end the poll thread: the producer's next call raises."""


_POLLING: weakref.WeakSet[StreamFeed] = weakref.WeakSet()
"""This process's feeds whose poll thread runs (``stop_polls``), under ``_POLLING_LOCK``:
poll threads leave it while ``stop_polls`` looks through it."""
_POLLING_LOCK = threading.Lock()


def stop_polls(runtime: str) -> int:
    """End the poll threads of ``runtime``'s feeds in this process (``rt.close()`` of the
    runtime here: its coordinator is gone, and a poll would call it again and again for
    ``timeout``, past a ``ray.shutdown()`` that then ends the process). A producer's next
    call polls anew. How many were told to stop."""
    told = 0
    with _POLLING_LOCK:
        feeds = list(_POLLING)
    for feed in feeds:
        stop = feed._stop
        if feed.route.runtime == runtime and stop is not None:
            feed._stop = None  # detached: the producer's next poll starts a new thread
            stop.set()
            told += 1
    return told


class StreamFeed:
    """A long-lived producer's feed of the runtime's stream (picklable; one per
    producer: its ``id`` numbers its messages). ``route_number``: the number of the
    route (writers) it was given; ``timeout``: how long a call waits for the runtime
    (the coordinator replaced, the stream rewinding after a failed send)."""

    def __init__(self, route: FeedRoute, feed_id: int, poll_interval: float = 0.5, *,
                 route_number: int = 0, timeout: float = 300.0) -> None:
        self.route, self.id, self.poll_interval = route, feed_id, poll_interval
        self.route_number, self.timeout = route_number, timeout
        self._reset()

    def _reset(self) -> None:
        self._lock = threading.Lock()  # the producer's calls, and the poll thread's closes
        self._poll_lock = threading.Lock()  # one poll at a time: answers in order
        self._current: Feed | None = None
        self._seen: StreamPosition | None = None  # the newest poll
        self._barrier: tuple[CheckpointBarrier, int] | None = None  # claimed, not applied
        self._raised: int | None = None  # the rewinds this process was told of
        self._applied: int | None = None  # ... and wrote again after (what polls say)
        self._broken: str | None = None  # a part lost (a failed send): await the rewind
        self._stop: threading.Event | None = None
        self._joined = False  # polled once from this process
        self._answered: float | None = None  # when the coordinator last answered a poll
        self._poll_error: str | None = None  # the last poll's failure, while they fail
        self._died: BaseException | None = None  # why the poll thread ended, not told yet
        self._closing: str | None = None  # a part being closed (what close waits for)
        self._drained: int | None = None  # the epoch of a part closed by the drain's barrier
        self.last_epoch: int | None = None  # the epoch the last write went into

    def __getstate__(self) -> dict[str, Any]:
        return {"route": self.route, "id": self.id, "poll_interval": self.poll_interval,
                "route_number": self.route_number, "timeout": self.timeout}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._reset()

    def __repr__(self) -> str:
        return f"StreamFeed({self.route.runtime!r}, id={self.id}, last_epoch={self.last_epoch})"

    def committed(self) -> int | None:
        """Where to resume: the last epoch decided (every target holds it, or will), or,
        with a rewind not yet applied, this producer's cut (a restarted producer resumes
        after it; its first call returns once the rewind its restart forces happened)."""
        with self._guarded("committed()"), self._lock:
            position = self._position(fresh=True)
            if self._raised is None:
                self._raised = position.rewinds  # told where to resume
            return position.committed

    def write(self, data: pa.Table | pa.RecordBatch | Sequence[Any], *,
              on_sent: Callable[[int], object] | None = None) -> int:
        """Send data into the stream's current epoch; returns the rows sent. ``on_sent``
        gets that epoch before the epoch's part can be closed: note your source offset
        there. Raises ``StreamRewind`` after a failed epoch or a failed send (replay from
        its ``committed``); raysink errors only (a fault in an actor: ``EpochFailedError``,
        its epoch failed, the error its cause)."""
        with self._guarded("write()"), self._lock:
            current = self._catch_up(raising=True)
            assert current is not None
            try:
                rows = current._write(data)
            except _ray_errors() as exc:
                self._lose_part(current, f"a send failed: {short(exc)}")
                if not unreachable(exc):  # the same send fails the same way: not replayed
                    raise self._public(exc, f"writing into epoch {current.epoch}") from exc
                self._raise_rewind()
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
            with self._guarded("wait_committed()"), self._lock:
                self._catch_up(raising=True, start_epoch=False)
                seen = self._position(fresh=True)
                if self.last_epoch is None or (
                        seen.visible is not None and seen.visible >= self.last_epoch):
                    return
            if time.monotonic() > deadline:
                raise EpochFailedError(
                    f"epoch {self.last_epoch} of the stream was not committed within "
                    f"{timeout:g} s", runtime=self.route.runtime, epoch=self.last_epoch)
            time.sleep(self.poll_interval)

    def close(self, timeout: float | None = None) -> None:
        """Leave the stream: the part of the current epoch written so far is closed with
        the epoch's barrier when the driver's next tick brings it (this waits for it, up
        to ``timeout`` seconds: by default the feed's ``timeout``, from the runtime's
        ``commit_timeout`` and ``feed_timeout``). Raises ``StreamRewind`` when the stream
        rewound first: replay, then close; ``RuntimeUnavailableError`` naming what held
        it past the deadline (no barrier: the driver's stream not ticking; the
        coordinator or the writers not answering). With no part open (its poll thread
        closed the last), a rewind that dropped an epoch this process wrote into still
        raises ``StreamRewind``: leaving would lose those rows. Once the stream was
        drained (``rt.close()``), it returns at once: whether the drained epoch
        committed is ``rt.close()``'s to say (it raises naming this feed if not)."""
        wait = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + wait
        with self._guarded("close()"):
            while True:
                if not self._lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
                    self._stalled(wait)
                try:
                    if self._current is None:
                        leave = not self._stream_ended()
                        if leave:
                            self._check_dropped()
                        break
                    self._catch_up(raising=True, start_epoch=False)
                finally:
                    self._lock.release()
                if time.monotonic() > deadline:
                    self._stalled(wait)
                self._check_polling()
                if self._stop is None:  # no poll thread (it died): the barrier comes by one
                    self._poll()
                time.sleep(self.poll_interval)
            if self._stop is not None:
                self._stop.set()
            if leave:
                self._call(lambda c: c.stream_leave(self.id), deadline=deadline)

    def _stream_ended(self) -> bool:
        """Whether the stream ended for this process: its last part was closed by the
        drain's barrier, or a poll said the stream was drained. Nothing is left to leave
        then, and ``rt.close()`` may have stopped the coordinator already: ``close``
        returns without a call (the drained epoch's outcome is ``rt.close()``'s to tell:
        it raises naming this feed if that epoch fails and this process does not
        replay)."""
        return self._drained is not None or (self._seen is not None and self._seen.ended)

    def _check_dropped(self) -> None:
        """At ``close`` with no part open (its poll thread closed the last one): raise
        ``StreamRewind`` when a rewind it was not told of dropped what this process
        wrote (or a part was lost, or this process is new and has a cut): leaving
        instead would lose those rows silently."""
        seen = self._position(fresh=True)
        if self._broken is None and (seen.rewinds == self._raised or (
                self._raised is not None and not self._dropped(seen))):
            self._raised = seen.rewinds  # nothing of this process's was dropped
            return
        if self._raised is None and not seen.rewound:
            return  # a new process with nothing to replay
        self._raise_rewind()

    def _dropped(self, seen: StreamPosition) -> bool:
        """Whether the cut ``seen`` brings dropped an epoch this process wrote into."""
        return seen.rewound and self.last_epoch is not None and (
            seen.committed is None or self.last_epoch > seen.committed)

    def _wrote(self) -> int | None:
        """What polls report: the last epoch this process wrote into, or writes now."""
        current, last = self._current, self.last_epoch
        epochs = [e for e in (last, None if current is None else current.epoch)
                  if e is not None]
        return max(epochs) if epochs else None

    # ------------------------------------------------------------------ errors

    @contextlib.contextmanager
    def _guarded(self, what: str) -> Iterator[None]:
        """A public call: what the poll thread died of first, then raysink errors only
        (a fault in an actor: ``EpochFailedError``, the error its cause)."""
        try:
            self._check_polling()
            yield
        except RaySinkError:
            raise
        except Exception as exc:
            raise self._public(exc, what) from exc

    def _public(self, exc: BaseException, what: str) -> RaySinkError:
        return public_error(exc, what=f"{self!r}: {what}", runtime=self.route.runtime,
                            kind=EpochFailedError,
                            then="the stream rewinds: replay your source from "
                                 "feed.committed() and write on")

    def _check_polling(self) -> None:
        """Raise, once, what ended the poll thread (the next call polls again)."""
        died, self._died = self._died, None
        if died is None:
            return
        self._stop = None  # the next poll starts a new thread
        raise RuntimeUnavailableError(
            f"{self!r}: its poll of the coordinator (its heartbeat, and how its barriers "
            f"come) ended: {short(died)}. Its part of the current epoch may be lost: "
            "replay your source from feed.committed() and write on (a new poll starts); "
            "if this repeats, check the runtime (rt.status())",
            runtime=self.route.runtime, epoch=self.last_epoch) from died

    def _stalled(self, wait: float) -> NoReturn:
        """``RuntimeUnavailableError`` for a close held past its deadline, naming what
        holds it."""
        current = self._current
        epoch = current.epoch if current is not None else self.last_epoch
        if self._closing is not None:
            why = (f"{self._closing} did not finish: a writer it sent data to, or the "
                   "coordinator, does not answer")
        elif self._poll_error is not None:
            why = (f"the coordinator does not answer its polls (last: {self._poll_error}), "
                   "so the epoch's barrier cannot come")
        else:
            ago = ("never" if self._answered is None
                   else f"{time.monotonic() - self._answered:.1f} s ago")
            why = (f"the barrier of epoch {epoch} did not come (the coordinator last "
                   f"answered a poll {ago}): the driver's stream is not ticking; is the "
                   "runtime still open, its driver alive (rt.close() drains the stream)?")
        raise RuntimeUnavailableError(
            f"{self!r}: close() waited {wait:g} s: {why}. Nothing written after the last "
            "committed epoch is kept unless the stream commits it: replay from "
            "feed.committed() once it runs again", runtime=self.route.runtime, epoch=epoch)

    # ------------------------------------------------------------------ the position

    def _catch_up(self, *, raising: bool, start_epoch: bool = True) -> Feed | None:
        """Apply what the polls brought (under the lock): a rewind, or a part lost,
        drops the epoch in progress and raises ``StreamRewind`` (only with ``raising``:
        the poll thread leaves it to the producer); a barrier closes the part; then the
        feed of the epoch to write (joining the stream first when not a member)."""
        seen = self._position()
        if self._raised is None and not seen.rewound:
            self._raised = seen.rewinds  # a new process with nothing to replay
        if self._broken is not None or seen.rewinds != self._raised:
            if not raising:
                return None
            self._raise_rewind()
        if self._barrier is not None and not self._close_claimed():
            if not raising:
                return None
            self._raise_rewind()
        if self._current is not None or not (raising and start_epoch):
            return self._current
        return self._start_part(seen)

    def _start_part(self, seen: StreamPosition) -> Feed:
        """The feed of the epoch to write; joins first (a poll with every rewind it was
        told of applied: it writes again) when not a member."""
        self._applied = self._raised
        if not seen.member:
            seen = self._join()
            if seen.rewinds != self._raised:
                self._raise_rewind()
        if seen.ended:
            raise ConfigError("the stream was drained (rt.close()); it takes no more data",
                              runtime=self.route.runtime)
        if not seen.member:
            raise ConfigError(f"{self!r} left the stream (close()); it takes no more data",
                              runtime=self.route.runtime)
        self._current = Feed(self.route, epoch=seen.epoch, attempt=seen.attempt,
                             feed_id=self.id, checkpoint_id=0)
        return self._current

    def _join(self) -> StreamPosition:
        """Poll until a coordinator that knows the stream answers (a successor taking the
        stream over after the coordinator's loss knows it only once the driver handed
        it over)."""
        deadline = time.monotonic() + self.timeout
        while True:
            seen = self._poll()
            if seen is not None:
                return seen
            if time.monotonic() > deadline:
                raise EpochFailedError(
                    f"{self!r} could not join the stream within {self.timeout:g} s: is the "
                    "driver's stream still ticking?", runtime=self.route.runtime)
            time.sleep(self.poll_interval)

    def _raise_rewind(self) -> NoReturn:
        """Drop the part in progress and raise ``StreamRewind`` with this producer's cut,
        once the stream rewound (after a lost part: waiting for the rewind it forces)."""
        seen = self._position()
        if self._broken is not None and seen.rewinds == self._raised:
            seen = self._await_rewind()
        self._current, self._barrier, self._broken = None, None, None
        self._raised = seen.rewinds
        raise StreamRewind(
            f"an epoch of the stream failed; nothing after epoch {seen.committed} is "
            "kept: replay your source from there and write on", committed=seen.committed,
            epoch=seen.epoch, runtime=self.route.runtime)

    def _await_rewind(self) -> StreamPosition:
        """Poll until the stream rewound (the driver rewinds it after the lost part)."""
        deadline = time.monotonic() + self.timeout
        while True:
            seen = self._poll()
            if seen is not None and seen.rewinds != self._raised:
                return seen
            if seen is not None and seen.ended:
                raise ConfigError(f"the stream was drained (rt.close()) after {self!r} "
                                  f"lost its part ({self._broken}): those rows are not "
                                  "kept", runtime=self.route.runtime)
            if time.monotonic() > deadline:
                raise EpochFailedError(
                    f"{self!r} lost its part ({self._broken}), and the stream did not "
                    f"rewind within {self.timeout:g} s: is the driver's stream still "
                    "ticking?", runtime=self.route.runtime)
            time.sleep(self.poll_interval)

    def _lose_part(self, current: Feed, why: str) -> None:
        """A send of the part failed (a writer restarted or replaced, the coordinator
        lost): it is given up; the epoch fails and the stream rewinds."""
        log.warning("%r: %s; its part of epoch %s is lost, waiting for the stream to "
                    "rewind", self, why, current.epoch)
        self._broken, self._current = why, None
        current.cancel(why)

    def _close_claimed(self) -> bool:
        """Close this producer's part of the claimed barrier's epoch: the barrier to the
        writers it sent data to; a member that wrote nothing in it closes an empty part.
        False when that failed (the part is lost)."""
        assert self._barrier is not None
        (barrier, attempt), self._barrier = self._barrier, None
        current = self._current
        self._closing = f"closing its part of epoch {barrier.epoch}"
        try:
            if current is not None and current.epoch == barrier.epoch:
                current._close(barrier.checkpoint_id)
                self._current = None
            else:
                self._call(lambda c: c.feed_closed(barrier.epoch, attempt, self.id, {}))
            if barrier.is_drain:
                self._drained = barrier.epoch
        except _ray_errors() as exc:
            if current is not None:
                self._lose_part(current, f"closing epoch {barrier.epoch}: {short(exc)}")
            else:
                self._broken = f"closing epoch {barrier.epoch}: {short(exc)}"
            return False
        finally:
            self._closing = None
        return True

    def _position(self, fresh: bool = False) -> StreamPosition:
        """The newest poll (``fresh``: a new one), waiting while the coordinator has no
        stream (a successor the driver has not handed it to yet)."""
        deadline = time.monotonic() + self.timeout
        seen = self._seen
        while fresh or seen is None:
            fresh = False
            seen = self._poll() or self._seen
            if seen is None:
                if time.monotonic() > deadline:
                    raise ConfigError("the runtime has no stream: call rt.stream() on the "
                                      "driver (or it ended with rt.close())",
                                      runtime=self.route.runtime)
                time.sleep(self.poll_interval)
        return seen

    def _poll(self, stop: threading.Event | None = None) -> StreamPosition | None:
        with self._poll_lock:
            seen = None if self._seen is None else self._seen.rewinds
            wrote = self._wrote()  # after ``seen``: a later write raises StreamRewind
            position = self._call(lambda c: c.stream_poll(
                self.id, not self._joined, self._applied, self.route_number, wrote, seen),
                stop=stop)
            if position is not None:
                # joined only once a coordinator that knows the stream answered (a
                # successor taking the stream over knows it a moment later)
                self._joined = True
                self._answered, self._poll_error = time.monotonic(), None
                if position.writers is not None:
                    self.route = dataclasses.replace(self.route, writers=position.writers)
                    self.route_number = position.route
                self._seen = position
                if position.barrier is not None:
                    self._barrier = (position.barrier, position.barrier_attempt)
            if self._stop is None:
                self._start_polling()
        return position

    def _call(self, make: Callable[[CoordinatorClient], Call[R]],
              deadline: float | None = None, stop: threading.Event | None = None) -> R:
        """A call to the coordinator (``make`` picks it); one that is gone, restarting or
        silent is looked up again by name (the driver replaces it), up to ``deadline``
        (default: ``timeout`` from now). A call the coordinator ran and that raised is
        not sent again: it would fail the same way (a raysink error passes as itself).
        ``stop`` (the poll thread's) set: no further look-up."""
        if deadline is None:
            deadline = time.monotonic() + self.timeout
        while True:
            left = deadline - time.monotonic()
            try:
                return result(make(self.route.coordinator_client), timeout=max(0.1, left))
            except _ray_errors() as exc:
                if not unreachable(exc):
                    raise self._public(exc, "a call to the coordinator") from exc
                if time.monotonic() >= deadline or (stop is not None and stop.is_set()):
                    raise RuntimeUnavailableError(
                        f"{self!r}: the coordinator did not answer within "
                        f"{self.timeout:g} s ({short(exc)}): is the runtime still open?",
                        runtime=self.route.runtime) from exc
                log.debug("%r: %s; looking the coordinator up", self, exc)
                self._relocate(deadline)

    def _relocate(self, deadline: float) -> None:
        """Look the coordinator up by name (the driver replaces a lost one), within
        ``deadline``."""
        from raysink.driver.lifecycle import find_coordinator

        handle = find_coordinator(self.route.runtime,
                                  wait=max(0.1, min(5.0, deadline - time.monotonic())))
        if handle is None:
            time.sleep(self.poll_interval)
            return
        self.route = dataclasses.replace(self.route, coordinator=handle)

    def _start_polling(self) -> None:
        stop = self._stop = threading.Event()
        with _POLLING_LOCK:
            _POLLING.add(self)

        def poll() -> None:
            try:
                self._poll_until(stop)
            except BaseException as exc:  # recorded: the producer's next call raises it
                if stop.is_set():  # told to stop meanwhile: nothing to tell
                    return
                log.error("%r: its poll thread died: %s", self, short(exc))
                self._died = exc
            finally:
                with _POLLING_LOCK:
                    _POLLING.discard(self)

        threading.Thread(target=poll, daemon=True, name=f"raysink-stream-{self.id}").start()

    def _poll_until(self, stop: threading.Event) -> None:
        """Poll every ``poll_interval`` until ``stop`` or the stream drained; close a
        claimed barrier's part when the producer is idle. A poll that fails was already
        sent again while the coordinator was unreachable (``_call``): ``_POLL_FAILURES``
        failures in a row end the thread with the last one (the producer's next call
        raises it)."""
        failures = 0
        while not stop.wait(self.poll_interval):
            try:
                seen = self._poll(stop)
            except Exception as exc:
                if stop.is_set():
                    raise
                failures += 1
                self._poll_error = short(exc)
                log.warning("%r: poll failed (%d in a row): %s", self, failures, short(exc))
                if failures >= _POLL_FAILURES or isinstance(exc, RuntimeUnavailableError):
                    raise
                continue
            failures = 0
            if seen is not None and seen.ended and self._barrier is None:
                return  # drained: nothing more to close
            if self._barrier is not None and self._lock.acquire(blocking=False):
                try:  # idle: close the epoch from here
                    self._catch_up(raising=False)
                except Exception as exc:
                    log.warning("%r: closing its epoch: %s", self, short(exc))
                finally:
                    self._lock.release()


def _ray_errors() -> type[Exception]:
    """Ray's errors of a call (an actor gone, restarting or unreachable); raysink's own
    errors (bad data, a drained writer) pass through."""
    from ray.exceptions import RayError

    return RayError
