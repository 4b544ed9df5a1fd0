"""The coordinator's side of a continuous stream, without Ray: ``CoordinatorActor``'s
stream calls driven in one asyncio loop in the order the driver's ``StreamController`` and
the producers' ``StreamFeed`` make them, over memory sinks whose commits can be held down.

What a rewind must tell the producers: where their writes that were kept end (the cut). An
epoch that is decided (PENDING) is never given up, so it is kept whatever else fails."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence
from pathlib import Path

import pyarrow as pa
import pytest

from raysink import _schema
from raysink.coordinator.coordinator import CoordinatorActor, CoordinatorConfig
from raysink.coordinator.stream_state import StreamTick
from raysink.errors import BackpressureError, RescaleRefusedError, StreamUnknownError
from raysink.protocol.messages import CommitRequest
from raysink.sinks.base import CommitResult, Manifest
from tests.unit.memsink import MemorySink, MemoryTarget

RUNTIME = "streamrt"
SCHEMA = pa.schema([("id", pa.int64())])


@dataclasses.dataclass
class DownTarget(MemoryTarget):
    """A memory target that refuses the commits of epochs ``down_from`` and up (down for
    them: the commit workers retry)."""

    down_from: int | None = None


class DownSink(MemorySink):
    target: DownTarget

    @property
    def down_from(self) -> int | None:
        return self.target.down_from

    @down_from.setter
    def down_from(self, epoch: int | None) -> None:
        self.target.down_from = epoch

    def commit(self, epoch: int, manifests: Sequence[Manifest]) -> CommitResult:
        if self.down_from is not None and epoch >= self.down_from:
            raise ConnectionError(f"the target is down (epoch {epoch}, injected)")
        return super().commit(epoch, manifests)


def _actor(tmp_path: Path, sink: DownSink) -> CoordinatorActor:
    return CoordinatorActor(CoordinatorConfig(
        runtime=RUNTIME, metastore=f"sqlite:///{tmp_path / 'meta.db'}",
        sinks={"main": sink.bind(RUNTIME, "main")}, writers=1, max_pending_epochs=2,
        retry_cap=0.05))


def _request(sink: DownSink, tick: StreamTick, rows: list[int]) -> CommitRequest:
    """The one writer's commit request for the ticked epoch, carrying ``rows``."""
    writer = sink.create_writer(0)
    writer.write(pa.RecordBatch.from_pydict({"id": rows}, schema=SCHEMA))
    return CommitRequest(sink="main", writer=0, epoch=tick.epoch, attempt=tick.attempt,
                         manifest=writer.pre_commit(tick.epoch, tick.attempt),
                         schema=_schema.encode(SCHEMA))


async def _decided(actor: CoordinatorActor, sink: DownSink, checkpoint: int,
                   rows: list[int]) -> StreamTick:
    """Tick the stream and have the ticked epoch decided (its commit held down)."""
    tick = await actor.stream_tick(checkpoint, False)
    assert tick is not None
    wait = await actor.commit_epoch(tick.epoch, tick.attempt, [_request(sink, tick, rows)],
                                    0.2, tick.generation)
    assert not wait.committed  # decided, not visible: the target is down
    await actor.stream_poll(1, False, 0)  # the producer claims the barrier, writes on
    return tick


async def _two_pending_then_a_failed_epoch(actor: CoordinatorActor, sink: DownSink
                                           ) -> tuple[StreamTick, StreamTick, StreamTick]:
    """Epochs E-1 and E decided while the target is down; E+1 fails on backpressure and
    is given up at the coordinator (the driver's ``recover_attempt`` and ``give_up``)."""
    sink.down_from = 0
    await actor.stream_start(5.0)
    await actor.stream_poll(1, True, 0)
    before = await _decided(actor, sink, 1, [1, 2])
    pending = await _decided(actor, sink, 2, [3, 4])
    failed = await actor.stream_tick(3, False)
    assert failed is not None
    with pytest.raises(BackpressureError):
        await actor.commit_epoch(failed.epoch, failed.attempt,
                                 [_request(sink, failed, [5, 6])], 0.2, failed.generation)
    assert await actor.resolve(failed.epoch, failed.attempt) == "ABORTED"
    await actor.resolve(failed.epoch + 1, failed.next_attempt)
    return before, pending, failed


def test_a_rewind_counts_an_epoch_still_committing_as_kept(tmp_path: Path) -> None:
    """E-1 and E are decided with their target down past ``commit_timeout``; E+1 fails on
    backpressure and the stream rewinds. The target comes back for E-1 first: the cut must
    still be E (decided: it commits, whatever happens to the stream), not E-1, or the
    producers replay E's rows into the reopened epoch and E commits as well: doubled."""
    sink = DownSink(DownTarget())

    async def scenario() -> None:
        actor = _actor(tmp_path, sink)
        try:
            before, pending, failed = await _two_pending_then_a_failed_epoch(actor, sink)
            sink.down_from = pending.epoch  # back for E-1 only
            await actor.stream_rewind(failed.epoch, 5.0)
            told = await actor.stream_poll(1, False, 0)
            assert told is not None and told.rewound
            cut = told.committed
            assert (await actor.wait_committed(before.epoch, 5.0)).committed
            sink.down_from = None
            assert (await actor.wait_committed(pending.epoch, 5.0)).committed
            assert cut == pending.epoch, (
                f"the rewind cut the stream at epoch {cut} while epoch {pending.epoch} was "
                "decided: its rows would be replayed and committed twice")
        finally:
            sink.down_from = None
            await actor.close()

    asyncio.run(scenario())


