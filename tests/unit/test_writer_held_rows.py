"""A writer's sink writer holds the rows of one attempt at a time: a known gap.

``SinkWriterActor`` driven directly (no Ray), over a ``ListSink``. Its sink writer buffers
rows without knowing their attempt (PostgreSQL's writer keeps one open transaction the
same way), so the writer must never pre-commit an attempt while the sink writer still
holds rows of another one.

Chaos seed 1126 t0054 at 3064889 (a stream into two PostgreSQL sinks, under heavy load)
committed one producer batch of an aborted attempt beside its replay. This is the path
found for it: the stream gave up epoch 2 and epoch 3 (attempt 0 of each), and epoch 3's
CANCEL reached a writer only after the replay of epoch 2 (attempt 1). When epoch 2's
CANCEL dropped its slot, epoch 3's slot became the oldest and its rows were applied; then
the replay's slot, an older epoch, became current, and its pre-commit staged epoch 3's
rows with its own. The test is marked ``xfail(strict=True)`` until the writer ties what
its sink writer holds to one slot: it then passes and the mark must go.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest

from raysink.protocol.barrier import BarrierFlags, CheckpointBarrier
from raysink.testing import ListSink
from raysink.writer.writer import SinkWriterActor, WriterConfig


def _rows(generation: int, count: int, first: int) -> pa.Table:
    return pa.table({"id": list(range(first, first + count)),
                     "feed": [generation] * count})


@pytest.mark.xfail(strict=True, reason="known gap (chaos seed 1126 t0054): the sink writer "
                   "holds rows of a newer attempt when an older epoch's replay pre-commits")
def test_a_replay_pre_commits_only_its_own_rows(tmp_path: Path) -> None:
    config = WriterConfig(runtime="held", sink_name="main", sink=ListSink(tmp_path),
                          writer_id=0, coordinator="held.coordinator", flush_interval=3600.0)
    writer = SinkWriterActor(config)
    try:
        writer.write(2, 0, 0, [_rows(1, 10, 2_000_000)], 1)  # epoch 2 attempt 0: applied
        writer.write(3, 0, 0, [_rows(1, 7, 3_000_000)], 1)  # epoch 3 attempt 0: waits
        writer.cancel(CheckpointBarrier(100, 2, BarrierFlags.CANCEL), 0)  # epoch 3 applied
        writer.write(2, 1, 0, [_rows(2, 10, 2_000_000)], 2)  # the replay, before 3's CANCEL
        barrier = CheckpointBarrier(101, 2, BarrierFlags.NONE)
        writer.feed_barrier(barrier, 1, 2, 1)
        ack = writer.seal(barrier, 1, [2])
    finally:
        writer.drain(CheckpointBarrier(102, 3, BarrierFlags.DRAIN))  # its threads stop
    assert ack.request.manifest is not None
    assert (ack.rows, ack.request.manifest["rows"]) == (10, 10)  # staged 17 today
