"""Soak run: a stream of producers and a ``write_arrow`` loop side by side for minutes,
checking that nothing grows (not a test, not in CI).

Starts its own local Ray and opens two runtimes (one runtime cannot do both: while it
runs a stream its epochs come from the stream, and ``write_arrow`` is refused):

* ``soak-<sink>``: one runtime per table sink of ``--sink`` (``parquet``, ``delta``,
  ``iceberg``, a comma list of them, ``both`` for the first two or ``all``, the default),
  2 writers each, so that each sink's epoch latency is its own; the driver writes the
  same fresh Arrow tables (unique int64 ``id``, a string ``name``, a float ``value``;
  ``--rows`` rows per epoch, cut into ``--batches`` tables so every writer gets data)
  through each runtime's ``rt.write_arrow`` in turn until ``--minutes`` have passed; the
  Delta and Iceberg sinks maintain their tables by default;
* ``soak-stream``: 2 writers over a ``ParquetSink``, ``checkpoint_interval=--interval``;
  ``--producers`` Ray actors (``soak_stream.SoakProducer``) each write ``--stream-rows``
  fresh rows per batch into ``rt.stream()``, pausing ``--stream-pause`` seconds between
  batches, following the producer's contract; at the end they stop, wait for their last
  epoch to commit, and ``close()`` drains the stream.

Both use ``max_pending_epochs=2``, credits 4 and a SQLite meta store of their own under
the work directory. A background thread probes every ``--probe-seconds`` and samples
memory every ``--sample-seconds`` (``soak_probe``), with one progress line on stderr per
sample. At the end it checks, and prints a verdict for each:

* memory is steady in the driver and in every other process (both coordinators, every
  writer, the producers): for each, the unique memory (USS) grows from the median of the
  first 20% of the samples taken after a warm-up (the first minute or the first 20% of
  the run, whichever is shorter) to the median of the last 20% by at most
  ``--max-growth-mib`` MiB *and* at most ``--max-growth-pct`` percent;
* no actor restarted (its pid stayed the same), the stream never rewound;
* every writer's mailbox depth stayed within its credits (the stream's writers: credits
  times producers, one window per producer's feed);
* each runtime's outstanding epochs (open plus pending at the coordinator) stayed within
  ``max_pending_epochs``;
* each meta store's epoch rows stayed within ``sinks * (max_pending_epochs + 2)``, and its
  sink status rows within ``sinks``;
* each sink's ``write_arrow`` epoch latency grows by at most ``--max-latency-growth``
  (20%): the median over the last 20% of its epochs after the warm-up against the first
  20%; the live data files of each sink's table are printed beside it (Delta and Iceberg
  are compacted, a Parquet directory holds a file per writer per epoch);
* every ``write_arrow`` epoch was committed with its rows; every producer's stream
  ended committed; every table holds exactly the rows written: each id once, none
  missing, none extra.

It prints rows/s of each side, epochs, and each process's USS (first, last, peak); and,
to say where a growth comes from, each sink's median latency in each tenth of the run and
each process's CPU milliseconds per ``write_arrow`` round (an epoch into every sink) over
the first and the last 20% after the warm-up: the driver, every actor, the producers and
Ray's own processes (GCS, raylet, agents). It writes a JSON report (``--report``,
default ``<workdir>/soak.json``). Exit code 0 when every check passed, 1 otherwise::

    .venv/bin/python bench/soak.py --minutes 5 [--sink all|both|parquet,delta,iceberg]
        [--rows 50000]
        [--producers 2] [--stream-rows 1000] [--stream-pause 0.1] [--interval 2]
    make soak MINUTES=60
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import ray
import soak_stream
from soak_check import (
    ICEBERG_TABLE,
    CpuPerEpoch,
    IdCheck,
    LatencyVerdict,
    MemoryVerdict,
    check_tables,
    cpu_per_epoch,
    iceberg_catalog,
    latency_through,
    latency_verdict,
    memory_verdict,
    table_files,
)
from soak_probe import Sampler, Watched
from soak_stream import StreamSide, StreamTotals

from raysink import SinkRuntime
from raysink.sinks import DeltaSink, IcebergSink, ParquetSink, Sink

ARROW_RUNTIME = "soak"
STREAM_RUNTIME = "soak-stream"
WRITERS = 2
MAX_PENDING_EPOCHS = 2
CREDITS = 4


# ---------------------------------------------------------------------- options


@dataclass(frozen=True, kw_only=True)
class Options:
    minutes: float
    rows: int
    batches: int
    sink: str
    producers: int
    stream_rows: int
    stream_pause: float
    interval: float
    workdir: Path
    keep: bool
    report: Path
    sample_seconds: float
    probe_seconds: float
    max_growth_mib: float
    max_growth_pct: float
    max_latency_growth: float


def parse_args(argv: list[str] | None = None) -> Options:
    parser = argparse.ArgumentParser(
        description="Soak run: a stream and a write_arrow loop for minutes; checks memory, "
                    "bounds and the tables.")
    parser.add_argument("--minutes", type=float, default=5.0, help="how long to write (5)")
    parser.add_argument("--rows", type=int, default=50_000,
                        help="rows per write_arrow epoch (50000)")
    parser.add_argument("--batches", type=int, default=8,
                        help="tables per write_arrow epoch, spread over the writers (8)")
    parser.add_argument("--sink", default="all",
                        help="the write_arrow sinks, a runtime each: parquet, delta, iceberg, "
                             "a comma list, both (parquet,delta) or all (the default)")
    parser.add_argument("--producers", type=int, default=2, help="stream producers (2)")
    parser.add_argument("--stream-rows", type=int, default=1000,
                        help="rows per stream batch (1000)")
    parser.add_argument("--stream-pause", type=float, default=0.1,
                        help="seconds between a producer's batches (0.1)")
    parser.add_argument("--interval", type=float, default=2.0,
                        help="the stream's checkpoint_interval, seconds (2)")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="where the tables, the meta stores and the report go (default: "
                             "a new temporary directory, emptied at the end but for the "
                             "report unless --keep)")
    parser.add_argument("--keep", action="store_true",
                        help="keep the tables and meta stores of the temporary work directory")
    parser.add_argument("--report", type=Path, default=None,
                        help="JSON report path (<workdir>/soak.json)")
    parser.add_argument("--sample-seconds", type=float, default=5.0,
                        help="memory sample and progress line interval (5)")
    parser.add_argument("--probe-seconds", type=float, default=1.0,
                        help="mailbox / outstanding epochs / meta store probe interval (1)")
    parser.add_argument("--max-growth-mib", type=float, default=64.0,
                        help="largest USS growth per process, MiB (64)")
    parser.add_argument("--max-growth-pct", type=float, default=25.0,
                        help="largest USS growth per process, percent of its baseline (25)")
    parser.add_argument("--max-latency-growth", type=float, default=20.0,
                        help="largest growth of the write_arrow epochs' median latency, "
                             "percent (20)")
    args = parser.parse_args(argv)
    if min(args.minutes, args.rows, args.batches, args.producers, args.stream_rows,
           args.interval) <= 0 or args.stream_pause < 0:
        parser.error("sizes, counts and intervals must be positive")
    try:
        sink_kinds(args.sink)
    except ValueError as exc:
        parser.error(str(exc))
    if args.sample_seconds <= 0 or args.probe_seconds <= 0:
        parser.error("--sample-seconds and --probe-seconds must be positive")
    keep = args.keep or args.workdir is not None
    workdir = (args.workdir or Path(tempfile.mkdtemp(prefix="raysink-soak-"))).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    return Options(minutes=args.minutes, rows=args.rows, batches=args.batches,
                   sink=args.sink, producers=args.producers, stream_rows=args.stream_rows,
                   stream_pause=args.stream_pause, interval=args.interval, workdir=workdir,
                   keep=keep, report=(args.report or workdir / "soak.json").resolve(),
                   sample_seconds=args.sample_seconds, probe_seconds=args.probe_seconds,
                   max_growth_mib=args.max_growth_mib, max_growth_pct=args.max_growth_pct,
                   max_latency_growth=args.max_latency_growth / 100)


# ---------------------------------------------------------------------- set-up


KINDS = ("parquet", "delta", "iceberg")


def sink_kinds(choice: str) -> tuple[str, ...]:
    """``--sink``'s table sinks, in the order written."""
    if choice == "all":
        return KINDS
    if choice == "both":
        return KINDS[:2]
    kinds = tuple(dict.fromkeys(part.strip() for part in choice.split(",") if part.strip()))
    unknown = [kind for kind in kinds if kind not in KINDS]
    if unknown or not kinds:
        raise ValueError(f"--sink {choice!r}: each of {', '.join(KINDS)}, a comma list of "
                         "them, both or all")
    return kinds


