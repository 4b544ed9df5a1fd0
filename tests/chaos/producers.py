"""The producers of the chaos trials' producer ways in, written as a user would.

* ``feed_task``: a Ray task that feeds its table through ``with feed:`` (the README's
  "Many producers" task); ``FeedProducer``: a long-lived actor given a new feed each
  epoch.
* ``hold_block``: a Ray Data transform in front of the datasink (fused into the write
  task).
* ``StreamProducer``: a long-lived actor writing a replayable source into
  ``rt.stream()``, following the producer's contract: offsets noted in ``on_sent``,
  ``StreamRewind`` answered by seeking back, a restart resuming after
  ``feed.committed()``, ``wait_committed()`` once its source ended.

A producer-kill trial makes one producer its victim with a ``Hold``: after sending part
of its data the victim writes its pid into ``marker`` and pauses ``seconds``, so the
killer SIGKILLs it mid-epoch. Only the first process to reach the hold holds (the marker
exists afterwards): Ray's retry of a killed task runs through.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import ray

from raysink import Feed, StreamFeed, StreamRewind
from tests.chaos.targets import ID_BASE

__all__ = ["FeedProducer", "Hold", "OffsetBook", "StreamProducer", "feed_task",
           "hold_block", "stream_batch"]


@dataclass(frozen=True, kw_only=True)
class Hold:
    """Where the victim announces its pid, and how long it then pauses."""

    marker: str
    seconds: float = 10.0

    def reached(self) -> None:
        """Announce this process and pause, the first time any process gets here."""
        try:
            fd = os.open(self.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return
        with os.fdopen(fd, "w") as out:
            out.write(str(os.getpid()))
        time.sleep(self.seconds)


def _feed_table(feed: Feed, table: pa.Table, hold: Hold | None) -> int:
    """Feed ``table`` in two batches through ``with feed:``; a victim holds between."""
    half = max(1, table.num_rows // 2)
    with feed:
        feed.write(table.slice(0, half))
        if hold is not None:
            hold.reached()
        if table.num_rows > half:
            feed.write(table.slice(half))
    return table.num_rows


@ray.remote(num_cpus=0)
def feed_task(feed: Feed, table: pa.Table, hold: Hold | None = None) -> int:
    """A producer task (``.options(max_retries=...)`` sets Ray's retries)."""
    return _feed_table(feed, table, hold)


@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=0)
class FeedProducer:
    """A long-lived producer actor; each epoch hands it a feed and its part."""

    def feed(self, feed: Feed, table: pa.Table, hold: Hold | None = None) -> int:
        return _feed_table(feed, table, hold)

    def pid(self) -> int:
        return os.getpid()


def hold_block(batch: pa.Table, *, first_id: int, hold: Hold) -> pa.Table:
    """A Ray Data transform: the block holding ``first_id`` holds (once)."""
    if batch.num_rows and batch.column("id")[0].as_py() == first_id:
        hold.reached()
    return batch


# ---------------------------------------------------------------------- streams


def stream_batch(producer: int, offset: int, rows: int, generation: int) -> pa.Table:
    """Batch ``offset`` of producer ``producer``'s source: always the same ids, in group
    ``producer + 1`` (the ``epoch`` column holds the group); ``feed`` is the producer's
    generation (how many times it resumed), which tells a replay apart."""
    group = producer + 1
    first = group * ID_BASE + offset * rows
    return pa.table({
        "id": pa.array(range(first, first + rows), pa.int64()),
        "epoch": pa.array([group] * rows, pa.int64()),
        "feed": pa.array([generation] * rows, pa.int32()),
        "payload": pa.array([f"s{group}-{(offset * rows + i) % 97}" for i in range(rows)],
                            pa.string()),
    })


class OffsetBook:
    """The producer's durable notes: per epoch, the offset after its last batch in it,
    and its generation (a JSON file, replaced whole)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        raw = json.loads(path.read_text()) if path.exists() else {}
        self.ends: dict[int, int] = {int(k): v for k, v in raw.get("ends", {}).items()}
        self.generation: int = int(raw.get("generation", 0))

    def wrote(self, epoch: int, offset: int) -> None:
        self.ends[epoch] = offset + 1
        self._save()

    def resume_after(self, committed: int | None) -> int:
        """Forget the epochs after ``committed``; the offset to read from next."""
        self.ends = {e: end for e, end in self.ends.items()
                     if committed is not None and e <= committed}
        self.generation += 1
        self._save()
        return max(self.ends.values(), default=0)

    def _save(self) -> None:
        scratch = self.path.with_name(self.path.name + ".tmp")
        scratch.write_text(json.dumps({"ends": self.ends, "generation": self.generation}))
        os.replace(scratch, self.path)


@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=0)
class StreamProducer:
    """Writes batches ``[0, batches)`` of its source into the stream, resumable."""

    def __init__(self, producer: int, feed: StreamFeed, book: str, source: dict[str, Any]
                 ) -> None:
        self.producer, self.feed = producer, feed
        self.book = OffsetBook(Path(book))
        self.batches, self.rows = int(source["batches"]), int(source["batch_rows"])
        self.pause = float(source["pause"])

    def run(self) -> dict[str, int]:
        """Write to the source's end and until all of it is committed."""
        offset = self.book.resume_after(self.feed.committed())
        writes = rewinds = 0
        while True:
            try:
                while offset < self.batches:
                    table = stream_batch(self.producer, offset, self.rows, self.book.generation)
                    self.feed.write(table, on_sent=lambda e, at=offset: self.book.wrote(e, at))
                    offset += 1
                    writes += 1
                    time.sleep(self.pause)
                self.feed.wait_committed()
                return {"writes": writes, "rewinds": rewinds}
            except StreamRewind as rewind:
                rewinds += 1
                offset = self.book.resume_after(rewind.committed)

    def pid(self) -> int:
        return os.getpid()
