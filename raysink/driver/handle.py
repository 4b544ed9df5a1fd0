"""``EpochHandle``: an epoch fed by many producers at once (``rt.open_epoch()``).

::

    ep = rt.open_epoch()                       # OPEN recorded at the coordinator
    ray.get([produce.remote(ep.feed(), part) for part in parts])
    report = ep.commit()                       # every feed closed -> seal -> decide

``commit`` waits until every feed handed out closed (its barrier is at the writers it
sent data to); then each writer that received data gets a *seal* naming the feeds it
must align (a ``BarrierAligner`` over them), pre-commits and answers with its
commit request; the driver sends the requests to the coordinator in one call, as for
``write_arrow``. A feed that failed, or whose producer went silent past ``feed_timeout``
(its task or actor died and was not retried in time), makes the commit give the
attempt up: a ``CANCEL`` barrier to every writer, nothing visible, ``EpochFailedError``
asking to feed the epoch again. ``abort`` gives it up on purpose.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from raysink.coordinator.producers import FeedsState
from raysink.driver.calls import public_error, result, short
from raysink.driver.feed import Feed, FeedRoute
from raysink.driver.routing import Barriers
from raysink.errors import ConfigError, EpochFailedError, RuntimeUnavailableError
from raysink.protocol.barrier import BarrierFlags, CheckpointBarrier
from raysink.protocol.clients import WriterClient
from raysink.reports import EpochReport

if TYPE_CHECKING:
    from raysink.driver.epoch import EpochDriver
    from raysink.driver.lifecycle import ActorSet
    from raysink.protocol.messages import OpenedEpoch

__all__ = ["EpochHandle", "seal_writers", "wait_for_feeds"]


class EpochHandle:
    """An open epoch attempt that producers feed; ``commit`` or ``abort`` it once."""

    def __init__(self, driver: EpochDriver, actors: ActorSet, route: FeedRoute,
                 opened: OpenedEpoch, *, feed_timeout: float, commit_timeout: float,
                 on_end: Any = None) -> None:
        self._driver, self._actors, self._route = driver, actors, route
        self.epoch, self.attempt = opened.epoch, opened.attempt
        self.skipped = opened.skip
        self._skipped_sinks = opened.skipped_sinks
        self._committed_through = opened.committed_through  # the seals' hint
        self.checkpoint_id = driver.next_checkpoint()
        self._feed_timeout, self._commit_timeout = feed_timeout, commit_timeout
        self._handed: set[int] = set()
        self._next_id = 1
        self._ended = False
        self._on_end = on_end
        self._started = time.monotonic()

    def __repr__(self) -> str:
        state = "ended" if self._ended else "skipped" if self.skipped else "open"
        return (f"EpochHandle({self._route.runtime!r}, epoch={self.epoch}, "
                f"attempt={self.attempt}, {state}, feeds={len(self._handed)})")

    def __enter__(self) -> EpochHandle:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 tb: object) -> None:
        if not self._ended:
            if error is None:
                self.commit()
            else:
                self.abort()

    def feed(self, feed_id: int | None = None) -> Feed:
        """A new producer's feed (ids 1, 2, ...); ``feed_id`` names it yourself, for
        producers that must find their feed again (Ray Data's task index)."""
        self._check_open()
        if feed_id is None:
            feed_id = self._next_id
        self._next_id = max(self._next_id, feed_id + 1)
        self._handed.add(feed_id)
        return Feed(self._route, epoch=self.epoch, attempt=self.attempt, feed_id=feed_id,
                    checkpoint_id=self.checkpoint_id, skip=self.skipped)

    def commit(self, *, feeds: Iterable[int] | None = None,
               timeout: float | None = None) -> EpochReport:
        """Wait for every feed handed out (or ``feeds``) to close, then have the epoch
        decided and committed; returns its report. ``timeout`` bounds the wait for the
        feeds (default: ``commit_timeout``). Raises raysink errors only."""
        self._check_open()
        self._ended = True
        try:
            return self._commit(feeds, timeout)
        except Exception as exc:
            raise public_error(
                exc, what=f"committing epoch {self.epoch}", runtime=self._route.runtime,
                kind=EpochFailedError, epoch=self.epoch,
                then=f"rt.status().last_committed_epoch says whether epoch {self.epoch} "
                     "was committed; if not, open it again and feed it again") from exc
        finally:
            self._end()

    def _commit(self, feeds: Iterable[int] | None, timeout: float | None) -> EpochReport:
        """``commit`` after its checks, raising what failed as it is."""
        if self.skipped:
            return self._driver.skipped(self.epoch, self._skipped_sinks, self._started)
        expected = sorted(self._handed if feeds is None else set(feeds))
        try:
            state = wait_for_feeds(
                self._actors, self.epoch, self.attempt, expected, lease=self._feed_timeout,
                timeout=self._commit_timeout if timeout is None else timeout)
        except Exception as exc:
            self._driver.give_up(self._actors, self.epoch, self.attempt)
            raise EpochFailedError(
                f"epoch {self.epoch}: could not learn whether its feeds closed ({short(exc)}); "
                f"nothing of it is visible; open epoch {self.epoch} again and feed it "
                "again", runtime=self._route.runtime, epoch=self.epoch) from exc
        if state.lost or state.waiting:
            self._driver.give_up(self._actors, self.epoch, self.attempt)
            raise EpochFailedError(self._why_lost(state), runtime=self._route.runtime,
                                   epoch=self.epoch, attempts=1)
        barrier = CheckpointBarrier(self.checkpoint_id, self.epoch, BarrierFlags.NONE)
        return self._driver.commit_fed(
            self._actors, self.epoch, self.attempt,
            lambda: seal_writers(self._actors, barrier, self.attempt, state,
                                 self._committed_through), self._started)

    def abort(self) -> None:
        """Give the epoch's attempt up: nothing of it becomes visible. Raises raysink
        errors only (the runtime's actors unreachable: ``RuntimeUnavailableError``)."""
        if self._ended:
            return
        self._ended = True
        try:
            if not self.skipped:
                self._driver.give_up(self._actors, self.epoch, self.attempt)
        except Exception as exc:
            raise public_error(
                exc, what=f"aborting epoch {self.epoch} attempt {self.attempt}",
                runtime=self._route.runtime, kind=RuntimeUnavailableError, epoch=self.epoch,
                then="the attempt is given up when the runtime recovers (a new coordinator "
                     "sweeps undecided attempts); rt.status() says what was committed"
                ) from exc
        finally:
            self._end()

    def _end(self) -> None:
        if self._on_end is not None:
            self._on_end(self)

    def _check_open(self) -> None:
        if self._ended:
            raise ConfigError(f"{self!r} was committed or aborted; open a new epoch")

    def _why_lost(self, state: FeedsState) -> str:
        if state.lost:
            lost = "; ".join(f"feed {feed}: {why}" for feed, why in sorted(state.lost.items()))
            cause = f"lost its producers ({lost})"
        else:
            cause = f"waited too long for feeds {list(state.waiting)} to close"
        return (f"epoch {self.epoch} attempt {self.attempt} {cause}. Nothing of it is "
                f"visible; open epoch {self.epoch} again and feed it again")


def wait_for_feeds(actors: ActorSet, epoch: int, attempt: int, feeds: list[int], *,
                   timeout: float, lease: float) -> FeedsState:
    """Ask the coordinator until every feed closed, one is lost, or ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        left = max(0.0, deadline - time.monotonic())
        state: FeedsState = result(actors.coordinator_client.wait_feeds(
            epoch, attempt, feeds, min(left, 10.0), lease))
        if state.done or left <= 0:
            return state


def seal_writers(actors: ActorSet, barrier: CheckpointBarrier, attempt: int,
                 state: FeedsState, committed_through: int | None = None) -> Barriers:
    """Seal every writer that received data with the feeds it must align; the others
    staged nothing (the driver answers for them). ``committed_through``: an epoch the
    driver knows every sink committed, with every one before it (a writer that holds
    transactions then need not ask before its pre-commit)."""
    by_writer: dict[int, list[int]] = {}
    for feed, counts in state.closed.items():
        for k in counts:
            by_writer.setdefault(int(k), []).append(feed)
    writers = actors.writers
    return Barriers(
        refs=[WriterClient(handles[k]).seal(barrier, attempt, sorted(feeds),
                                            committed_through).send()
              for handles in writers.values() for k, feeds in sorted(by_writer.items())],
        idle=[(sink, k) for sink, handles in writers.items()
              for k in range(len(handles)) if k not in by_writer])
