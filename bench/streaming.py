"""Benchmark: epochs in flight, short epochs back to back (not a test).

Two ways of writing a stream of small epochs into a ``ParquetSink``, side by side in one
run, each at every writer count of ``--writers`` (default 2 and 16; writer actors reserve
no CPU, as in ``bench/epoch_cost.py``); Ray is started with ``--cpus`` logical CPUs:

(a) ``write_arrow``: the driver writes one ``--rows``-row table (10,000) per epoch with
    ``rt.write_arrow(table)``, back to back (``max_pending_epochs=2``). Each call returns
    once its epoch is visible, so the data of the next epoch waits for the commit.
(b) ``stream``: ``--producers`` Ray actors, each with its own ``feed = rt.stream()``,
    write ``--rows``-row batches back to back with ``feed.write(batch)``; the driver ticks
    an epoch every ``--interval`` seconds (``SinkRuntime(checkpoint_interval=...)``), and
    while an epoch commits the producers already write the next one. Each feed's
    ``poll_interval`` is set to ``--poll`` (a producer learns its barrier from its poll:
    with the default 0.5 s, epochs could not be shorter than that).

Each case runs ``--warmup`` seconds unmeasured, then ``--seconds`` measured. Reported:

* epochs/s: epochs committed in the measured window (for (a) the ``write_arrow`` calls
  that returned in it; for (b) the growth of ``rt.status().last_committed_epoch``);
* rows/s: rows of those epochs (for (b) counted in the target: the Parquet files of the
  epochs committed in the window, by the epoch in their names);
* outside writing: the fraction of the window in which a producer is not sending data.
  "Sending data" is the time inside the call that hands a batch to the writers, until the
  credit window took it: ``raysink.driver.routing.send`` for (a) (every write of the epoch sent
  and acknowledged by its writer), ``Feed.write`` inside ``StreamFeed.write`` for (b)
  (the epoch's feed; not the closing of the previous epoch's part that ``StreamFeed.write``
  does first). Everything else counts as outside: making the batch, putting it into the
  object store, barriers and pre-commits (each writer's flush of its staged file),
  the decision and the sinks' commits, and for (b) closing each epoch's part (barriers
  to the writers, ``feed_closed`` to the coordinator). For (b) it is the mean over the
  producers. Timestamps are ``time.monotonic()`` (CLOCK_MONOTONIC, one clock for every
  process of the machine), taken around those calls by wrappers this script installs in
  the driver and in the producer actors (raysink's code is not changed);
* commit busy: the fraction of the window in which the driver was committing an epoch
  (``EpochDriver.commit_barriers``: the barriers' or seals' answers, then the single
  ``commit_epoch`` call until the epoch is visible). In (a) it excludes writing; in (b) it
  overlaps the producers' writing: that overlap is the point of epochs in flight. Beside
  it, the median length of one such commit (p50).

In (b) an epoch holds what the producers wrote between two ticks, not ``--rows`` rows: the
driver ticks ``--interval`` after the previous epoch's commit returned, so the epoch's
size follows from the rate and the commit time (the rows/epoch column shows it).

Every case then checks the target holds exactly the rows sent (each id once).

    .venv/bin/python bench/streaming.py [--writers 2,16] [--rows 10000] [--seconds 8]
        [--warmup 2] [--interval 0.1] [--poll 0.05] [--producers 2] [--cpus 16]
        [--modes write_arrow,stream]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import logging
import re
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import ray

import raysink.driver.routing
from raysink import SinkRuntime, StreamRewind
from raysink.driver.epoch import EpochDriver
from raysink.driver.stream_feed import StreamFeed
from raysink.sinks import ParquetSink

ID_SPAN = 10**12
"""Producer ``p`` writes ids ``p * ID_SPAN + 0, 1, ...``: the target's ids say who sent what."""

_PART = re.compile(r"^part-e(\d+)-")


