"""A continuous stream from producers with a replayable source, exactly once.

Each producer is a Ray actor reading a source it can seek in (here a deterministic
"log": batch ``i`` of producer ``p`` always holds the same rows; a Kafka partition with
offsets works the same way). It keeps, durably, the source offsets it wrote into each
epoch, and follows raysink's contract for streams:

- ``feed.write(batch, on_sent=...)``: the callback gets the epoch the batch went into,
  before that epoch can close: note there, durably, that the producer's writes into
  that epoch end after this batch's offset;
- on ``StreamRewind(committed=C)``: forget the notes of the epochs after ``C`` (their
  rows were dropped) and seek to where the writes into epochs up to ``C`` ended;
- on a restart: the same, with ``C = feed.committed()`` (after a restart that forced a
  rewind it returns once the rewind happened; a later write may still raise
  ``StreamRewind``: follow it);
- when the source ends, ``feed.wait_committed()`` before stopping: a rewind until then
  still needs the producer's rows.

``C`` is the last epoch *decided* when the producer's later writes were dropped: a
decided epoch (committed, or decided and still committing) is never given up. The same
handling covers every failure; what the runtime does meanwhile:

- a writer killed (Ray restarts it) or replaced (the runtime re-creates it): the epochs it
  held data of fail, the stream rewinds; a write whose send failed raises
  ``StreamRewind`` (never Ray's error) once it did, and later writes go to the writers as
  they are now;
- the coordinator lost: the driver re-creates it and hands the stream over; the feed
  finds the new one, and every producer rewinds to the last epoch decided before the
  loss;
- ``rt.rescale()`` is refused while the stream runs (``RescaleRefusedError``): close the
  runtime, open it with ``writers=N``, start the stream again; producers resume from
  ``feed.committed()``.

Run: ``python examples/replayable_stream.py /tmp/replayable`` (local Ray, a Parquet
table, a SQLite meta store under that directory).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import ray

from raysink import SinkRuntime, StreamFeed, StreamRewind
from raysink.sinks import ParquetSink

ROWS_PER_BATCH = 100


def source_batch(producer: int, offset: int) -> pa.Table:
    """Batch ``offset`` of producer ``producer``'s log: always the same rows."""
    first = producer * 1_000_000 + offset * ROWS_PER_BATCH
    ids = list(range(first, first + ROWS_PER_BATCH))
    return pa.table({"id": pa.array(ids, pa.int64()),
                     "customer": pa.array([f"c{i % 37}" for i in ids]),
                     "amount": pa.array([i * 0.5 for i in ids], pa.float64())})


class OffsetBook:
    """Per epoch, the offset after the last batch this producer wrote into it (a JSON
    file, replaced whole: it survives the producer's restart, even one in mid-save)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        raw = json.loads(path.read_text()) if path.exists() else {}
        self.ends: dict[int, int] = {int(k): v for k, v in raw.items()}

    def wrote(self, epoch: int, offset: int) -> None:
        self.ends[epoch] = offset + 1
        self._save()

    def resume_after(self, committed: int | None) -> int:
        """Where to read from when every epoch after ``committed`` was dropped: the
        notes of those epochs go, the writes into the others ended where we resume."""
        self.ends = {epoch: end for epoch, end in self.ends.items()
                     if committed is not None and epoch <= committed}
        self._save()
        return max(self.ends.values(), default=0)

    def _save(self) -> None:
        scratch = self.path.with_name(self.path.name + ".tmp")
        scratch.write_text(json.dumps(self.ends))
        os.replace(scratch, self.path)


@ray.remote(max_restarts=1, max_task_retries=0)
class ReplayableProducer:
    """Writes its log's batches ``[0, batches)`` into the stream, forever resumable."""

    def __init__(self, producer: int, feed: StreamFeed, offsets: str) -> None:
        self.producer, self.feed = producer, feed
        self.book = OffsetBook(Path(offsets))

    def run(self, batches: int, pause: float = 0.0) -> int:
        """Write until the log's end and until all of it is committed; returns how many
        batch writes it made (more than ``batches`` when it replayed)."""
        offset = self.book.resume_after(self.feed.committed())
        writes = 0
        while True:
            try:
                while offset < batches:
                    self.feed.write(source_batch(self.producer, offset),
                                    on_sent=lambda epoch, at=offset: self.book.wrote(epoch, at))
                    offset += 1
                    writes += 1
                    time.sleep(pause)
                self.feed.wait_committed()  # a failed epoch may still need our rows
                return writes
            except StreamRewind as rewind:
                offset = self.book.resume_after(rewind.committed)

    def pid(self) -> int:
        return os.getpid()


def main(workdir: str) -> None:
    root = Path(workdir)
    root.mkdir(parents=True, exist_ok=True)
    ray.init(num_cpus=4)
    rt = SinkRuntime("replayable-stream", ParquetSink(str(root / "table")), writers=2,
                     metastore=f"sqlite:///{root / 'meta.db'}", checkpoint_interval=1.0)
    with rt:
        producers: list[Any] = [
            ReplayableProducer.remote(p, rt.stream(), str(root / f"offsets-{p}.json"))
            for p in range(2)]
        ray.get([p.run.remote(40, 0.05) for p in producers])
        print(f"written; epochs committed so far: {rt.status().last_committed_epoch}; "
              "closing drains the last one")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "/tmp/raysink-replayable")
