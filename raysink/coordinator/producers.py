"""Which producers (feeds) of an epoch attempt closed, and which are gone.

A ``Feed`` handed to a Ray task or actor reports to the coordinator: it is alive (a
heartbeat while it is in use), it closed (its barrier went to the writers it sent data
to, with its message count per writer), or it failed (an exception in its ``with``
block). The driver committing the epoch waits here until every feed it expects closed;
a feed that failed, or whose heartbeats stopped for longer than the lease (its task or
actor died and was not retried in time), is *lost*, and the attempt is given up.

Pure bookkeeping without I/O or Ray; the coordinator actor serves it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

__all__ = ["FeedRegistry", "FeedsState"]

Key = tuple[int, int]


@dataclass(kw_only=True, slots=True)
class _FeedRecord:
    seen: float | None = None  # the last heartbeat (None: never heard from)
    counts: dict[int, int] | None = None  # closed: messages sent per writer index
    failed: str | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class FeedsState:
    """The expected feeds of an attempt: ``closed`` (with their message counts per writer
    index), ``waiting`` (still sending, or not started), ``lost``
    (failed or silent past the lease, with why)."""

    closed: Mapping[int, Mapping[int, int]] = field(default_factory=dict)
    waiting: tuple[int, ...] = ()
    lost: Mapping[int, str] = field(default_factory=dict)

    @property
    def done(self) -> bool:
        return bool(self.lost) or not self.waiting


class FeedRegistry:
    """The feeds of the attempts in flight, by ``(epoch, attempt)``."""

    def __init__(self) -> None:
        self._feeds: dict[Key, dict[int, _FeedRecord]] = {}

    def _record(self, epoch: int, attempt: int, feed: int) -> _FeedRecord:
        return self._feeds.setdefault((epoch, attempt), {}).setdefault(feed, _FeedRecord())

    def alive(self, epoch: int, attempt: int, feed: int, now: float) -> None:
        self._record(epoch, attempt, feed).seen = now

    def closed(self, epoch: int, attempt: int, feed: int, counts: Mapping[int, int],
               now: float) -> None:
        """The feed's barrier went to every writer in ``counts``. Closing again (a
        producer retried by Ray) keeps the first counts: the messages are the same."""
        record = self._record(epoch, attempt, feed)
        record.seen = now
        if record.counts is None:
            record.counts = dict(counts)

    def failed(self, epoch: int, attempt: int, feed: int, reason: str) -> None:
        record = self._record(epoch, attempt, feed)
        if record.failed is None and record.counts is None:
            record.failed = reason

    def state(self, epoch: int, attempt: int, feeds: Iterable[int], *, lease: float,
              now: float) -> FeedsState:
        """Where ``feeds`` of the attempt stand. A feed heard from and then silent for
        more than ``lease`` seconds without closing is lost."""
        known = self._feeds.get((epoch, attempt), {})
        closed: dict[int, Mapping[int, int]] = {}
        waiting: list[int] = []
        lost: dict[int, str] = {}
        for feed in sorted(set(feeds)):
            record = known.get(feed, _FeedRecord())
            if record.counts is not None:
                closed[feed] = record.counts
            elif record.failed is not None:
                lost[feed] = record.failed
            elif record.seen is not None and now - record.seen > lease:
                lost[feed] = (f"no heartbeat for {now - record.seen:.0f} s (lease {lease:g} s):"
                              " its task or actor died, or is stuck")
            else:
                waiting.append(feed)
        return FeedsState(closed=closed, waiting=tuple(waiting), lost=lost)

    def forget(self, epoch: int) -> None:
        """Drop every attempt of ``epoch`` and older ones (decided or given up)."""
        for key in [k for k in self._feeds if k[0] <= epoch]:
            del self._feeds[key]
