"""The continuous stream's position, kept by the coordinator (``rt.stream()``).

Long-lived producers write the stream's *current* epoch. Every ``checkpoint_interval``
the driver ticks: the current epoch's members are fixed, each member's own
``BarrierInjector`` gets the epoch's barrier, and the stream moves on to the next epoch.
Each producer claims its pending barrier once, at its next batch boundary (or, idle, from
its poll), closes its part of the epoch and writes the next one. A producer that joins
(its first write, or its first after a rewind) writes the current epoch from then on.

Rewinds and cuts. After an epoch failed, the stream *rewinds*: the failed epoch is written
again (a new attempt) and every member leaves (its next write raises ``StreamRewind``: it
replays its source and joins again). Each member is told the epoch the rewind cut its
history at, its *cut*: the last epoch *decided* when its later writes were dropped
(committed, or PENDING: a decided epoch only rolls forward, it is never given up, so its
rows are kept whatever fails after it). It is told so until it *applied* the rewind (its
process wrote again after being told: ``applied_rewinds``), and is no member until then,
so no tick hands it a barrier it could only close empty. The stream may commit later
epochs without it meanwhile: a producer that replayed from one of those would lose the
rows it had written into the dropped epochs before them. A producer restarted while a
member learns its cut the same way, once the rewind its restart forces has happened.

A stream taken over. A coordinator that was replaced, or restarted by Ray, does not know
the stream. The driver keeps what a successor needs from the answers it gets
(``StreamState``: the rewinds so far, the cuts not applied as of its last tick, the feeds
handed out) and hands it over (``StreamBook.taken_over``). Every write into an epoch not
decided was lost with the coordinator (its successor's recovery swept them), so every
feed handed out before is cut at the last decided epoch (the *floor*), unless its recorded
cut is older. The successor counts its rewinds above any the lost coordinator can have
reached (the record, plus a rewind it may have made without answering, plus the loss).
The record may lag behind a cut a feed applied since the driver's last tick; that feed
then resumes from its older recorded cut, which replays nothing decided: it wrote only
into epochs ticked after that answer, none of them decided (a decision follows a tick
answer, which lists the cuts applied before it).

Replays owed at the drain. Only the producer's own calls apply a rewind, never its poll
thread: a producer that wrote into an epoch a rewind dropped and then made no call (no
write, ``close`` or ``wait_committed``) was never told. Each poll reports the last epoch
its process wrote into (or writes now) and the rewinds it had seen when it sent the poll;
a feed whose cut is older than the epoch it last wrote into, that has not applied the
rewind nor left, *owes a replay* (``Owing``). The drain (``tick`` with ``drain``) does not
end the stream while a feed owes one, or while a cut feed's last report predates its cut
and it may still report (heard from within the lease): the driver waits for those
producers to replay (their next call raises ``StreamRewind``), then raises naming them
(``StreamBook.owed``). A report sent once the feed had seen the rewind is complete: any
later write raises ``StreamRewind`` instead of sending.

Pure bookkeeping; the coordinator serves it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from raysink.protocol.barrier import BarrierFlags, BarrierInjector, CheckpointBarrier

__all__ = ["Cut", "Owed", "Owing", "StreamBook", "StreamPosition", "StreamState", "StreamTick"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Cut:
    """Where rewind number ``since`` cut a feed's history: after ``epoch`` (the last epoch
    decided then; ``None``: none), nothing it wrote was kept."""

    epoch: int | None
    since: int


@dataclass(frozen=True, kw_only=True, slots=True)
class StreamState:
    """What the driver keeps of its stream, for a successor coordinator to take it over:
    the rewinds so far, the cuts not yet applied, the feeds handed out (ids ``1..feeds``),
    those that left as of the last tick, and the route (``route``: its number, the
    writers' handles the driver gives). As answered by a rewind: ``(epoch, attempt)``,
    the epoch the stream goes on with."""

    epoch: int = 0
    attempt: int = 0
    rewinds: int = 0
    cuts: Mapping[int, Cut] = field(default_factory=dict)
    feeds: int = 0
    route: int = 0
    left: frozenset[int] = frozenset()  # feeds that left (a drain never waits for them)


@dataclass(frozen=True, kw_only=True, slots=True)
class StreamPosition:
    """What a producer's poll learns. ``member``: write ``(epoch, attempt)``; else join
    first (poll with every rewind applied). ``barrier``: close your part of
    ``barrier.epoch`` first (claimed once). ``rewinds``: how many times the stream rewound
    (a change means: replay from ``committed``). ``rewound``: this feed has a rewind to
    apply. ``committed``: where to resume, the feed's cut while it has one, else the last
    decided epoch; ``visible``: every target holds the epochs up to it. ``ended``: the
    stream was drained, nothing more is taken. ``writers``: the route's writers (number
    ``route``), when the feed's route is another."""

    epoch: int
    attempt: int
    rewinds: int
    committed: int | None
    visible: int | None = None
    rewound: bool = False
    member: bool = False
    barrier: CheckpointBarrier | None = None
    barrier_attempt: int = 0  # the attempt of ``barrier.epoch``
    ended: bool = False
    route: int = 0
    writers: Mapping[str, Sequence[Any]] | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class StreamTick:
    """An epoch whose members must now close it: commit it over them. ``state``: the
    stream's rewinds and cuts now (the driver's record)."""

    epoch: int
    attempt: int
    members: tuple[int, ...]
    checkpoint_id: int
    next_attempt: int = 0  # of the epoch after it, which the members write next
    drain: bool = False
    generation: int | None = None  # the coordinator's, for an epoch not opened first
    state: StreamState = field(default_factory=StreamState)


