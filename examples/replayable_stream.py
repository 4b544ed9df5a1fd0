"""A continuous stream from producers with a replayable source, exactly once.

Each producer is a Ray actor reading a source it can seek in (here a deterministic
"log": batch ``i`` of producer ``p`` always holds the same rows; a Kafka partition with
offsets works the same way). It keeps, durably, the source offsets it wrote into each
epoch, and follows raysink's contract for streams:

- after each ``feed.write``, ``feed.last_epoch`` says which epoch the batch went into:
  note the batch's offset against that epoch;
- on ``StreamRewind(committed=C)``: seek back to the first offset noted for an epoch
  after ``C`` and write on (the rows of the epochs after ``C`` were dropped);
- on a restart: seek to the same place from the durable notes, with ``C`` from
  ``feed.committed()`` (a restart also makes the stream rewind, so the next write may
  raise ``StreamRewind`` once more: follow it);
- when the source ends, ``feed.wait_committed()`` before stopping: a rewind until then
  still needs the producer's rows.

Run: ``python examples/replayable_stream.py /tmp/replayable`` (local Ray, a Parquet
table, a SQLite meta store under that directory).
"""

from __future__ import annotations

import json
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
    """Per epoch, the first and the next offset this producer wrote into it (a JSON file:
    it survives the producer's restart)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        raw = json.loads(path.read_text()) if path.exists() else {}
        self.epochs: dict[int, list[int]] = {int(k): v for k, v in raw.items()}

    def wrote(self, epoch: int, offset: int) -> None:
        first, _ = self.epochs.get(epoch, [offset, offset])
        self.epochs[epoch] = [min(first, offset), offset + 1]
        self.path.write_text(json.dumps(self.epochs))

    def resume_after(self, committed: int | None) -> int:
        """Where to read from when every epoch after ``committed`` was dropped."""
        later = [first for epoch, (first, _) in self.epochs.items()
                 if committed is None or epoch > committed]
        if later:
            return min(later)
        done = [end for epoch, (_, end) in self.epochs.items()]
        return max(done, default=0)


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
                    self.feed.write(source_batch(self.producer, offset))
                    assert self.feed.last_epoch is not None
                    self.book.wrote(self.feed.last_epoch, offset)
                    offset += 1
                    writes += 1
                    time.sleep(pause)
                self.feed.wait_committed()  # a failed epoch may still need our rows
                return writes
            except StreamRewind as rewind:
                offset = self.book.resume_after(rewind.committed)

    def pid(self) -> int:
        import os

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
