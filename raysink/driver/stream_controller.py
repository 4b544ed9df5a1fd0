"""The driver's side of the continuous stream (``rt.stream()``): ``StreamController``.

Every ``checkpoint_interval`` seconds it ticks (the coordinator fixes the current epoch's
members and hands each its barrier), waits until the members closed their parts, seals
the writers and has the epoch decided and committed, as an ``EpochHandle`` does, while
the producers write the next epoch. ``drain`` (``rt.close()``) ticks once more with
``DRAIN``.

What fails an epoch: a member lost (its producer reported a failed send, restarted, or
went silent past ``feed_timeout``); a writer restarted since the epoch began (its
mailbox starts empty: the epoch's data there is gone, and its seal would wait for
messages that never come; the writers' process ids are compared at every tick and while
the seal waits); an actor that stops answering; the coordinator lost or restarted; a
decision that could not be made. After any failure the controller recovers at once:

1. ``heal``: a coordinator or writer that is gone is replaced (Ray restarts a killed
   writer by itself);
2. the epoch in flight is resolved: decided, it rolls forward; otherwise it is given up at
   the coordinator and at the writers (CANCEL), and so is the epoch after it, which the
   members may be writing already;
3. ``stream_rewind`` at the current coordinator: the stream goes on from the first epoch
   after the last decided one, and every producer is cut there, with the writers'
   handles as they are now (producers whose sends failed take that route). A coordinator
   that does not know the stream (a successor) takes it over from the driver's record
   (``StreamState``: rewinds, cuts and route as of the last answer, feeds handed out).

A recovery that fails (the coordinator still restarting, say) is tried again before the
next tick: a failure never leaves the stream stuck.

The drain never ends the stream over rows a rewind dropped that nobody replays: a
producer cut by a rewind after writing into an epoch it dropped, that made no call since
(only its own calls apply a rewind: it was never told), *owes a replay*. ``drain`` waits
for such producers up to ``feed_timeout`` (their next call raises ``StreamRewind``, they
replay and the last epoch takes their rows), then raises ``EpochFailedError`` naming
them: ``rt.close()`` never returns over rows given up silently.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from raysink.coordinator.stream_state import Owed, StreamPosition, StreamState, StreamTick
from raysink.driver.calls import ask, result, short, watched
from raysink.driver.feed import FeedRoute
from raysink.driver.handle import seal_writers, wait_for_feeds
from raysink.driver.stream_feed import StreamFeed
from raysink.errors import EpochFailedError, RuntimeUnavailableError
from raysink.protocol.barrier import BarrierFlags, CheckpointBarrier
from raysink.protocol.clients import WriterClient

if TYPE_CHECKING:
    from raysink.driver.epoch import EpochDriver
    from raysink.driver.lifecycle import ActorSet
    from raysink.driver.runtime_options import RuntimeOptions
    from raysink.reports import EpochReport

__all__ = ["StreamController"]

log = logging.getLogger(__name__)

Pids = Mapping[tuple[str, int], int | None]

_PID_WAIT = 10.0  # seconds a writer may take to tell its process id at a tick
_DRAIN_TRIES = 3
_FEED_WAIT = 300.0  # seconds a producer's call waits for the runtime, at least


class StreamController:
    """The driver's side of the stream: ticks, commits each epoch, recovers after a
    failure (see the module docstring)."""

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
        self._record = StreamState()
        self._open = (0, 0)  # the first epoch not decided (producers write it) and attempt
        self._in_flight: StreamTick | None = None  # ticked, not decided yet
        self._given_up: dict[int, int] = {}  # epoch -> the highest attempt given up
        self._pids: Pids = {}  # the writers' processes when the epoch written now began
        self._routed: list[Any] = []  # the writer handles producers were last given
        self._unrecovered: str | None = None  # a failure whose recovery failed too
        self.died: BaseException | None = None  # what ended the tick thread, if anything

    @classmethod
    def begin(cls, driver: EpochDriver, actors: ActorSet,
              options: RuntimeOptions) -> StreamController:
        """The runtime's stream, started: an epoch every ``checkpoint_interval`` seconds."""
        stream = cls(driver, actors, interval=options.checkpoint_interval,
                     feed_timeout=options.feed_timeout, commit_timeout=options.commit_timeout)
        stream.start()
        return stream

    @property
    def route(self) -> int:
        """The number of the route (writers) producers are given now."""
        return self._record.route

    def start(self) -> None:
        position: StreamPosition = result(self._actors.coordinator_client.stream_start(
            self._commit_timeout))
        self._open = (position.epoch, position.attempt)
        self._routed = self._actors.all_writers()
        self._pids = self._writer_pids(_PID_WAIT)
        self._thread = threading.Thread(target=self._loop, daemon=True,
                                        name="raysink-stream-ticks")
        self._thread.start()

    def new_feed(self, route: FeedRoute, poll_interval: float) -> StreamFeed:
        """A feed of the stream for one more producer, sending by ``route`` (the writers
        now); its calls wait for the runtime as long as a commit and a lost feed may take
        (``_FEED_WAIT`` at least). ``RuntimeUnavailableError`` when the ticks stopped."""
        self._check_ticking()
        return StreamFeed(route, self.next_feed_id(), poll_interval, route_number=self.route,
                          timeout=max(_FEED_WAIT, 2 * self._commit_timeout + self._feed_timeout))

    def next_feed_id(self) -> int:
        self._ids += 1
        self._record = dataclasses.replace(self._record, feeds=self._ids)
        return self._ids

    def drain(self) -> None:
        """Stop ticking; one last ``DRAIN`` tick closes and commits the last epoch (after
        a failure, recovered and tried again: a coordinator lost meanwhile is replaced).

        The drain does not end the stream while a producer owes a replay (it wrote into
        an epoch a rewind dropped and made no call since, so it was never told:
        ``StreamBook.owed``): it waits up to ``feed_timeout`` for those producers to
        replay (their next call raises ``StreamRewind``), then raises
        ``EpochFailedError`` naming their feeds and the epochs given up."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self.died is not None and self._unrecovered is None:
            self._unrecovered = f"the tick thread died ({short(self.died)})"  # recover first
        failed, deadline = 0, None
        while True:
            if self._step(drain=True):
                owed: Owed = result(self._actors.coordinator_client.stream_owed(
                    self._feed_timeout))
                if owed.ended:
                    return
                if deadline is None:
                    deadline = time.monotonic() + self._feed_timeout
                    log.info("%s: the drain waits up to %g s for producers to replay what a "
                             "rewind dropped: owing %s, not heard from since their cut %s",
                             self._driver.name, self._feed_timeout,
                             [o.feed for o in owed.feeds], list(owed.unknown))
                if time.monotonic() > deadline and (
                        owed.feeds or time.monotonic() > deadline + self._feed_timeout):
                    raise self._owed_error(owed)
                time.sleep(min(0.2, self.interval))
                continue
            failed += 1
            if failed == _DRAIN_TRIES:
                raise EpochFailedError(f"the stream's last epoch could not be drained: "
                                       f"{self.failures[-1] if self.failures else '?'}",
                                       runtime=self._driver.name) from self.died

    def _owed_error(self, owed: Owed) -> EpochFailedError:
        """The drain's error when producers did not replay what a rewind dropped."""
        feeds = "; ".join(
            f"feed {o.feed}: wrote into epochs up to {o.wrote}, cut at "
            f"{'the start' if o.cut is None else f'epoch {o.cut}'}" for o in owed.feeds)
        unknown = f"feeds {list(owed.unknown)} not heard from since their cut" \
            if owed.unknown else ""
        first = min((0 if o.cut is None else o.cut + 1 for o in owed.feeds), default=None)
        return EpochFailedError(
            f"the stream was not drained: a failed epoch was given up and these producers "
            f"made no call since, so they were never told and did not replay "
            f"({'; '.join(x for x in (feeds, unknown) if x)}); their rows after the cut are "
            f"not in the target (the epochs given up from epoch {first} on). Each producer "
            "must call feed.write() or feed.close() before rt.close(): it gets "
            "StreamRewind and must replay from its committed; or open the runtime again "
            "and resume each producer from feed.committed()",
            runtime=self._driver.name, epoch=first)

    def _check_ticking(self) -> None:
        """``RuntimeUnavailableError`` (the thread's error its cause) when the tick thread
        died: no epoch of the stream is committed until the runtime is closed (its drain
        recovers the stream first) and opened again."""
        if self.died is not None:
            raise RuntimeUnavailableError(
                f"the stream's tick thread died ({short(self.died)}): no epoch is committed "
                "any more. Close the runtime (rt.close() recovers and drains the stream), "
                "open it again and start the stream again; producers resume from "
                "feed.committed()", runtime=self._driver.name) from self.died

    # ------------------------------------------------------------------ ticking

    def _loop(self) -> None:
        """Tick until ``drain``. A failure a step cannot handle (a ``BaseException``, a bug
        in the recovery) ends the thread: it is recorded (``died``, logged) and raised by
        the next ``new_feed``; producers' calls then time out naming the missing ticks."""
        try:
            while not self._stop.wait(self.interval):
                self._step(drain=False)
        except BaseException as exc:
            self.died = exc
            log.error("%s: the stream's tick thread died: %s; no epoch is committed until "
                      "the runtime is closed and opened again", self._driver.name, short(exc))

    def _step(self, *, drain: bool) -> bool:
        """One tick, after the recovery a failure left to do. True when it went through;
        after a failure the stream is recovered at once (or, when that fails too, before
        the next tick)."""
        try:
            if self._unrecovered is not None:
                self._recover(self._unrecovered)
                self._unrecovered = None
            self._tick(drain=drain)
            return True
        except Exception as exc:
            why = short(exc)
            self.failures.append(why)
            log.warning("%s: stream epoch %s failed (%s); producers replay from the last "
                        "decided epoch", self._driver.name, self._failed_epoch(), why)
        try:
            self._recover(why)
        except Exception as exc:
            self._unrecovered = why
            log.warning("%s: recovering the stream failed (%s); trying again before the "
                        "next tick", self._driver.name, short(exc))
        return False

    def _failed_epoch(self) -> int:
        return self._in_flight.epoch if self._in_flight is not None else self._open[0]

    def _tick(self, *, drain: bool) -> None:
        pings = self._ping_writers()  # asked before any member can write the next epoch
        tick: StreamTick | None = result(self._actors.coordinator_client.stream_tick(
            self._driver.next_checkpoint(), drain, self._feed_timeout))
        if tick is None:
            return
        self._in_flight, started = tick, time.monotonic()
        self._record = dataclasses.replace(tick.state, feeds=self._ids, route=self.route)
        state = wait_for_feeds(self._actors, tick.epoch, tick.attempt, list(tick.members),
                               timeout=self._commit_timeout, lease=self._feed_timeout)
        since, self._pids = self._pids, _collect(pings, _PID_WAIT)
        if state.lost or state.waiting:
            raise EpochFailedError("; ".join(f"feed {f}: {w}" for f, w in sorted(
                state.lost.items())) or f"feeds {list(state.waiting)} did not close in time",
                runtime=self._driver.name, epoch=tick.epoch)
        self._check_writers(since, self._pids)
        barrier = CheckpointBarrier(tick.checkpoint_id, tick.epoch, BarrierFlags.NONE)
        with watched(self._probe(since)):
            rows, outcome = self._driver.commit_barriers(
                self._actors, tick.epoch, tick.attempt,
                seal_writers(self._actors, barrier, tick.attempt, state), tick.generation)
        self._decided(tick)
        self.reports.append(self._driver.visible(tick.epoch, rows, started, outcome))

    def _decided(self, tick: StreamTick) -> None:
        self._in_flight = None
        self._open = (tick.epoch + 1, tick.next_attempt)
        self._given_up = {e: a for e, a in self._given_up.items() if e > tick.epoch}

    # ------------------------------------------------------------------ writers' processes

    def _writer_pids(self, wait: float) -> Pids:
        """Each writer's process id (``None``: no answer within ``wait`` seconds)."""
        return _collect(self._ping_writers(), wait)

    def _ping_writers(self) -> dict[tuple[str, int], Any]:
        """Ask every writer its process id (the answers are collected by ``_collect``)."""
        refs: dict[tuple[str, int], Any] = {}
        for sink, handles in self._actors.writers.items():
            for index, handle in enumerate(handles):
                try:
                    refs[(sink, index)] = WriterClient(handle).ping().send()
                except Exception as exc:  # busy (its calls' limit) or gone: unknown
                    log.debug("ping of writer %s: %s", (sink, index), exc)
                    refs[(sink, index)] = None
        return refs

    def _check_writers(self, since: Pids, now: Pids) -> None:
        """``RuntimeUnavailableError`` when a writer is not the process it was when the
        epoch began (restarted: what it held of the epoch is gone), or cannot tell."""
        changed = sorted(key for key in set(since) | set(now)
                         if now.get(key) is None or since.get(key) != now.get(key))
        if changed:
            raise RuntimeUnavailableError(
                f"writers {changed} were restarted (or replaced) since the epoch began, or "
                "did not answer: what they held of it is gone", runtime=self._driver.name)

    def _probe(self, since: Pids) -> Callable[[], None]:
        """The probe while the seal waits (each second): an actor that stopped answering
        (``check_responsive``), or a writer that answers from another process than when
        the epoch began (the pings sent at a probe are read, without waiting, at the
        next: a probe must not hold the seal up)."""
        asked: dict[tuple[str, int], Any] = {}

        def probe() -> None:
            self._actors.check_responsive()
            now = _collect(asked, 0.0)
            restarted = sorted(key for key, pid in now.items()
                               if pid is not None and pid != since.get(key))
            if restarted:
                raise RuntimeUnavailableError(
                    f"writers {restarted} were restarted while the epoch was sealed: what "
                    "they held of it is gone", runtime=self._driver.name)
            asked.clear()
            asked.update(self._ping_writers())

        return probe

    # ------------------------------------------------------------------ recovery

    def _recover(self, why: str) -> None:
        """Heal, give up what was not decided, and have the stream go on after the last
        decided epoch at the current coordinator (taking the stream over to a successor
        when it does not know it). New writers are waited for: the producers replay into
        them at once, and their process ids are taken before."""
        self._actors.heal(writers=True)
        epoch = self._give_up_undecided()
        writers = self._actors.writers
        if [h for hs in writers.values() for h in hs] != self._routed:
            self._record = dataclasses.replace(self._record, route=self.route + 1)
            self._routed = self._actors.all_writers()
        pids = self._writer_pids(_PID_WAIT)  # before any producer can write the replay
        state: StreamState = ask(
            self._actors.coordinator_client.stream_rewind(epoch, self._commit_timeout,
                                          self._record, writers),
            what="rewinding the stream", runtime=self._driver.name, heal=self._heal,
            timeout=2 * self._commit_timeout)
        self._record = dataclasses.replace(state, feeds=self._ids, route=self.route)
        self._open, self._pids = (state.epoch, state.attempt), pids
        self._actors.metrics.rewound()
        log.info("%s: stream rewound after %s; it goes on at epoch %s", self._driver.name,
                 why, state.epoch)

    def _heal(self) -> list[str]:
        return self._actors.heal(writers=True)

    def _give_up_undecided(self) -> int:
        """Resolve the epoch in flight (a decided one rolls forward) and give up, at the
        coordinator and the writers, every attempt the producers may have written that
        was not decided. Returns the first epoch not decided."""
        tick, self._in_flight = self._in_flight, None
        if tick is not None:
            started = time.monotonic()
            if self._driver.recover_attempt(self._actors, tick.epoch, tick.attempt):
                self.reports.append(self._driver.settled(self._actors, tick.epoch, started))
                self._decided(tick)
            else:
                self._note_given_up(tick.epoch, tick.attempt)
            self._give_up(tick.epoch + 1, tick.next_attempt)
            return self._open[0]
        epoch, attempt = self._open
        self._give_up(epoch, max(attempt, self._given_up.get(epoch, -1)))
        # the lost coordinator may have ticked and handed the next epoch out: its attempt
        # was at most one above any given up (or one past a restart's sweep)
        self._give_up(epoch + 1, max(self._given_up.get(epoch + 1, -1), 0) + 1)
        return epoch

    def _give_up(self, epoch: int, attempt: int) -> None:
        self._driver.give_up(self._actors, epoch, attempt)
        self._note_given_up(epoch, attempt)

    def _note_given_up(self, epoch: int, attempt: int) -> None:
        self._given_up[epoch] = max(attempt, self._given_up.get(epoch, -1))


def _collect(refs: Mapping[tuple[str, int], Any], wait: float) -> Pids:
    """The writers' process ids their pings answered within ``wait`` seconds (``None``:
    no answer, or a failed one)."""
    import ray

    asked = [ref for ref in refs.values() if ref is not None]
    ready = set(ray.wait(asked, num_returns=len(asked), timeout=wait)[0]) if asked else set()
    return {key: _pid(ref) if ref is not None and ref in ready else None
            for key, ref in refs.items()}


def _pid(ref: Any) -> int | None:
    import ray

    try:
        return int(ray.get(ref, timeout=0))
    except Exception:
        return None