def make_batch(start: int, rows: int) -> pa.Table:
    ids = np.arange(start, start + rows, dtype=np.int64)
    return pa.table({"id": ids, "amount": ids.astype(np.float64) * 0.5})


# ----------------------------------------------------------------------------- timing


class Spans:
    """``(start, end)`` of every call to what ``wrap`` wrapped, on ``time.monotonic``."""

    def __init__(self) -> None:
        self.spans: list[tuple[float, float]] = []

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.monotonic()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spans.append((started, time.monotonic()))

        return timed

    def within(self, lo: float, hi: float) -> float:
        """Seconds of ``[lo, hi]`` covered by at least one span."""
        return covered(self.spans, lo, hi)

    def median(self, lo: float, hi: float) -> float:
        """The median length of the spans that began in ``[lo, hi]`` (0 when none)."""
        lengths = [end - start for start, end in self.spans if lo <= start <= hi]
        return statistics.median(lengths) if lengths else 0.0


def covered(spans: Sequence[tuple[float, float]], lo: float, hi: float) -> float:
    total, reach = 0.0, lo
    for start, end in sorted(spans):
        start, end = max(start, reach), min(end, hi)
        if end > start:
            total += end - start
            reach = end
    return total


@contextlib.contextmanager
def instrumented(targets: Sequence[tuple[object, str, Spans]]) -> Iterator[None]:
    """Replace each ``owner.name`` by a timing wrapper for the block."""
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in targets]
    for (owner, name, original), (_, _, spans) in zip(saved, targets, strict=True):
        setattr(owner, name, spans.wrap(original))
    try:
        yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)


# ----------------------------------------------------------------------------- target


def part_files(path: Path) -> list[tuple[int, Path]]:
    """The committed Parquet files of a ``ParquetSink`` directory, with their epoch."""
    found = []
    for file in path.glob("part-*.parquet"):
        match = _PART.match(file.name)
        if match:
            found.append((int(match.group(1)), file))
    return found


def rows_of_epochs(path: Path, first: int, last: int) -> int:
    """Rows the target holds of epochs ``first`` .. ``last``."""
    return sum(pq.read_metadata(file).num_rows
               for epoch, file in part_files(path) if first <= epoch <= last)


def check_exactly_once(path: Path, sent: Mapping[int, int]) -> None:
    """The target holds ids ``p * ID_SPAN + i`` for ``i < sent[p]``, each exactly once."""
    files = [file for _, file in part_files(path)]
    ids = (pa.concat_arrays([c for f in files for c in pq.read_table(f, columns=["id"])
                             .column("id").chunks]) if files else pa.array([], pa.int64()))
    expected = sum(sent.values())
    inside = sum(pc.sum(pc.and_(pc.greater_equal(ids, p * ID_SPAN),
                                pc.less(ids, p * ID_SPAN + n))).as_py() or 0
                 for p, n in sent.items())
    distinct = pc.count_distinct(ids).as_py() if len(ids) else 0
    if not len(ids) == inside == distinct == expected:
        raise SystemExit(f"{path.name}: target holds {len(ids)} rows ({distinct} distinct, "
                         f"{inside} of the ids sent), expected exactly {expected}")


# ----------------------------------------------------------------------------- results


@dataclass(frozen=True, kw_only=True, slots=True)
class Result:
    mode: str
    writers: int
    epochs: int
    rows: int
    wall: float
    outside_writing: float  # fraction of the window
    commit_busy: float  # fraction of the window
    commit_p50: float  # seconds of one EpochDriver.commit_barriers
    note: str = ""

    def line(self) -> str:
        return (f"  {self.mode:<12} {self.writers:3d} writers  {self.epochs / self.wall:7.1f} "
                f"epochs/s  {self.rows / self.wall / 1e3:8.1f} k rows/s  "
                f"{self.rows / max(self.epochs, 1):9,.0f} rows/epoch  outside writing "
                f"{self.outside_writing:5.1%}  commit busy {self.commit_busy:5.1%} "
                f"(p50 {self.commit_p50 * 1e3:.1f} ms)"
                + (f"  ({self.note})" if self.note else ""))