def test_a_producer_restarted_while_an_earlier_epoch_is_pending_resumes_after_it(
        tmp_path: Path) -> None:
    """The producer's process dies while E-1 and E are decided and held down: its
    restarted process (first poll ``joining``) waits for the rewind its restart forces and
    learns its cut, which must count E."""
    sink = DownSink(DownTarget())

    async def scenario() -> None:
        actor = _actor(tmp_path, sink)
        try:
            sink.down_from = 0
            await actor.stream_start(5.0)
            await actor.stream_poll(1, True, 0)
            await _decided(actor, sink, 1, [1, 2])
            pending = await _decided(actor, sink, 2, [3, 4])
            restarted = asyncio.ensure_future(actor.stream_poll(1, True, None))
            await asyncio.sleep(0.1)
            failed = await actor.stream_tick(3, False)  # the driver sees the feed lost
            assert failed is not None
            assert await actor.resolve(failed.epoch, failed.attempt) == "ABORTED"
            await actor.resolve(failed.epoch + 1, failed.next_attempt)
            sink.down_from = pending.epoch
            await actor.stream_rewind(failed.epoch, 5.0)
            position = await restarted
            assert position is not None and position.committed == pending.epoch
        finally:
            sink.down_from = None
            await actor.close()

    asyncio.run(scenario())


def test_a_successor_coordinator_takes_the_stream_over_from_the_drivers_record(
        tmp_path: Path) -> None:
    """The coordinator is lost after epoch E-1 committed while E was being closed: its
    successor (same meta store, next generation) does not know the stream; the driver
    hands it over with its record, taken from its last tick's answer. Every feed is cut at
    the last decided epoch, except one whose older cut (an earlier rewind it has not
    applied) the record kept; a feed handed out after the loss has nothing to replay."""
    sink = DownSink(DownTarget())

    async def scenario() -> None:
        lost = _actor(tmp_path, sink)
        await lost.stream_start(5.0)
        for feed in (1, 2, 3):
            await lost.stream_poll(feed, True, 0)
        first = await lost.stream_tick(1, False)
        assert first is not None
        await lost.resolve(first.epoch, first.attempt)  # epoch 1 fails: a rewind, cut None
        await lost.resolve(first.epoch + 1, first.next_attempt)
        await lost.stream_rewind(first.epoch, 5.0)
        for feed in (1, 2):  # they replay and join again; feed 3 does not write again
            await lost.stream_poll(feed, False, 1)
        committed = await lost.stream_tick(2, False)
        assert committed is not None and committed.members == (1, 2)
        assert (await lost.commit_epoch(committed.epoch, committed.attempt,
                                        [_request(sink, committed, [1])], 5.0,
                                        committed.generation)).committed
        for feed in (1, 2):
            await lost.stream_poll(feed, False, 1)
        closing = await lost.stream_tick(3, False)  # then the coordinator is lost
        assert closing is not None
        record = dataclasses.replace(closing.state, feeds=3)
        await lost.close()

        successor = _actor(tmp_path, sink)
        try:
            assert await successor.stream_poll(1, False, 1) is None  # not handed over yet
            with pytest.raises(StreamUnknownError):
                await successor.stream_tick(4, False)
            assert await successor.resolve(closing.epoch, closing.attempt) == "ABORTED"
            state = await successor.stream_rewind(closing.epoch, 5.0, record, {"main": []})
            assert state.rewinds > record.rewinds + 1  # above any count the lost one reached
            assert state.epoch == closing.epoch
            survivor = await successor.stream_poll(1, False, 1)
            assert survivor is not None and survivor.rewound
            assert survivor.committed == committed.epoch and not survivor.member
            laggard = await successor.stream_poll(3, False, 0)
            assert laggard is not None and laggard.rewound and laggard.committed is None
            newcomer = await successor.stream_poll(4, True, None)
            assert newcomer is not None and not newcomer.rewound
            joined = await successor.stream_poll(1, False, state.rewinds)
            assert joined is not None and joined.member and joined.epoch == closing.epoch
        finally:
            await successor.close()

    asyncio.run(scenario())


def test_a_layout_change_is_refused_while_the_stream_runs(tmp_path: Path) -> None:
    """Stream epochs after the first are opened with their decision, never recorded OPEN
    before: the open-epoch check alone lets ``set_layout`` through while producers route
    by the old layout. Refused until the stream is drained."""
    sink = DownSink(DownTarget())

    async def scenario() -> None:
        actor = _actor(tmp_path, sink)
        try:
            await actor.stream_start(5.0)
            await actor.stream_poll(1, True, 0)
            tick = await actor.stream_tick(1, False)
            assert tick is not None
            await actor.commit_epoch(tick.epoch, tick.attempt, [_request(sink, tick, [1])],
                                     5.0, tick.generation)  # no epoch is OPEN now
            with pytest.raises(RescaleRefusedError, match=r"(?i)close the runtime"):
                await actor.set_layout(2)
            await actor.stream_poll(1, False, 0)
            assert await actor.stream_tick(2, True) is not None  # drained: ended
            await actor.set_layout(2)
        finally:
            await actor.close()

    asyncio.run(scenario())
