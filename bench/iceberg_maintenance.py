"""Benchmark: Iceberg commits over many small epochs, with and without maintenance (not a
test).

Two tables, each in its own SQL catalog on SQLite under a temporary directory, receive the
same ``--epochs`` epochs of ``--rows`` rows from ``--writers`` writers, through
``IcebergSink`` driven as the coordinator drives it (the writers stage and pre-commit, the
sink commits), without Ray. One table gets a maintenance pass (``IcebergSink.maintain``,
as the coordinator runs it: between two commits) every ``--every`` epochs; the other none.
For each it reports the sink's commit time (p50 over the first and the last ``--window``
epochs, and their ratio), the epoch time (staging and commit), the maintenance passes (p50
and the longest: how long a pass holds the sink's commits), and at the end the table's
data files, snapshots, ``metadata.json`` files and the bytes under ``metadata/``, and the
largest ``metadata.json``; every ``--window`` epochs a line with each run's commit p50 over
them and its bytes under ``metadata/``. The two runs alternate epoch by epoch, so the
machine's load falls on both alike.

    .venv/bin/python bench/iceberg_maintenance.py [--epochs 1000] [--every 10]
        [--writers 2] [--rows 1000] [--window 100] [--keep-snapshots 20]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa

from raysink import Maintenance
from raysink.sinks._maintenance import MaintenanceWindow
from raysink.sinks.base import CommitResult
from raysink.sinks.iceberg import IcebergSink


@dataclass
class Run:
    name: str
    sink: IcebergSink
    root: Path
    every: int
    commits: list[float] = field(default_factory=list)
    epochs: list[float] = field(default_factory=list)
    passes: list[float] = field(default_factory=list)


def _sink(root: Path, policy: Maintenance | bool) -> IcebergSink:
    catalog = {"type": "sql", "uri": f"sqlite:///{root / 'catalog.db'}",
               "warehouse": f"file://{root / 'warehouse'}"}
    return IcebergSink("bench.events", catalog=catalog, maintenance=policy).bind("bench",
                                                                                 "events")


def _batch(epoch: int, writer: int, rows: int) -> pa.RecordBatch:
    start = (epoch * 1000 + writer) * rows
    return pa.record_batch({"id": pa.array(range(start, start + rows), pa.int64()),
                            "v": pa.array([f"row {i}" for i in range(rows)])})


def _epoch(run: Run, epoch: int, writers: int, rows: int) -> None:
    started = time.perf_counter()
    manifests = []
    for w in range(writers):
        writer = run.sink.create_writer(w)
        writer.open()
        writer.write(_batch(epoch, w, rows))
        manifests.append(writer.pre_commit(epoch, 1))
        writer.close()
    before = time.perf_counter()
    assert run.sink.commit(epoch, manifests) is CommitResult.COMMITTED
    done = time.perf_counter()
    run.commits.append(done - before)
    run.epochs.append(done - started)
    if run.every and epoch % run.every == 0:
        window = MaintenanceWindow(deadline=time.monotonic() + 60, committed_epoch=epoch)
        run.sink.maintain(window)
        run.passes.append(time.perf_counter() - done)


def _ms(values: list[float]) -> float:
    return statistics.median(values) * 1000 if values else float("nan")


def _report(run: Run, window: int, rows: int, writers: int, epochs: int) -> None:
    first, last = run.commits[:window], run.commits[-window:]
    stats = run.sink.table_stats()
    assert stats is not None
    metadata = next(run.root.glob("warehouse/*/*/metadata"))
    jsons = list(metadata.glob("*.metadata.json"))
    rows_now = run.sink._opts.load_table().scan().to_arrow().num_rows
    assert rows_now == rows * writers * epochs, (rows_now, rows * writers * epochs)
    print(f"{run.name}: commit p50 first/last {window}: {_ms(first):.1f} / {_ms(last):.1f} ms "
          f"({_ms(last) / _ms(first):.2f}x); epoch p50 first/last: "
          f"{_ms(run.epochs[:window]):.1f} / {_ms(run.epochs[-window:]):.1f} ms")
    if run.passes:
        print(f"  {len(run.passes)} maintenance passes: p50 {_ms(run.passes):.0f} ms, "
              f"longest {max(run.passes) * 1000:.0f} ms")
    print(f"  data files {stats.data_files}, snapshots {stats.snapshots}, metadata.json "
          f"files {len(jsons)} (largest {max(p.stat().st_size for p in jsons) / 1024:.1f} "
          f"KiB), metadata/ {stats.metadata_files} files {stats.metadata_bytes / 1e6:.2f} MB; "
          f"{rows_now:,} rows, every one once")


def _metadata_bytes(run: Run) -> int:
    return sum(p.stat().st_size for p in run.root.glob("warehouse/*/*/metadata/**/*")
               if p.is_file())


def _progress(runs: list[Run], epoch: int, window: int, seconds: float) -> None:
    """One line per ``window`` epochs: each run's commit p50 over them and its metadata."""
    parts = [f"{run.name}: commit p50 {_ms(run.commits[-window:]):.0f} ms, metadata "
             f"{_metadata_bytes(run) / 1e6:.2f} MB" for run in runs]
    print(f"epoch {epoch} ({seconds:.0f} s): " + "; ".join(parts), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=1000)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--writers", type=int, default=2)
    parser.add_argument("--rows", type=int, default=1000)
    parser.add_argument("--window", type=int, default=100)
    parser.add_argument("--keep-snapshots", type=int, default=20)
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="raysink-ice-maint-"))
    policy = Maintenance(every_epochs=args.every, keep_snapshots=args.keep_snapshots,
                         keep_seconds=0, min_compact_files=16)
    try:
        runs = [Run("with maintenance", _sink(base / "on", policy), base / "on", args.every),
                Run("without", _sink(base / "off", False), base / "off", 0)]
        started = time.perf_counter()
        for epoch in range(1, args.epochs + 1):
            for run in runs:
                _epoch(run, epoch, args.writers, args.rows)
            if epoch % args.window == 0:
                _progress(runs, epoch, args.window, time.perf_counter() - started)
        print(f"{args.epochs} epochs of {args.rows} rows from {args.writers} writers, a pass "
              f"every {args.every} epochs keeping {args.keep_snapshots} snapshots "
              f"(Maintenance(keep_seconds=0, min_compact_files=16)):")
        for run in runs:
            _report(run, args.window, args.rows, args.writers, args.epochs)
        on, off = runs
        print(f"commit p50 over the last {args.window}, without / with: "
              f"{_ms(off.commits[-args.window:]) / _ms(on.commits[-args.window:]):.1f}x")
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