def make_runtime(name: str, root: Path, writers: int, **options: Any) -> SinkRuntime:
    return SinkRuntime(name, ParquetSink(str(root / name)), writers=writers,
                       metastore=f"sqlite:///{root / 'meta.db'}", max_pending_epochs=2,
                       progress=False, **options)


# ----------------------------------------------------------------------------- (a)


def run_write_arrow(args: argparse.Namespace, writers: int, root: Path) -> Result:
    """The driver's ``write_arrow`` per epoch, back to back."""
    name = f"stream-a-{writers}"
    sent = 0
    send, commit = Spans(), Spans()
    with make_runtime(name, root, writers) as rt:

        def epoch() -> None:
            nonlocal sent
            report = rt.write_arrow(make_batch(sent, args.rows))
            if not report.committed or report.rows != args.rows:
                raise SystemExit(f"{name}: epoch not committed whole: {report}")
            sent += args.rows

        until = time.monotonic() + args.warmup
        while time.monotonic() < until:
            epoch()
        with instrumented([(raysink.driver.routing, "send", send),
                           (EpochDriver, "commit_barriers", commit)]):
            epochs, started = 0, time.monotonic()
            while time.monotonic() - started < args.seconds:
                epoch()
                epochs += 1
            ended = time.monotonic()
    check_exactly_once(root / name, {0: sent})
    wall = ended - started
    return Result(mode="write_arrow", writers=writers, epochs=epochs, rows=epochs * args.rows,
                  wall=wall, outside_writing=1 - send.within(started, ended) / wall,
                  commit_busy=commit.within(started, ended) / wall,
                  commit_p50=commit.median(started, ended))


# ----------------------------------------------------------------------------- (b)


class ProducerBody:
    """A long-lived producer: ``rows``-row batches into the stream, back to back, with
    the replay contract (on ``StreamRewind`` it writes again from the first id it sent
    into an epoch after the committed one; its ids are its source offsets)."""

    def __init__(self, feed: StreamFeed, index: int, rows: int) -> None:
        from raysink.driver.feed import Feed

        self.feed, self.rows = feed, rows
        self.base = index * ID_SPAN
        self.next = 0  # the next id to write, relative to base
        self.first_of: dict[int, int] = {}  # epoch -> the first id written into it
        self.writing, self.closing = Spans(), Spans()
        Feed.write = self.writing.wrap(Feed.write)  # type: ignore[method-assign]
        StreamFeed._close_claimed = self.closing.wrap(  # type: ignore[method-assign]
            StreamFeed._close_claimed)

    def ready(self) -> bool:
        return True

    def run(self, until: float) -> dict[str, Any]:
        """Write until ``until`` (``time.monotonic``); then, as the stream's contract asks
        of a producer whose source ended, wait until the epoch of the last write is
        committed (a rewind meanwhile drops what came after the committed epoch: the
        source then ends there); then leave the stream."""
        while time.monotonic() < until:
            try:
                self.feed.write(make_batch(self.base + self.next, self.rows))
            except StreamRewind as rewind:
                self._replay_from(rewind.committed)
                continue
            epoch = self.feed.last_epoch
            assert epoch is not None
            self.first_of.setdefault(epoch, self.next)
            self.next += self.rows
        try:
            self.feed.wait_committed()
        except StreamRewind as rewind:
            self._replay_from(rewind.committed)
        self.feed.close()
        return {"sent": self.next, "writing": self.writing.spans, "closing": self.closing.spans}

    def _replay_from(self, committed: int | None) -> None:
        lost = [e for e in self.first_of if committed is None or e > committed]
        if lost:
            self.next = min(self.first_of[e] for e in lost)
        for epoch in lost:
            del self.first_of[epoch]


