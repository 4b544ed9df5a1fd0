"""Benchmark: the fixed cost of an epoch as writers grow, and the coordinator at 1,000
writers (not a test).

Part 1, real actors: one ``SinkRuntime`` per writer count (default 1, 2, 4, 8, 16, 32, 64)
into a ``ParquetSink``, writer actors reserving no CPU, Ray started with ``--cpus``
logical CPUs. After ``--warmup`` epochs, ``--epochs`` epochs are timed one by one from the
driver; p50, p99 and the mean per writer count, and the growth per added writer between
the first and last count, for two kinds of epoch:

* empty (``rt.write_arrow([])``), the cost of the protocol alone: no writer received anything, so no
  writer is called (the driver answers for them); the coordinator records OPEN and PENDING
  in one durable transaction, records the sink's commit (no marker, nothing to take to
  the target) and answers. Targets: 2 writers p50/p99 <= 6/12 ms, 16 writers
  <= 15/30 ms, 64 writers <= 60/120 ms.
* one row per writer (``rt.write_arrow([row] * writers)``): every writer gets a data
  message and its barrier, writes and fsyncs a Parquet file and answers with its commit
  request; the sink's commit moves every file into place and writes its marker. What
  grows with the writers here is the work each does, not a protocol step.

Part 2, simulation: the coordinator's epoch logic (``EpochCoordinator``) with
``--sim-writers`` (1,000) fake writers in this process, no Ray: open, the gathered commit
requests (one per writer, a manifest of a few keys each), the PENDING record, the sink's
commit and its COMMITTED record, on a SQLite meta store in a temporary directory. It reports the
coordinator's own CPU time per epoch (``time.process_time``; target <= 50 ms) and its
split between the in-memory requests and the meta store.

    .venv/bin/python bench/epoch_cost.py [--counts 1,2,4,8,16,32,64] [--epochs 100]
        [--warmup 10] [--rows-per-writer 1] [--sim-writers 1000] [--sim-only]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from raysink.coordinator.epochs import EpochCoordinator
from raysink.coordinator.metastore import SqliteMetaStore
from raysink.protocol.messages import CommitRequest
from raysink.protocol.vnodes import assign
from raysink.sinks.base import CommitResult, Manifest, Sink, SinkWriter


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:7.2f} ms"


def _percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


# ----------------------------------------------------------------------------- part 1


def timed_epochs(counts: Sequence[int], epochs: int, warmup: int, root: Path, *,
                 rows_per_writer: int) -> None:
    import pyarrow as pa

    from raysink import SinkRuntime
    from raysink.sinks import ParquetSink

    kind = (f"epochs of {rows_per_writer} row(s) per writer" if rows_per_writer
            else "empty epochs")
    print(f"{kind}: {epochs} per writer count after {warmup} warm-up epochs "
          "(0-CPU writer actors)")
    p50s: dict[int, float] = {}
    for count in counts:
        name = f"cost-{count}-{rows_per_writer}"
        piece = pa.table({"id": pa.array(range(rows_per_writer), pa.int64())})
        data = [piece] * count if rows_per_writer else []
        with SinkRuntime(name, ParquetSink(str(root / name)), writers=count,
                         metastore=f"sqlite:///{root / 'meta.db'}", progress=False) as rt:
            for _ in range(warmup):
                rt.write_arrow(data)
            samples = []
            for _ in range(epochs):
                started = time.perf_counter()
                report = rt.write_arrow(data)
                samples.append(time.perf_counter() - started)
                if not report.committed or report.rows != rows_per_writer * count:
                    raise SystemExit(f"epoch not committed whole: {report}")
        p50, p99 = _percentile(samples, 0.5), _percentile(samples, 0.99)
        p50s[count] = p50
        print(f"  {count:3d} writer(s): p50 {_ms(p50)}  p99 {_ms(p99)}  mean "
              f"{_ms(statistics.fmean(samples))}", flush=True)
    first, last = min(p50s), max(p50s)
    if last > first:
        per = (p50s[last] - p50s[first]) / (last - first)
        print(f"  growth of p50 per added writer ({first} -> {last}): {per * 1000:.3f} ms")
    if not rows_per_writer:
        print("  targets: 2 writers <= 6/12 ms, 16 <= 15/30 ms, 64 <= 60/120 ms (p50/p99)")


# ----------------------------------------------------------------------------- part 2


class _NullSink(Sink):
    """A sink whose commit only moves its marker: the coordinator's work alone."""

    kind = "null"

    def __init__(self) -> None:
        self.marker: int | None = None

    def validate(self) -> None:
        return None

    def create_writer(self, writer_id: int) -> SinkWriter:
        raise NotImplementedError("the simulation has no writers")

    def commit(self, epoch: int, manifests: Sequence[Manifest]) -> CommitResult:
        self.marker = epoch
        return CommitResult.COMMITTED

    def abort(self, epoch: int, manifests: Sequence[Manifest] | None) -> None:
        return None

    def committed_epoch(self) -> int | None:
        return self.marker


