"""A writer's sink writer holds the rows of one attempt at a time.

``SinkWriterActor`` driven directly (no Ray), over a ``ListSink``. A sink writer keeps the
rows written since its last pre-commit without knowing their attempt (PostgreSQL's writer
keeps one open transaction the same way), and its rollback of any attempt drops them: so
the writer must never pre-commit an attempt while the sink writer holds another one's
rows, and never let the rollback of one attempt drop another's.

Chaos seed 1126 t0054 at 3064889 (a stream into two PostgreSQL sinks, under heavy load)
committed one producer batch of an aborted attempt beside its replay. The path found for
it is the first test: the stream gave up epoch 2 and epoch 3 (attempt 0 of each), and
epoch 3's CANCEL reached a writer only after the replay of epoch 2 (attempt 1). When epoch
2's CANCEL dropped its slot, epoch 3's slot became the oldest and its rows were applied;
then the replay's slot, an older epoch, became current, and its pre-commit staged epoch
3's rows with its own.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pytest

from raysink.errors import EpochFailedError
from raysink.protocol.barrier import BarrierFlags, CheckpointBarrier
from raysink.testing import ListSink
from raysink.writer.writer import SinkWriterActor, WriterConfig


def _rows(generation: int, count: int, first: int) -> pa.Table:
    return pa.table({"id": list(range(first, first + count)),
                     "feed": [generation] * count})


@pytest.fixture
def writer(tmp_path: Path) -> Iterator[SinkWriterActor]:
    config = WriterConfig(runtime="held", sink_name="main", sink=ListSink(tmp_path),
                          writer_id=0, coordinator="held.coordinator", flush_interval=3600.0)
    actor = SinkWriterActor(config)
    try:
        yield actor
    finally:
        actor.drain(CheckpointBarrier(999, 99, BarrierFlags.DRAIN))  # its threads stop


def _seal(writer: SinkWriterActor, epoch: int, attempt: int, feed: int, sent: int,
          checkpoint: int) -> tuple[int, int]:
    """``feed`` closes ``(epoch, attempt)`` having sent ``sent`` messages, and the epoch
    is sealed with it: the rows the ack counts, and those the manifest staged."""
    barrier = CheckpointBarrier(checkpoint, epoch, BarrierFlags.NONE)
    writer.feed_barrier(barrier, attempt, feed, sent)
    ack = writer.seal(barrier, attempt, [feed] if sent else [])
    assert ack.request.manifest is not None
    return ack.rows, int(ack.request.manifest["rows"])


def test_a_replay_pre_commits_only_its_own_rows(writer: SinkWriterActor) -> None:
    """Before: the replay pre-committed 17 rows (its 10 and epoch 3's 7), its ack said 10."""
    writer.write(2, 0, 0, [_rows(1, 10, 2_000_000)], 1)  # epoch 2 attempt 0: applied
    writer.write(3, 0, 0, [_rows(1, 7, 3_000_000)], 1)  # epoch 3 attempt 0: waits
    writer.cancel(CheckpointBarrier(100, 2, BarrierFlags.CANCEL), 0)  # epoch 3 applied
    writer.write(2, 1, 0, [_rows(2, 10, 2_000_000)], 2)  # the replay, before 3's CANCEL
    assert _seal(writer, 2, 1, 2, 1, 101) == (10, 10)
    with pytest.raises(EpochFailedError, match="rolled back from the sink writer"):
        _seal(writer, 3, 0, 1, 1, 102)  # its rows went: it fails, not pre-commits 0


def test_a_later_epoch_applied_first_is_not_staged_by_an_earlier_one(
        writer: SinkWriterActor) -> None:
    """A stream's epoch 3 reaches a writer that got nothing of epoch 2 before epoch 2's
    seal does. Before: epoch 2 pre-committed epoch 3's rows as its own."""
    writer.write(3, 0, 0, [_rows(1, 7, 3_000_000)], 1)  # the only slot: applied
    assert _seal(writer, 2, 0, 1, 0, 100) == (0, 0)
    with pytest.raises(EpochFailedError, match="rolled back from the sink writer"):
        _seal(writer, 3, 0, 1, 1, 101)


def test_a_late_cancel_of_an_earlier_attempt_keeps_the_retry_rows(
        writer: SinkWriterActor) -> None:
    """The CANCEL of attempt 0, which sent this writer nothing, arrives after the retry's
    rows. Before: its rollback dropped them, and the retry pre-committed 0 rows while its
    ack said 10 (a loss)."""
    writer.write(2, 1, 0, [_rows(2, 10, 2_000_000)], 1)
    writer.cancel(CheckpointBarrier(100, 2, BarrierFlags.CANCEL), 0)
    assert _seal(writer, 2, 1, 1, 1, 101) == (10, 10)


def test_a_cancel_of_a_pre_committed_attempt_fails_the_rows_it_dropped(
        writer: SinkWriterActor) -> None:
    """Epoch 2 pre-committed here; its CANCEL (the epoch failed at another writer) comes
    after the retry's rows. The sink writer must drop epoch 2's staging, which drops the
    retry's rows too: the retry fails rather than pre-commit without them."""
    writer.write(2, 0, 0, [_rows(1, 10, 2_000_000)], 1)
    assert _seal(writer, 2, 0, 1, 1, 100) == (10, 10)
    writer.write(2, 1, 0, [_rows(2, 10, 2_000_000)], 1)
    writer.cancel(CheckpointBarrier(101, 2, BarrierFlags.CANCEL), 0)
    with pytest.raises(EpochFailedError, match="rolled back from the sink writer"):
        _seal(writer, 2, 1, 1, 1, 102)