@dataclass(frozen=True, kw_only=True, slots=True)
class Owing:
    """A feed that owes a replay: it wrote into epochs up to ``wrote`` (its last report),
    a rewind dropped everything after ``cut``, and it made no call since."""

    feed: int
    cut: int | None
    wrote: int


@dataclass(frozen=True, kw_only=True, slots=True)
class Owed:
    """What holds a drain: ``feeds`` owing a replay, and ``unknown`` cut feeds whose last
    report predates their cut (they may owe one; waited for up to the lease). ``ended``:
    the stream was drained, nothing is owed."""

    ended: bool
    feeds: tuple[Owing, ...] = ()
    unknown: tuple[int, ...] = ()


@dataclass(frozen=True, kw_only=True, slots=True)
class _Report:
    wrote: int | None  # the last epoch the feed's process wrote into (or writes now)
    seen: int | None  # the rewinds it had seen when it sent the poll
    at: float  # when it came


@dataclass(kw_only=True, slots=True)
class _Member:
    injector: BarrierInjector = field(default_factory=BarrierInjector)
    epoch: int = 0  # the epoch the member writes (its barrier closes it)


class StreamBook:
    """The stream's current epoch, its members, each member's pending barrier, and the
    cuts of the feeds that have a rewind to apply."""

    def __init__(self, epoch: int, attempt: int, *, opened: bool = True,
                 now: float = 0.0) -> None:
        self.epoch, self.attempt = epoch, attempt
        self._created = now  # a feed never heard from here: as if heard from then
        # the epoch opened at the coordinator (its OPEN recorded); the others' opens
        # travel with their decision
        self.opened: int | None = epoch if opened else None
        self.rewinds = 0
        self.ended = False
        self.route = 0
        self.writers: Mapping[str, Sequence[Any]] | None = None
        self._closing_attempt = attempt  # of the epoch ticked last, still being closed
        self._members: dict[int, _Member] = {}
        self._left: set[int] = set()  # feeds that left on purpose
        self._cuts: dict[int, Cut] = {}  # feed -> its cut, until it applied the rewind
        self._floor: Cut | None = None  # taken over: the cut of every feed handed out
        self._floor_feeds = 0
        self._applied: dict[int, int] = {}  # feed -> the rewinds it applied (last poll)
        self._reports: dict[int, _Report] = {}  # feed -> its last poll's report

    @classmethod
    def taken_over(cls, state: StreamState, epoch: int, attempt: int, cut: int | None, *,
                   opened: bool, now: float = 0.0) -> StreamBook:
        """A successor coordinator's book of a stream its predecessor kept: the stream
        goes on with ``(epoch, attempt)``; every feed handed out (``state.feeds``) is cut
        at ``cut``, the last decided epoch, unless its recorded cut is older."""
        book = cls(epoch, attempt, opened=opened, now=now)
        book.rewinds = state.rewinds + 2
        book._cuts = dict(state.cuts)
        book._floor, book._floor_feeds = Cut(epoch=cut, since=book.rewinds), state.feeds
        book.route, book._left = state.route, set(state.left)
        return book

    def state(self) -> StreamState:
        """The rewinds and the cuts not applied yet (the driver adds the rest)."""
        return StreamState(epoch=self.epoch, attempt=self.attempt, rewinds=self.rewinds,
                           cuts=dict(self._cuts), route=self.route,
                           left=frozenset(self._left))

    def set_route(self, route: int, writers: Mapping[str, Sequence[Any]]) -> None:
        """The writers producers send to from now on (route number ``route``)."""
        self.route, self.writers = route, writers

    def poll(self, feed: int, applied_rewinds: int | None = None, *, committed: int | None,
             decided: int | None = None, route: int | None = None, wrote: int | None = None,
             seen: int | None = None, now: float = 0.0) -> StreamPosition:
        """A feed's poll: a member's pending barrier, claimed. ``applied_rewinds``: the
        rewinds its producer applied (``None``: a new process); with every one applied
        the feed joins (a member from the current epoch on), else it is told its cut.
        ``committed``: every target holds the epochs up to it; ``decided``: the last
        decided epoch (default ``committed``); ``route``: the feed's route number.
        ``wrote`` and ``seen``: its report (the last epoch its process wrote into, the
        rewinds it had seen), kept for ``owed``."""
        decided = committed if decided is None else decided
        self._reports[feed] = _Report(wrote=wrote, seen=seen, at=now)
        if applied_rewinds is not None:
            self._applied[feed] = applied_rewinds
        cut = self._cut(feed, applied_rewinds)
        member = self._members.get(feed)
        if applied_rewinds == self.rewinds and member is None:
            member = self._join(feed)
        barrier, barrier_attempt = None, 0
        if member is not None:
            if member.injector.has_pending:
                barrier = member.injector.handle().poll(member.epoch)
            if barrier is not None:
                barrier_attempt = self._attempt_of(barrier.epoch)
                member.epoch = max(barrier.epoch + 1, self.epoch)
        epoch = self.epoch if member is None else member.epoch
        writers = self.writers if route is not None and route != self.route else None
        return StreamPosition(
            epoch=epoch, attempt=self._attempt_of(epoch), rewinds=self.rewinds,
            committed=decided if cut is None else cut.epoch, visible=committed,
            rewound=cut is not None, member=member is not None, barrier=barrier,
            barrier_attempt=barrier_attempt, route=self.route, writers=writers,
            ended=self.ended and (member is None or barrier is None))

    def _cut(self, feed: int, applied: int | None) -> Cut | None:
        """The feed's cut, while it has not applied the rewind that set it (a recorded
        cut it applied is forgotten)."""
        recorded = self._cuts.get(feed)
        if recorded is not None:
            if applied is None or applied < recorded.since:
                return recorded
            del self._cuts[feed]
        floor = self._floor
        if floor is not None and feed <= self._floor_feeds and (
                applied is None or applied < floor.since):
            return floor
        return None

    def owed(self, now: float, lease: float) -> Owed:
        """The feeds a drain must wait for (see the module docstring): cut, not applied,
        not left, and either owing a replay by their last report or not heard from since
        their cut while heard from within ``lease`` seconds."""
        if self.ended:
            return Owed(ended=True)
        owing: list[Owing] = []
        unknown: list[int] = []
        for feed, cut in sorted(self._open_cuts().items()):
            report = self._reports.get(feed)
            if report is not None and report.wrote is not None and (
                    cut.epoch is None or report.wrote > cut.epoch):
                owing.append(Owing(feed=feed, cut=cut.epoch, wrote=report.wrote))
            elif (report is None or report.seen is None or report.seen < cut.since) and \
                    now - (self._created if report is None else report.at) <= lease:
                unknown.append(feed)
        return Owed(ended=False, feeds=tuple(owing), unknown=tuple(unknown))

    def _open_cuts(self) -> dict[int, Cut]:
        """Every feed's cut it has not applied (recorded, or the floor), left ones aside."""
        cuts = dict(self._cuts)
        floor = self._floor
        if floor is not None:
            for feed in range(1, self._floor_feeds + 1):
                if feed not in cuts and self._applied.get(feed, -1) < floor.since:
                    cuts[feed] = floor
        return {f: c for f, c in cuts.items() if f not in self._left
                and self._applied.get(f, -1) < c.since}

    def _join(self, feed: int) -> _Member | None:
        if self.ended or feed in self._left:
            return None
        member = self._members[feed] = _Member(epoch=self.epoch)
        return member

    def position(self, committed: int | None) -> StreamPosition:
        """Where the stream is, for the driver (nobody joins)."""
        return StreamPosition(epoch=self.epoch, attempt=self.attempt, rewinds=self.rewinds,
                              committed=committed, visible=committed, ended=self.ended,
                              route=self.route)

    def writing(self, feed: int) -> tuple[int, int] | None:
        """The ``(epoch, attempt)`` member ``feed`` writes now (its heartbeat's)."""
        member = self._members.get(feed)
        return None if member is None else (member.epoch, self._attempt_of(member.epoch))

    def _attempt_of(self, epoch: int) -> int:
        return self.attempt if epoch == self.epoch else self._closing_attempt

    def tick(self, checkpoint_id: int, next_attempt: int, generation: int, *,
             drain: bool = False, now: float = 0.0, lease: float = 0.0) -> StreamTick | None:
        """Close the current epoch: its members get its barrier; the stream goes on with
        the next epoch (``next_attempt``), or, with ``drain``, ends. ``None`` when the
        epoch has no members (nothing to commit; the stream stays on it), and for a
        drain while a feed owes a replay or may (``owed``: the stream stays open for
        their replay)."""
        if drain:
            owed = self.owed(now, lease)
            if owed.feeds or owed.unknown:
                return None
        members = tuple(sorted(f for f, m in self._members.items() if m.epoch == self.epoch))
        if not members:
            self.ended = self.ended or drain
            return None
        flags = BarrierFlags.DRAIN if drain else BarrierFlags.NONE
        for feed in members:
            self._members[feed].injector.trigger(checkpoint_id, flags)
        tick = StreamTick(epoch=self.epoch, attempt=self.attempt, members=members,
                          checkpoint_id=checkpoint_id, drain=drain, next_attempt=next_attempt,
                          generation=None if self.epoch == self.opened else generation,
                          state=self.state())
        self._closing_attempt = self.attempt
        self.epoch, self.attempt = self.epoch + 1, next_attempt
        self.ended = drain
        return tick

    def rewind(self, epoch: int, attempt: int, cut: int | None, *,
               opened: bool = True) -> None:
        """The stream failed: write ``epoch`` again (``attempt``; ``opened``: its OPEN is
        recorded); every member leaves, cut at ``cut`` (the last decided epoch); a feed
        with an older cut it has not applied keeps that one."""
        self.epoch, self.attempt = epoch, attempt
        self.opened = epoch if opened else None
        self.rewinds += 1
        self.ended = False  # a failed drain: its members replay, then it drains again
        for feed in self._members:
            self._cuts[feed] = Cut(epoch=cut, since=self.rewinds)
        self._members.clear()

    def has_cut(self, feed: int) -> bool:
        """Whether ``feed`` has a rewind to apply (its poll brings the cut)."""
        return feed in self._cuts

    def leave(self, feed: int) -> tuple[int, int] | None:
        """A producer left the stream on purpose (``feed.close()``, after closing what it
        wrote): it never joins again. Returns the ``(epoch, attempt)`` a tick gave it
        a barrier of that it did not claim: it wrote nothing there, and closes it empty."""
        self._left.add(feed)
        member = self._members.pop(feed, None)
        if member is None or not member.injector.has_pending:
            return None
        return member.epoch, self._attempt_of(member.epoch)