Producer: Any = ray.remote(num_cpus=0)(ProducerBody)


class FailedEpochs(logging.Handler):
    """Counts the stream's failed epochs (each rewinds the stream) from the driver's log,
    including those after the producers stopped writing."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        if str(record.msg).startswith("stream epoch"):
            self.count += 1


def run_stream(args: argparse.Namespace, writers: int, root: Path) -> Result:
    """``--producers`` actors writing the continuous stream; the driver ticks."""
    name = f"stream-b-{writers}"
    commit, failed = Spans(), FailedEpochs()
    stream_log = logging.getLogger("raysink.driver.stream_feed")
    stream_log.addHandler(failed)
    with contextlib.ExitStack() as stack:
        stack.callback(stream_log.removeHandler, failed)
        stack.enter_context(instrumented([(EpochDriver, "commit_barriers", commit)]))
        rt = stack.enter_context(make_runtime(name, root, writers,
                                              checkpoint_interval=args.interval))
        feeds = [rt.stream(poll_interval=args.poll) for _ in range(args.producers)]
        producers = [Producer.remote(feed, i, args.rows) for i, feed in enumerate(feeds)]
        ray.get([p.ready.remote() for p in producers])
        begun = time.monotonic()
        runs = [p.run.remote(begun + args.warmup + args.seconds + 1.0) for p in producers]
        time.sleep(args.warmup)
        started, first = time.monotonic(), rt.status().last_committed_epoch or 0
        time.sleep(args.seconds)
        last, ended = rt.status().last_committed_epoch or 0, time.monotonic()
        stats = ray.get(runs)
    check_exactly_once(root / name, {i: s["sent"] for i, s in enumerate(stats)})
    wall = ended - started
    writing = [covered(s["writing"], started, ended) / wall for s in stats]
    closing = [covered(s["closing"], started, ended) / wall for s in stats]
    note = (f"{args.producers} producers, interval {args.interval:g} s; closing parts "
            f"{sum(closing) / len(closing):.1%}"
            + (f"; {failed.count} epochs failed, the stream rewound" if failed.count else ""))
    return Result(mode="stream", writers=writers, epochs=last - first,
                  rows=rows_of_epochs(root / name, first + 1, last), wall=wall,
                  outside_writing=1 - sum(writing) / len(writing),
                  commit_busy=commit.within(started, ended) / wall,
                  commit_p50=commit.median(started, ended), note=note)


# ----------------------------------------------------------------------------- main

MODES: dict[str, Callable[[argparse.Namespace, int, Path], Result]] = {
    "write_arrow": run_write_arrow, "stream": run_stream}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--writers", default="2,16")
    parser.add_argument("--rows", type=int, default=10_000)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--interval", type=float, default=0.1)
    parser.add_argument("--poll", type=float, default=0.05)
    parser.add_argument("--producers", type=int, default=2)
    parser.add_argument("--cpus", type=int, default=16)
    parser.add_argument("--modes", default="write_arrow,stream")
    args = parser.parse_args()
    modes = [m.strip() for m in args.modes.split(",")]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        parser.error(f"unknown mode(s) {unknown}; choose from {list(MODES)}")
    root = Path(tempfile.mkdtemp(prefix="raysink-bench-streaming-"))
    results: list[Result] = []
    ray.init(address="local", num_cpus=args.cpus, include_dashboard=False,
             log_to_driver=False)
    try:
        for writers in (int(w) for w in args.writers.split(",")):
            for mode in modes:
                results.append(MODES[mode](args, writers, root))
                print(results[-1].line(), flush=True)
    finally:
        ray.shutdown()
        shutil.rmtree(root, ignore_errors=True)
    print(f"\n{args.rows:,}-row batches, {args.seconds:g} s measured after {args.warmup:g} s "
          "warm-up per case; every target checked exactly once")
    for result in results:
        print(result.line())


if __name__ == "__main__":
    main()
