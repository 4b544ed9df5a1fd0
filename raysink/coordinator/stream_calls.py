"""The coordinator's calls of the continuous stream (``rt.stream()``), mixed into
``CoordinatorActor``::

    driver    stream_start(timeout)                      -> StreamPosition   (begins it)
    driver    stream_tick(checkpoint_id, drain, lease)   -> StreamTick | None
    driver    stream_owed(lease)                         -> Owed  (what holds a drain)
    driver    stream_rewind(epoch, timeout, state, writers) -> StreamState  (after a
              failure: also how a successor coordinator takes the stream over)
    producer  stream_poll(feed, joining, applied, route, wrote, seen)
                                                         -> StreamPosition | None
    producer  stream_leave(feed)

The bookkeeping is ``raysink.coordinator.stream_state``'s. A rewind cuts the producers at the
last *decided* epoch and reopens the one after it: an epoch PENDING at the failure is
never given up, it only rolls forward (``EpochCoordinator.decided_through``). A drain
does not end the stream while a feed owes a replay (``StreamBook.owed``).
"""

from __future__ import annotations

import logging
import time
from abc import abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from raysink.coordinator.stream_state import (
    Owed,
    StreamBook,
    StreamPosition,
    StreamState,
    StreamTick,
)
from raysink.errors import (
    BackpressureError,
    EpochFailedError,
    RaySinkError,
    RescaleRefusedError,
    StreamUnknownError,
)

if TYPE_CHECKING:
    from raysink.coordinator.coordinator import CoordinatorConfig
    from raysink.coordinator.epochs import EpochCoordinator, OpenDecision
    from raysink.coordinator.producers import FeedRegistry
    from raysink.protocol.messages import OpenedEpoch

__all__ = ["StreamCalls"]

log = logging.getLogger(__name__)
T = TypeVar("T")


