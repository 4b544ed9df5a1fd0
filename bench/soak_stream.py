"""The stream side of ``bench/soak.py``: long-lived producer actors writing into
``rt.stream()`` until told to stop, following the producer's contract.

Producer ``p`` writes batches of ``rows`` fresh rows, ids ``p * ID_SPACE + k`` for
``k = 0, 1, ...`` (batch ``b`` holds ``k`` in ``[b * rows, (b + 1) * rows)``: its source
is replayable by offset), with a pause between batches. It notes in ``on_sent`` where its
writes into each epoch end; on ``StreamRewind`` it drops the notes after the cut and
seeks back. Its notes stay small: every 100 batches the ones at or below the committed
epoch collapse into one. ``stop()`` ends the writing; ``run`` then waits until its last
epoch is committed and returns how many batches it wrote and how many rewinds it saw.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import ray

from raysink import SinkRuntime, StreamFeed, StreamRewind

ID_SPACE = 10**10
_COLLAPSE_EVERY = 100


def stream_batch(producer: int, batch: int, rows: int) -> pa.Table:
    first = producer * ID_SPACE + batch * rows
    ids = pa.array(np.arange(first, first + rows, dtype=np.int64))
    return pa.table({"id": ids,
                     "name": pc.binary_join_element_wise("s-", pc.cast(ids, pa.string()), ""),
                     "value": pa.array(np.full(rows, float(producer)))})


@ray.remote(num_cpus=0, max_concurrency=2, max_restarts=0)
class SoakProducer:
    """One producer of the soak's stream (``stop`` runs beside ``run``)."""

    def __init__(self, producer: int, feed: StreamFeed, rows: int, pause: float) -> None:
        self.producer, self.feed, self.rows, self.pause = producer, feed, rows, pause
        self.ends: dict[int, int] = {}  # epoch -> the batch after its last one
        self.base = 0  # where the writes into the collapsed (committed) epochs end
        self._stop = threading.Event()

    def run(self) -> dict[str, int]:
        batch = self._resume(self.feed.committed())
        written = rewinds = 0
        while True:
            try:
                while not self._stop.is_set():
                    self.feed.write(stream_batch(self.producer, batch, self.rows),
                                    on_sent=lambda e, b=batch: self._note(e, b))
                    batch += 1
                    written += 1
                    if written % _COLLAPSE_EVERY == 0:
                        self._collapse(self.feed.committed())
                    time.sleep(self.pause)
                self.feed.wait_committed(timeout=600)
                return {"batches": batch, "writes": written, "rewinds": rewinds}
            except StreamRewind as rewind:
                rewinds += 1
                batch = self._resume(rewind.committed)

    def _note(self, epoch: int, batch: int) -> None:
        self.ends[epoch] = batch + 1

    def _resume(self, committed: int | None) -> int:
        self.ends = {e: end for e, end in self.ends.items()
                     if committed is not None and e <= committed}
        return max([self.base, *self.ends.values()])

    def _collapse(self, committed: int | None) -> None:
        if committed is None:
            return
        done = [e for e in self.ends if e <= committed]
        if done:
            self.base = max(self.base, *(self.ends.pop(e) for e in done))

    def stop(self) -> None:
        self._stop.set()

    def pid(self) -> int:
        return os.getpid()


@dataclass
class StreamTotals:
    batches: list[int]
    writes: int
    rewinds: int
    error: str | None = None


class StreamSide:
    """The stream's producers on ``rt``; ``stop()`` ends them and returns the totals."""

    def __init__(self, rt: SinkRuntime, *, producers: int, rows: int, pause: float) -> None:
        self.rt, self.rows = rt, rows
        self.actors = [SoakProducer.remote(p, rt.stream(), rows, pause)  # type: ignore[attr-defined]
                       for p in range(producers)]
        self._pids = ray.get([a.pid.remote() for a in self.actors], timeout=60)
        self._runs = [a.run.remote() for a in self.actors]

    def pids(self) -> dict[str, int]:
        return {f"producer-{p}": pid for p, pid in enumerate(self._pids)}

    def stop(self, timeout: float = 900.0) -> StreamTotals:
        ray.get([a.stop.remote() for a in self.actors], timeout=60)
        try:
            outcomes: list[dict[str, Any]] = ray.get(self._runs, timeout=timeout)
        except Exception as exc:
            return StreamTotals(batches=[], writes=0, rewinds=0,
                                error=f"{type(exc).__name__}: {exc}")
        return StreamTotals(batches=[int(o["batches"]) for o in outcomes],
                            writes=sum(int(o["writes"]) for o in outcomes),
                            rewinds=sum(int(o["rewinds"]) for o in outcomes))

    def expected(self, totals: StreamTotals) -> dict[int, tuple[int, int]]:
        """Producer -> (first id, rows) its source wrote."""
        return {p: (p * ID_SPACE, batches * self.rows)
                for p, batches in enumerate(totals.batches)}

    def end(self) -> None:
        for actor in self.actors:
            ray.kill(actor)