def simulate(writers: int, epochs: int, root: Path) -> None:
    store = SqliteMetaStore(root / "sim.db")
    sink = _NullSink().bind("sim", "main")
    record = store.claim("sim", {"main": sink.kind})
    core = EpochCoordinator(runtime="sim", store=store, sinks={"main": sink},
                            generation=record.generation, bitmaps={"main": assign(writers)})
    core.recover()
    core.reconcile_markers()
    totals: dict[str, list[float]] = {"epoch": [], "requests": [], "store": []}
    for _ in range(epochs + 3):
        started = time.process_time()
        decision = core.open_epoch(None)
        opened = time.process_time()
        requests = [CommitRequest(sink="main", writer=writer, epoch=decision.epoch,
                                  attempt=decision.attempt,
                                  manifest={"writer": writer, "epoch": decision.epoch,
                                            "attempt": decision.attempt, "rows": 0,
                                            "files": []})
                    for writer in range(writers)]
        core.gather(decision.epoch, decision.attempt, requests)
        requested = time.process_time()
        core.persist_pending(decision.epoch, decision.attempt)
        step = core.next_commit("main")
        assert step is not None
        core.record_commit(core.run_commit(step))
        ended = time.process_time()
        totals["epoch"].append(ended - started)
        totals["requests"].append(requested - opened)
        totals["store"].append((opened - started) + (ended - requested))
    store.close()
    samples = {k: v[3:] for k, v in totals.items()}  # the first epochs warm caches up
    print(f"coordinator simulation: {writers} writers, one sink, SQLite meta store, "
          f"{epochs} epochs (CPU time of this process)")
    print(f"  per epoch: p50 {_ms(statistics.median(samples['epoch']))}  p99 "
          f"{_ms(_percentile(samples['epoch'], 0.99))}  (target <= 50 ms)")
    print(f"    of which {writers} commit requests {_ms(statistics.median(samples['requests']))}"
          f", open + PENDING + commit + COMMITTED {_ms(statistics.median(samples['store']))}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--counts", default="1,2,4,8,16,32,64")
    parser.add_argument("--epochs", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--cpus", type=int, default=16)
    parser.add_argument("--sim-writers", type=int, default=1000)
    parser.add_argument("--sim-epochs", type=int, default=50)
    parser.add_argument("--sim-only", action="store_true")
    parser.add_argument("--rows-per-writer", type=int, default=1,
                        help="rows each writer gets in the second kind of epoch (0: skip it)")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="raysink-epoch-cost-"))
    try:
        simulate(args.sim_writers, args.sim_epochs, root)
        if not args.sim_only:
            import ray

            ray.init(num_cpus=args.cpus, include_dashboard=False, log_to_driver=False)
            try:
                counts = [int(c) for c in args.counts.split(",")]
                timed_epochs(counts, args.epochs, args.warmup, root, rows_per_writer=0)
                if args.rows_per_writer:
                    timed_epochs(counts, args.epochs, args.warmup, root,
                                 rows_per_writer=args.rows_per_writer)
            finally:
                ray.shutdown()
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