class StreamCalls:
    """The stream's actor calls; ``CoordinatorActor`` provides the rest."""

    _stream: StreamBook | None = None
    _stream_timeout: float = 300.0  # a restarted member waits this long for its rewind
    _config: CoordinatorConfig
    _core: EpochCoordinator
    _feeds: FeedRegistry

    if TYPE_CHECKING:  # CoordinatorActor's
        @abstractmethod
        def _ensure_started(self) -> None: ...
        @abstractmethod
        async def _until_recovered(self) -> None: ...
        @abstractmethod
        async def _locked(self, fn: Callable[[], T]) -> T: ...
        @abstractmethod
        async def _notify(self) -> None: ...
        @abstractmethod
        async def _wait_change(self, timeout: float) -> None: ...
        @abstractmethod
        async def open_epoch(self, requested: int | None, timeout: float) -> OpenedEpoch: ...

    @property
    def _runtime(self) -> str:
        return self._config.runtime

    async def stream_start(self, timeout: float) -> StreamPosition:
        """Begin the continuous stream at the next epoch (opened as ``open_epoch(None)``
        opens one: the targets' markers are checked first)."""
        opened = await self.open_epoch(None, timeout)
        self._stream = StreamBook(opened.epoch, opened.attempt)
        self._stream_timeout = timeout
        return self._stream.position(self._core.committed_through())

    async def stream_poll(self, feed: int, joining: bool = False,
                          applied_rewinds: int | None = None,
                          route: int | None = None, wrote: int | None = None,
                          seen: int | None = None) -> StreamPosition | None:
        """A producer's poll: where to write, and its barrier once (``None``: no stream
        here, yet: a successor the driver has not handed the stream to). ``joining``: the
        first poll of the feed in its process; a member joining again was restarted, and
        what it wrote before is lost with its old process: its epoch fails, and the poll
        returns once the stream rewound, with the member's cut (an epoch it closed before
        may still be being decided: only the rewind says where to resume).
        ``applied_rewinds``, ``route``, ``wrote`` and ``seen``: see ``StreamBook.poll``."""
        self._ensure_started()
        if self._stream is None:
            return None
        writing = self._stream.writing(feed)
        if writing is not None and joining:
            self._feeds.failed(*writing, feed, "its producer restarted")
            await self._notify()
            await self._until_cut(feed)
            if self._stream is None:
                return None
        book = self._stream
        position = book.poll(feed, applied_rewinds, committed=self._core.committed_through(),
                             decided=self._core.decided_through(), route=route,
                             wrote=wrote, seen=seen, now=time.monotonic())
        writing = book.writing(feed)
        if writing is not None:  # the poll is the member's heartbeat too
            self._feeds.alive(*writing, feed, time.monotonic())
        return position

    async def _until_cut(self, feed: int) -> None:
        """Wait for the rewind that cuts ``feed`` (its epoch failed), or the stream's end."""
        deadline = time.monotonic() + self._stream_timeout
        while (stream := self._stream) is not None and not stream.ended \
                and not stream.has_cut(feed):
            left = deadline - time.monotonic()
            if left <= 0:
                raise EpochFailedError(
                    f"feed {feed} restarted, and the stream did not rewind within "
                    f"{self._stream_timeout:g} s: is the driver's stream still ticking?",
                    runtime=self._runtime)
            await self._wait_change(min(left, 0.5))

    async def stream_tick(self, checkpoint_id: int, drain: bool,
                          lease: float = 0.0) -> StreamTick | None:
        """Close the stream's current epoch (see ``StreamBook.tick``; ``lease``: the
        feeds' heartbeat lease, for a drain's ``owed``).
        ``StreamUnknownError`` when this coordinator does not know the stream (it was
        restarted by Ray): the driver hands it over (``stream_rewind``)."""
        await self._until_recovered()
        book = self._stream
        if book is None:
            raise StreamUnknownError("this coordinator does not know the stream (restarted "
                                     "since it began)", runtime=self._runtime)
        return book.tick(checkpoint_id, self._core.next_attempt(book.epoch + 1),
                         self._core.generation, drain=drain, now=time.monotonic(), lease=lease)

    async def stream_owed(self, lease: float) -> Owed:
        """What holds the stream's drain (``StreamBook.owed``); ended when there is no
        stream here (nothing of it to drain)."""
        self._ensure_started()
        if self._stream is None:
            return Owed(ended=True)
        return self._stream.owed(time.monotonic(), lease)

    async def stream_rewind(self, epoch: int, timeout: float, state: StreamState | None = None,
                            writers: Mapping[str, Sequence[Any]] | None = None
                            ) -> StreamState:
        """The stream failed at ``epoch`` (the driver gave up its attempts not decided):
        it goes on from the first epoch after the last decided one, and every producer is
        cut there. A coordinator that does not know the stream (a successor) takes it
        over from the driver's ``state``. ``writers``: the route producers send to from
        now on (route number ``state.route``). Returns the stream's state."""
        await self._until_recovered()
        self._stream_timeout = timeout
        cut = self._core.decided_through()
        epoch = epoch if cut is None else max(epoch, cut + 1)
        attempt, opened = await self._reopen(epoch)
        book = self._stream
        if book is None:
            book = self._stream = StreamBook.taken_over(state or StreamState(), epoch,
                                                        attempt, cut, opened=opened,
                                                        now=time.monotonic())
            log.info("%s: took the stream over at epoch %s (producers resume after %s)",
                     self._runtime, epoch, cut)
        else:
            book.rewind(epoch, attempt, cut, opened=opened)
        if writers is not None and state is not None:
            book.set_route(state.route, writers)
        await self._notify()
        return book.state()

    async def _reopen(self, epoch: int) -> tuple[int, bool]:
        """Open ``epoch`` for the stream's replay: recorded OPEN when there is room (any
        other open attempt aborted, staging left unswept by a restart swept), else in
        memory, its open travelling with its decision (which waits for room). Returns
        its attempt and whether it is recorded."""
        try:
            decision: OpenDecision = await self._locked(lambda: self._core.open_epoch(epoch))
        except BackpressureError:
            return self._core.next_attempt(epoch), False
        if decision.skip or decision.wait_roll_forward:  # above every decided epoch
            raise RaySinkError(f"the stream cannot reopen epoch {epoch}: it is decided",
                               runtime=self._runtime, epoch=epoch)
        await self._notify()
        return decision.attempt, True

    async def stream_leave(self, feed: int) -> None:
        """A producer leaves the stream; an epoch ticked for it that it did not claim is
        closed empty for it (it wrote nothing there)."""
        self._ensure_started()
        owed = None if self._stream is None else self._stream.leave(feed)
        if owed is not None:
            self._feeds.closed(*owed, feed, {}, time.monotonic())
            await self._notify()

    def _refuse_rescale_in_stream(self) -> None:
        """A layout change while the stream runs would leave producers routing by the
        old one: refused."""
        if self._stream is not None and not self._stream.ended:
            raise RescaleRefusedError(
                "a continuous stream runs: its producers write by the layout they joined "
                "with at every moment. Close the runtime (rt.close() drains the stream), "
                "open it with writers=N and start the stream again", runtime=self._runtime)