def arrow_tables(choice: str, workdir: Path) -> dict[str, tuple[str, Path]]:
    """The write_arrow sinks, one runtime each: name -> (kind, path); an Iceberg path is
    the root of its catalog and warehouse."""
    return {kind: (kind, workdir / kind) for kind in sink_kinds(choice)}


def make_sink(kind: str, path: Path) -> Sink:
    if kind == "parquet":
        return ParquetSink(path)
    if kind == "delta":
        return DeltaSink(str(path))
    path.mkdir(parents=True, exist_ok=True)
    return IcebergSink(ICEBERG_TABLE, catalog=iceberg_catalog(path))


def make_sinks(tables: dict[str, tuple[str, Path]]) -> dict[str, Sink]:
    return {name: make_sink(kind, path) for name, (kind, path) in tables.items()}


def open_runtime(name: str, sinks: dict[str, Sink], metastore: Path,
                 **options: float) -> SinkRuntime:
    runtime = SinkRuntime(name, sinks, writers=WRITERS, max_pending_epochs=MAX_PENDING_EPOCHS,
                          credits=CREDITS, metastore=f"sqlite:///{metastore}", progress=False,
                          **options)
    return runtime.start()


def epoch_tables(start: int, rows: int, batches: int,
                 rng: np.random.Generator) -> list[pa.Table]:
    """``rows`` fresh rows with ids ``start .. start + rows - 1``, in ``batches`` tables."""
    ids = pa.array(np.arange(start, start + rows, dtype=np.int64))
    names = pc.binary_join_element_wise("row-", pc.cast(ids, pa.string()), "")
    values = pa.array(rng.random(rows))
    table = pa.table({"id": ids, "name": names, "value": values})
    size = -(-rows // batches)
    return [table.slice(offset, size) for offset in range(0, rows, size)]


# ---------------------------------------------------------------------- writing


@dataclass
class WriteStats:
    """The write_arrow side: ``epochs`` and ``rows`` count each epoch once (every sink's
    runtime writes the same rows); ``latencies``: per sink, (when the epoch began, seconds
    after the start; its seconds)."""

    epochs: int = 0
    rows: int = 0
    uncommitted: list[str] = field(default_factory=list)
    row_mismatches: list[str] = field(default_factory=list)
    error: str | None = None
    started: float = field(default_factory=time.monotonic)
    seconds: float = 0.0
    latencies: dict[str, list[tuple[float, float]]] = field(default_factory=dict)

    @property
    def rate(self) -> float:
        elapsed = self.seconds or (time.monotonic() - self.started)
        return self.rows / elapsed if elapsed > 0 else 0.0


def write_until(runtimes: dict[str, SinkRuntime], options: Options,
                stats: WriteStats) -> None:
    """Write epochs until the deadline, each into every runtime in turn; stop at the
    first failed ``write_arrow``."""
    deadline = stats.started + options.minutes * 60
    rng = np.random.default_rng(1)
    try:
        while time.monotonic() < deadline:
            tables = epoch_tables(stats.rows, options.rows, options.batches, rng)
            for label, rt in runtimes.items():
                began = time.monotonic()
                report = rt.write_arrow(tables)
                stats.latencies.setdefault(label, []).append(
                    (began - stats.started, time.monotonic() - began))
                if not report.committed:
                    stats.uncommitted.append(f"{label}:{report.epoch}")
                if report.rows != options.rows:
                    stats.row_mismatches.append(f"{label}:{report.epoch}")
            stats.epochs += 1
            stats.rows += options.rows
    except Exception as exc:
        stats.error = f"{type(exc).__name__}: {exc}"
        print(f"[soak] write failed, stopping: {stats.error}", file=sys.stderr)
    finally:
        stats.seconds = time.monotonic() - stats.started


# ---------------------------------------------------------------------- the run


@dataclass
class Outcome:
    """Everything the verdict looks at."""

    stats: WriteStats
    stream: StreamTotals
    stream_seconds: float
    stream_epochs: int | None
    sampler: Sampler
    memory: list[MemoryVerdict]
    tables: list[IdCheck]
    latency: dict[str, LatencyVerdict]
    latency_through: dict[str, list[float | None]]
    cpu: list[CpuPerEpoch]
    files: dict[str, int]


def run_side_by_side(options: Options) -> Outcome:
    workdir = options.workdir
    arrow = arrow_tables(options.sink, workdir)
    stream_table = {"stream-parquet": ("parquet", workdir / "stream-parquet")}
    runtimes = {label: open_runtime(f"{ARROW_RUNTIME}-{label}", make_sinks({label: table}),
                                    workdir / f"meta-{label}.db")
                for label, table in arrow.items()}
    srt = open_runtime(STREAM_RUNTIME, make_sinks(stream_table), workdir / "meta-stream.db",
                       checkpoint_interval=options.interval)
    side: StreamSide | None = None
    stats = WriteStats()
    try:
        side = StreamSide(srt, producers=options.producers, rows=options.stream_rows,
                          pause=options.stream_pause)
        watched = [
            *(Watched(label=f"arrow-{label}", rt=rt, metastore=workdir / f"meta-{label}.db",
                      sinks=1, mailbox_limit=CREDITS, max_pending_epochs=MAX_PENDING_EPOCHS)
              for label, rt in runtimes.items()),
            Watched(label="stream", rt=srt, metastore=workdir / "meta-stream.db", sinks=1,
                    mailbox_limit=CREDITS * options.producers,
                    max_pending_epochs=MAX_PENDING_EPOCHS, extra_pids=side.pids)]
        sampler = Sampler(watched, probe_seconds=options.probe_seconds,
                          sample_seconds=options.sample_seconds,
                          progress=lambda: _progress(stats, srt))
        stats.started = sampler.started = time.monotonic()
        sampler.start()
        writer = threading.Thread(target=write_until, args=(runtimes, options, stats),
                                  daemon=True)
        writer.start()
        writer.join()
        stream = side.stop()
        stream_seconds = time.monotonic() - stats.started
        stream_epochs = srt.status().last_committed_epoch
        sampler.stop()
        for item in watched:
            sampler.probe_bounds(item)
    finally:
        srt.close()
        for rt in runtimes.values():
            rt.close()
        if side is not None:
            side.end()
    at = time.monotonic() - sampler.started
    for item in watched:
        sampler.probe_metastore(item, at)
    memory = [memory_verdict(s, stats.seconds, options.max_growth_mib, options.max_growth_pct)
              for s in sampler.series.values()]
    tables = check_tables(arrow, {0: (0, stats.rows)})
    tables += check_tables(stream_table, side.expected(stream))
    latency = {label: latency_verdict(stats.latencies.get(label, []), stats.seconds,
                                      options.max_latency_growth) for label in arrow}
    through = {label: latency_through(stats.latencies.get(label, []), stats.seconds)
               for label in arrow}
    rounds = [began for began, _ in stats.latencies.get(next(iter(arrow)), [])]
    cpu = [c for c in (cpu_per_epoch(s, rounds, stats.seconds)
                       for s in sampler.series.values()) if c is not None]
    files = {label: table_files(kind, path)
             for label, (kind, path) in {**arrow, **stream_table}.items()}
    return Outcome(stats=stats, stream=stream, stream_seconds=stream_seconds,
                   stream_epochs=stream_epochs, sampler=sampler, memory=memory, tables=tables,
                   latency=latency, latency_through=through, cpu=cpu, files=files)


def _progress(stats: WriteStats, srt: SinkRuntime) -> str:
    try:
        stream_epochs = srt.status().last_committed_epoch
    except Exception:  # the probe reports it
        stream_epochs = None
    return (f"write_arrow epochs {stats.epochs:,} rows {stats.rows:,} "
            f"({stats.rate:,.0f} rows/s)  stream epochs committed {stream_epochs}")


# ---------------------------------------------------------------------- verdict


def checks_of(options: Options, out: Outcome) -> dict[str, bool]:
    stats, sampler = out.stats, out.sampler
    watched = {w.label: w for w in sampler.watched}
    bounds = [w.bounds for w in watched.values()]
    return {
        "write_arrow: no failed epoch, every epoch committed with its rows":
            stats.error is None and not stats.uncommitted and not stats.row_mismatches
            and stats.epochs > 0,
        "stream: every producer's last epoch committed, no rewind":
            out.stream.error is None and out.stream.rewinds == 0 and out.stream.writes > 0,
        f"memory steady (growth <= {options.max_growth_mib:g} MiB and "
        f"<= {options.max_growth_pct:g}% per process)": all(m.ok for m in out.memory),
        "no actor restarted": all(s.restarts == 0 for s in sampler.series.values()),
        f"mailbox depth <= credits ({CREDITS}; stream: x {options.producers} producers)":
            all(max(w.bounds.mailbox_max.values(), default=0) <= w.mailbox_limit
                for w in watched.values()),
        f"outstanding epochs <= max_pending_epochs ({MAX_PENDING_EPOCHS}), each runtime":
            all(b.outstanding_max <= MAX_PENDING_EPOCHS for b in bounds),
        "meta store epoch rows <= sinks x (max_pending_epochs + 2), status rows <= sinks":
            all(w.bounds.epoch_rows_max <= w.epoch_rows_limit
                and w.bounds.status_rows_max <= w.sinks for w in watched.values()),
        "probes answered": all(b.probes > 0 and b.probe_errors == 0 for b in bounds),
        "tables hold every id exactly once": bool(out.tables) and all(t.ok for t in out.tables),
        **{f"write_arrow epoch latency growth <= {options.max_latency_growth:.0%} ({label})":
           verdict.ok for label, verdict in out.latency.items()},
    }


def print_summary(options: Options, out: Outcome, checks: dict[str, bool]) -> None:
    stats, stream = out.stats, out.stream
    stream_rows = sum(stream.batches) * options.stream_rows
    print(f"\nraysink soak: {options.minutes:g} min, workdir {options.workdir}")
    print(f"  write_arrow ({', '.join(out.latency)}, a runtime each, the same rows into each): "
          f"{stats.epochs:,} epochs, {stats.rows:,} rows in "
          f"{stats.seconds:,.1f}s: {stats.rate:,.0f} rows/s, "
          f"{stats.epochs / max(stats.seconds, 1e-9):.2f} epochs/s")
    if stats.error:
        print(f"  write_arrow stopped by: {stats.error}")
    print(f"  stream ({options.producers} producers, {options.stream_rows:,} rows a batch, "
          f"interval {options.interval:g}s): {out.stream_epochs} epochs, {stream_rows:,} rows "
          f"in {out.stream_seconds:,.1f}s: {stream_rows / max(out.stream_seconds, 1e-9):,.0f} "
          f"rows/s, {stream.rewinds} rewinds" + (f", error {stream.error}" if stream.error
                                                   else ""))
    print("  USS per process (MiB):              first     last     peak  baseline  final  "
          "growth")
    for m in out.memory:
        print(f"    {m.label:<32} {m.first_mib:8.1f} {m.last_mib:8.1f} {m.peak_mib:8.1f} "
              f"{m.baseline_mib:8.1f} {m.final_mib:7.1f} {m.growth_mib:+7.1f} "
              f"({m.growth_pct:+.1f}%) {'ok' if m.ok else 'GROWING'}"
              + (f" restarted: pids {m.pids}" if len(m.pids) > 1 else ""))
    for w in out.sampler.watched:
        b = w.bounds
        print(f"  {w.label}: probes {b.probes} ({b.probe_errors} failed): mailbox depth max "
              f"{b.mailbox_max}, outstanding epochs max {b.outstanding_max} (pending "
              f"{b.pending_max}), meta store epoch rows max {b.epoch_rows_max}, status rows "
              f"max {b.status_rows_max}")
        for violation in b.violations[:10]:
            print(f"    over bound: {violation}")
    for t in out.tables:
        print(f"  table {t.sink}: {t.rows:,} rows, {t.distinct:,} distinct ids, "
              f"{t.missing:,} missing, {t.duplicated:,} duplicated, {t.unexpected:,} "
              f"unexpected" + (f", error {t.error}" if t.error else ""))
    for label, lat in out.latency.items():
        print(f"  write_arrow epoch latency ({label}, {lat.epochs:,} epochs): median "
              f"{lat.first_ms:.1f} ms over the first 20% after the warm-up, "
              f"{lat.last_ms:.1f} ms over the last: {lat.growth:+.1%}")
        tenths = out.latency_through.get(label, [])
        print("    median by tenth of the run (ms): " + " ".join(
            "-" if ms is None else f"{ms:.0f}" for ms in tenths))
    print("  CPU per write_arrow round (ms; an epoch into every sink), the first and the "
          "last 20% after the warm-up, largest growth first:")
    for c in sorted(out.cpu, key=lambda c: c.last_ms - c.first_ms, reverse=True):
        print(f"    {c.label:<34} {c.first_ms:8.1f} {c.last_ms:8.1f}  "
              f"{c.last_ms - c.first_ms:+7.1f} ({c.growth:+.0%})")
    print("  live data files per table: " + ", ".join(
        f"{label} {count:,}" for label, count in out.files.items()))
    for name, ok in checks.items():
        print(f"  [{'PASS' if ok else 'FAIL'}] {name}")
    print(f"  verdict: {'PASS' if all(checks.values()) else 'FAIL'}; report {options.report}")


def write_report(options: Options, out: Outcome, checks: dict[str, bool]) -> None:
    stats, stream = out.stats, out.stream
    report = {
        "options": {k: str(v) if isinstance(v, Path) else v
                    for k, v in asdict(options).items()},
        "writes": {"epochs": stats.epochs, "rows": stats.rows, "seconds": stats.seconds,
                   "rows_per_second": stats.rate, "uncommitted": stats.uncommitted,
                   "row_mismatches": stats.row_mismatches, "error": stats.error},
        "stream": {**asdict(stream), "seconds": out.stream_seconds,
                   "epochs": out.stream_epochs,
                   "rows": sum(stream.batches) * options.stream_rows},
        "memory": [asdict(m) for m in out.memory],
        "samples": {s.label: s.samples for s in out.sampler.series.values()},
        "bounds": {w.label: asdict(w.bounds) for w in out.sampler.watched},
        "tables": [{**asdict(t), "ok": t.ok} for t in out.tables],
        "latency": {label: asdict(lat) for label, lat in out.latency.items()},
        "latency_through": out.latency_through,
        "cpu_per_round": [{**asdict(c), "growth": c.growth} for c in out.cpu],
        "cpu_samples": {s.label: s.cpu for s in out.sampler.series.values()},
        "files": out.files,
        "checks": checks,
        "passed": all(checks.values()),
    }
    options.report.parent.mkdir(parents=True, exist_ok=True)
    options.report.write_text(json.dumps(report, indent=2))


# ---------------------------------------------------------------------- main


def soak(options: Options) -> bool:
    out = run_side_by_side(options)
    checks = checks_of(options, out)
    print_summary(options, out, checks)
    write_report(options, out, checks)
    return all(checks.values())


def main(argv: list[str] | None = None) -> int:
    options = parse_args(argv)
    ray.cloudpickle.register_pickle_by_value(soak_stream)  # bench/ is not on the workers' path
    # a Ray of its own ("local"), never another process's cluster on the machine
    ray.init(address="local", num_cpus=8, include_dashboard=False, namespace="raysink",
             log_to_driver=False)
    try:
        passed = soak(options)
    finally:
        ray.shutdown()
        if not options.keep:
            clean_workdir(options)
    return 0 if passed else 1


def clean_workdir(options: Options) -> None:
    """Remove the tables and the meta stores of a temporary work directory; the report
    stays."""
    for entry in options.workdir.iterdir():
        if entry == options.report:
            continue
        if entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)


if __name__ == "__main__":
    sys.exit(main())
