"""Benchmark: ``write_arrow`` into a ParquetSink versus one process writing Parquet (not a test).

One table (default 6 M rows: a long, a double, a string, a bool) is cut into pieces and
put into the object store before anything is timed. Then alternating rounds time, on the
same refs:

* ``raysink``  ``rt.write_arrow(refs)`` into a ``ParquetSink`` with ``--writers`` (2)
               writers: one exactly-once epoch (the runtime is started once, before);
* ``pyarrow``  ``ray.get`` of every piece in this process, then one
               ``pyarrow.parquet.write_table`` of the whole table (same compression and
               row-group size as the sink, fsynced like the sink's files);
* ``tuned``    the same with raysink's per-column dictionary choice (pyarrow's default
               tries a dictionary on every column; on unique ids and measurements that
               is wasted work), to show what the two writers alone bring.

Each round prints seconds and rows/s; the end prints medians and the ratio
raysink / pyarrow (target >= 1.0: two writers on two cores).

Then the overhead of an empty epoch (``rt.write_arrow([])``) with 1, 2, 4 and 8 writers:
p50, p99 and mean over ``--epochs`` (100) epochs after a warm-up (targets: p50 < 10 ms at 2
writers, p99 < 2 x p50). With ``--spans`` the driver's phases of each empty epoch are timed
too (open_epoch, feed + barriers until every writer has its ack, wait_committed), and the
meta store and filesystem primitives are timed on their own: one SQLite write
transaction, ``fsync`` of a small file and of a directory.

    .venv/bin/python bench/write_arrow.py [--rows 6000000] [--rounds 3] [--epochs 100]
                                          [--writer-counts 1,2,4,8] [--spans]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import ray

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from raysink import SinkRuntime
from raysink.driver.epoch import EpochDriver
from raysink.sinks import ParquetSink
from raysink.sinks._parquet_buffer import dictionary_columns

COMPRESSION = "zstd"  # ParquetSink's default
ROW_GROUP = 131_072  # ParquetSink's default row_group_size


def make_table(rows: int) -> pa.Table:
    """``rows`` rows: a unique id, a double, a short string and a bool."""
    rng = np.random.default_rng(7)
    names = np.array([f"customer-{i:05d}" for i in range(5000)], dtype=object)
    return pa.table({
        "id": pa.array(np.arange(rows, dtype=np.int64)),
        "amount": pa.array(rng.random(rows) * 1000),
        "customer": pa.array(names[rng.integers(0, 5000, rows)], pa.string()),
        "flag": pa.array(rng.random(rows) > 0.5),
    })


def put_pieces(table: pa.Table, pieces: int) -> list[Any]:
    step = -(-table.num_rows // pieces)
    return [ray.put(table.slice(i, step)) for i in range(0, table.num_rows, step)]


# ----------------------------------------------------------------------------- throughput


def run_pyarrow(refs: list[Any], out: Path, *, tuned: bool = False) -> float:
    """Seconds for ``ray.get`` of every piece plus one fsynced ``write_table``; ``tuned``
    uses raysink's per-column dictionary choice instead of pyarrow's default."""
    started = time.perf_counter()
    table = pa.concat_tables(ray.get(refs))
    dictionary = dictionary_columns(table) if tuned else True
    with open(out, "wb") as handle:
        pq.write_table(table, handle, compression=COMPRESSION, row_group_size=ROW_GROUP,
                       use_dictionary=dictionary)
        handle.flush()
        os.fsync(handle.fileno())
    return time.perf_counter() - started


def run_raysink(rt: SinkRuntime, refs: list[Any], rows: int) -> float:
    started = time.perf_counter()
    report = rt.write_arrow(refs)
    seconds = time.perf_counter() - started
    if not report.committed or report.rows != rows:
        raise SystemExit(f"raysink epoch not committed as expected: {report}")
    return seconds


def throughput(args: argparse.Namespace, root: Path) -> None:
    table = make_table(args.rows)
    refs = put_pieces(table, args.pieces)
    del table
    print(f"data: {args.rows:,} rows in {len(refs)} object-store pieces, "
          f"compression {COMPRESSION}, row groups of {ROW_GROUP:,}")
    times: dict[str, list[float]] = {"raysink": [], "pyarrow": [], "tuned": []}
    sink_dir = root / "raysink"
    with SinkRuntime("bench-write-arrow", ParquetSink(str(sink_dir)), writers=args.writers,
                     metastore=f"sqlite:///{root / 'meta.db'}", progress=False) as rt:
        rt.write_arrow([])  # warm the actors up
        for round_no in range(1, args.rounds + 1):
            order = (("raysink", "pyarrow", "tuned") if round_no % 2
                     else ("tuned", "pyarrow", "raysink"))
            for variant in order:
                if variant == "raysink":
                    seconds = run_raysink(rt, refs, args.rows)
                else:
                    seconds = run_pyarrow(refs, root / f"plain-{round_no}.parquet",
                                          tuned=variant == "tuned")
                times[variant].append(seconds)
                print(f"round {round_no} {variant:<8} {seconds:7.2f} s "
                      f"{args.rows / seconds / 1e6:6.2f} M rows/s", flush=True)
            for part in sink_dir.glob("part-*.parquet"):  # keep the disk use flat; the
                part.unlink()  # commit log stays (it is the sink's progress marker)
    ours, theirs = statistics.median(times["raysink"]), statistics.median(times["pyarrow"])
    tuned = statistics.median(times["tuned"])
    print(f"median raysink ({args.writers} writers) {args.rows / ours / 1e6:.2f} M rows/s, "
          f"pyarrow.parquet.write_table {args.rows / theirs / 1e6:.2f} M rows/s: "
          f"ratio {theirs / ours:.2f} (target >= 1.0)")
    print(f"  against write_table with raysink's dictionary choice "
          f"{args.rows / tuned / 1e6:.2f} M rows/s: ratio {tuned / ours:.2f} (what two "
          "writers alone bring)")


# ----------------------------------------------------------------------------- empty epochs


class Spans:
    """Driver-side phase timings of each epoch (patched around ``EpochDriver``)."""

    PHASES = ("_open_epoch", "_feed_and_commit")

    def __init__(self) -> None:
        self.samples: dict[str, list[float]] = {p: [] for p in self.PHASES}

    @contextmanager
    def installed(self) -> Iterator[None]:
        originals = {p: getattr(EpochDriver, p) for p in self.PHASES}
        for phase, original in originals.items():
            setattr(EpochDriver, phase, self._timed(phase, original))
        try:
            yield
        finally:
            for phase, original in originals.items():
                setattr(EpochDriver, phase, original)

    def _timed(self, phase: str, original: Callable[..., Any]) -> Callable[..., Any]:
        samples = self.samples[phase]

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                samples.append(time.perf_counter() - started)

        return wrapper

    def clear(self) -> None:
        for values in self.samples.values():
            values.clear()

    def line(self) -> str:
        names = {"_open_epoch": "open (only when not known ahead)",
                 "_feed_and_commit": "barriers + decision + sink commits"}
        parts = [f"{names[p]} {_ms(statistics.median(v))}" for p, v in self.samples.items()
                 if v]
        return "    phases (p50): " + ", ".join(parts)


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:6.2f} ms"


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


def empty_epochs(args: argparse.Namespace, root: Path) -> None:
    spans = Spans() if args.spans else None
    print(f"empty epochs: {args.epochs} per writer count after {args.warmup} warm-up epochs")
    for count in args.writer_counts:
        name = f"bench-empty-{count}"
        with SinkRuntime(name, ParquetSink(str(root / name)), writers=count,
                         metastore=f"sqlite:///{root / 'meta.db'}", progress=False) as rt:
            for _ in range(args.warmup):
                rt.write_arrow([])
            samples: list[float] = []
            with spans.installed() if spans else _nothing():
                if spans:
                    spans.clear()
                for _ in range(args.epochs):
                    started = time.perf_counter()
                    report = rt.write_arrow([])
                    samples.append(time.perf_counter() - started)
                    if not report.committed:
                        raise SystemExit(f"empty epoch not committed: {report}")
        p50, p99 = _percentile(samples, 0.5), _percentile(samples, 0.99)
        print(f"  {count} writer(s): p50 {_ms(p50)}  p99 {_ms(p99)}  mean "
              f"{_ms(statistics.fmean(samples))}  p99/p50 {p99 / p50:4.2f}", flush=True)
        if spans:
            print(spans.line())
    print("targets: p50 < 10 ms at 2 writers, p99 < 2 x p50")


@contextmanager
def _nothing() -> Iterator[None]:
    yield


# ----------------------------------------------------------------------------- primitives


def primitives(root: Path, n: int = 50) -> None:
    """What one meta store transaction and one fsync cost on this disk."""
    from raysink.coordinator.metastore.sqlite import SqliteMetaStore

    store = SqliteMetaStore(root / "prims.db")
    record = store.claim("prims", {"main": "parquet"})
    samples = []
    for epoch in range(1, n + 1):
        started = time.perf_counter()
        store.put_open("prims", record.generation, epoch, 0, ["main"], {"sinks": {}})
        samples.append(time.perf_counter() - started)
    store.close()
    read = []
    store = SqliteMetaStore(root / "prims.db")
    for _ in range(n):
        started = time.perf_counter()
        store.sink_statuses("prims")
        read.append(time.perf_counter() - started)
    store.close()
    file_sync, dir_sync = [], []
    probe = root / "probe.txt"
    for _ in range(n):
        with open(probe, "w") as handle:
            handle.write("x" * 200)
            handle.flush()
            started = time.perf_counter()
            os.fsync(handle.fileno())
            file_sync.append(time.perf_counter() - started)
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
        started = time.perf_counter()
        os.fsync(fd)
        dir_sync.append(time.perf_counter() - started)
        os.close(fd)
    print("primitives (p50): SQLite write transaction (put_open) "
          f"{_ms(statistics.median(samples))}, read transaction (sink_statuses) "
          f"{_ms(statistics.median(read))}, fsync of a small file "
          f"{_ms(statistics.median(file_sync))}, fsync of a directory "
          f"{_ms(statistics.median(dir_sync))}")


# ----------------------------------------------------------------------------- main


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=6_000_000)
    parser.add_argument("--pieces", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--writers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--writer-counts", type=lambda s: [int(x) for x in s.split(",")],
                        default=[1, 2, 4, 8])
    parser.add_argument("--spans", action="store_true",
                        help="time the driver's phases and the meta store/fsync primitives")
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("--skip-empty", action="store_true")
    parser.add_argument("--dir", default=None, help="work directory (default: a temp dir)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    root = Path(args.dir or tempfile.mkdtemp(prefix="raysink-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False, namespace="raysink")
    try:
        if not args.skip_throughput:
            throughput(args, root)
        if not args.skip_empty:
            empty_epochs(args, root)
        if args.spans:
            primitives(root)
    finally:
        ray.shutdown()
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
