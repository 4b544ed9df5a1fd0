"""Soak run: keep writing for minutes and check that nothing grows (not a test, not in CI).

Starts its own local Ray, opens one ``SinkRuntime`` (2 writers per sink,
``max_pending_epochs=2``, a SQLite meta store under the work directory) over a
``ParquetSink``, a ``DeltaSink`` or both, and writes fresh Arrow tables (unique int64
``id``, a string ``name``, a float ``value``; ``--rows`` rows per epoch, cut into
``--batches`` tables so every writer gets data) through ``rt.write_arrow`` until
``--minutes`` have passed. A background thread probes every ``--probe-seconds`` and
samples memory every ``--sample-seconds``, with one progress line on stderr per sample.

At the end it checks, and prints a verdict for each:

* memory is steady in the driver and in every raysink actor (coordinator, writers): for
  each process, the unique memory (USS) grows from the median of the first 20% of the
  samples taken after a warm-up (the first minute or the first 20% of the run, whichever
  is shorter) to the median of the last 20% by at most ``--max-growth-mib`` MiB *and*
  at most ``--max-growth-pct`` percent;
* no actor restarted (its pid stayed the same);
* every writer's mailbox depth stayed within its credits (4);
* the outstanding epochs (open plus pending at the coordinator) stayed within
  ``max_pending_epochs``;
* the meta store's epoch rows for this runtime stayed within
  ``sinks * (max_pending_epochs + 2)``, and its sink status rows within ``sinks``;
* every epoch was committed, and every table holds exactly the rows written: each id
  once, none missing, none extra.

It prints rows/s, epochs and each process's USS (first, last, peak) and writes a JSON
report (``--report``, default ``<workdir>/soak.json``). Exit code 0 when every check
passed, 1 otherwise::

    .venv/bin/python bench/soak.py --minutes 5 [--sink parquet|delta|both] [--rows 50000]
    make soak MINUTES=30
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sqlite3
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pyarrow as pa
import pyarrow.compute as pc
import ray

from raysink import SinkRuntime
from raysink.sinks import DeltaSink, ParquetSink, Sink

RUNTIME_NAME = "soak"
WRITERS = 2
MAX_PENDING_EPOCHS = 2
CREDITS = 4
MIB = 2**20
WARMUP_CAP_SECONDS = 60.0
EDGE_FRACTION = 0.2


# ---------------------------------------------------------------------- options


@dataclass(frozen=True, kw_only=True)
class Options:
    minutes: float
    rows: int
    batches: int
    sink: str
    workdir: Path
    keep: bool
    report: Path
    sample_seconds: float
    probe_seconds: float
    max_growth_mib: float
    max_growth_pct: float


def parse_args(argv: list[str] | None = None) -> Options:
    parser = argparse.ArgumentParser(
        description="Soak run: write for minutes, check memory, bounds and the tables.")
    parser.add_argument("--minutes", type=float, default=5.0, help="how long to write (5)")
    parser.add_argument("--rows", type=int, default=50_000, help="rows per epoch (50000)")
    parser.add_argument("--batches", type=int, default=8,
                        help="tables per epoch, spread over the writers (8)")
    parser.add_argument("--sink", choices=("parquet", "delta", "both"), default="both")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="where the tables, the meta store and the report go (default: "
                             "a new temporary directory, emptied at the end but for the "
                             "report unless --keep)")
    parser.add_argument("--keep", action="store_true",
                        help="keep the tables and meta store of the temporary work directory")
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
    args = parser.parse_args(argv)
    if args.minutes <= 0 or args.rows < 1 or args.batches < 1:
        parser.error("--minutes, --rows and --batches must be positive")
    if args.sample_seconds <= 0 or args.probe_seconds <= 0:
        parser.error("--sample-seconds and --probe-seconds must be positive")
    keep = args.keep or args.workdir is not None
    workdir = (args.workdir or Path(tempfile.mkdtemp(prefix="raysink-soak-"))).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    return Options(minutes=args.minutes, rows=args.rows, batches=args.batches,
                   sink=args.sink, workdir=workdir, keep=keep,
                   report=(args.report or workdir / "soak.json").resolve(),
                   sample_seconds=args.sample_seconds, probe_seconds=args.probe_seconds,
                   max_growth_mib=args.max_growth_mib, max_growth_pct=args.max_growth_pct)


# ---------------------------------------------------------------------- set-up


def make_sinks(choice: str, workdir: Path) -> dict[str, Sink]:
    sinks: dict[str, Sink] = {}
    if choice in ("parquet", "both"):
        sinks["parquet"] = ParquetSink(workdir / "parquet")
    if choice in ("delta", "both"):
        sinks["delta"] = DeltaSink(str(workdir / "delta"))
    return sinks


def metastore_path(workdir: Path) -> Path:
    return workdir / "meta.db"


def open_runtime(options: Options, sinks: dict[str, Sink]) -> SinkRuntime:
    url = f"sqlite:///{metastore_path(options.workdir)}"  # an absolute path: four slashes
    runtime = SinkRuntime(RUNTIME_NAME, sinks, writers=WRITERS,
                          max_pending_epochs=MAX_PENDING_EPOCHS, credits=CREDITS,
                          metastore=url, progress=False)
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


# ---------------------------------------------------------------------- observation


@dataclass
class Series:
    """One process's USS samples, as (seconds since start, bytes)."""

    label: str
    pids: list[int] = field(default_factory=list)
    samples: list[tuple[float, int]] = field(default_factory=list)

    def add(self, pid: int, at: float, uss: int) -> None:
        if not self.pids or self.pids[-1] != pid:
            self.pids.append(pid)
        self.samples.append((at, uss))

    @property
    def restarts(self) -> int:
        return max(0, len(self.pids) - 1)


@dataclass
class Bounds:
    """Highest values seen by the probes, and the probes that saw them over the bound."""

    mailbox_max: dict[str, int] = field(default_factory=dict)
    outstanding_max: int = 0
    epoch_rows_max: int = 0
    status_rows_max: int = 0
    probes: int = 0
    probe_errors: int = 0
    violations: list[str] = field(default_factory=list)


@dataclass
class WriteStats:
    epochs: int = 0
    rows: int = 0
    uncommitted: list[int] = field(default_factory=list)
    row_mismatches: list[int] = field(default_factory=list)
    error: str | None = None
    started: float = field(default_factory=time.monotonic)
    seconds: float = 0.0

    @property
    def rate(self) -> float:
        elapsed = self.seconds or (time.monotonic() - self.started)
        return self.rows / elapsed if elapsed > 0 else 0.0


def uss(pid: int) -> int | None:
    try:
        value: int = psutil.Process(pid).memory_full_info().uss
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None
    return value


def actor_pids(rt: SinkRuntime) -> dict[str, int]:
    """The pid of the coordinator and of every writer, by a readable label."""
    actors = rt._actors
    if actors is None:
        return {}
    labels: dict[str, Any] = {"coordinator": actors.coordinator.pid.remote()}
    for sink, handles in actors.writers.items():
        for index, handle in enumerate(handles):
            labels[f"writer {sink}-{index}"] = handle.ping.remote()
    pids = ray.get(list(labels.values()), timeout=30)
    return {label: int(pid) for label, pid in zip(labels, pids, strict=True)}


def mailbox_depths(rt: SinkRuntime) -> dict[str, int]:
    actors = rt._actors
    if actors is None:
        return {}
    refs = {f"{sink}-{index}": handle.status.remote()
            for sink, handles in actors.writers.items()
            for index, handle in enumerate(handles)}
    answers = ray.get(list(refs.values()), timeout=30)
    return {label: int(answer["mailbox_depth"])
            for label, answer in zip(refs, answers, strict=True)}


def outstanding_epochs(rt: SinkRuntime) -> int:
    """Open plus pending epochs at the coordinator: what ``max_pending_epochs`` bounds."""
    status = rt.status()
    pending, opened = status.pending_epochs, status.open_epoch
    return len(pending) + (1 if opened is not None and opened not in pending else 0)


def metastore_rows(path: Path) -> tuple[int, int] | None:
    """(epoch rows, sink status rows) of this runtime, read-only; None when unreadable."""
    if not path.exists():
        return None
    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)
        try:
            epochs = conn.execute("SELECT count(*) FROM raysink_epochs WHERE runtime = ?",
                                  (RUNTIME_NAME,)).fetchone()[0]
            status = conn.execute("SELECT count(*) FROM raysink_sink_status "
                                  "WHERE runtime = ?", (RUNTIME_NAME,)).fetchone()[0]
        finally:
            conn.close()
    except sqlite3.Error:
        return None
    return int(epochs), int(status)


class Sampler:
    """A thread: bounds every ``probe_seconds``; memory and a progress line every
    ``sample_seconds``."""

    def __init__(self, rt: SinkRuntime, options: Options, stats: WriteStats,
                 sinks: int) -> None:
        self.rt = rt
        self.options = options
        self.stats = stats
        self.sinks = sinks
        self.series: dict[str, Series] = {}
        self.bounds = Bounds()
        self.started = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-sampler", daemon=True)

    def start(self) -> None:
        self.sample_memory()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        next_sample = time.monotonic() + self.options.sample_seconds
        while not self._stop.wait(self.options.probe_seconds):
            self.probe_bounds()
            if time.monotonic() >= next_sample:
                next_sample += self.options.sample_seconds
                self.sample_memory()
                self.print_progress()

    def sample_memory(self) -> None:
        at = time.monotonic() - self.started
        targets = {"driver": os.getpid()}
        try:
            targets.update(actor_pids(self.rt))
        except Exception as exc:
            print(f"[soak] could not reach an actor: {exc}", file=sys.stderr)
        for label, pid in targets.items():
            value = uss(pid)
            if value is not None:
                self.series.setdefault(label, Series(label)).add(pid, at, value)

    def probe_bounds(self) -> None:
        bounds = self.bounds
        bounds.probes += 1
        at = time.monotonic() - self.started
        try:
            depths = mailbox_depths(self.rt)
            outstanding = outstanding_epochs(self.rt)
        except Exception as exc:
            bounds.probe_errors += 1
            print(f"[soak] probe failed: {exc}", file=sys.stderr)
            return
        for label, depth in depths.items():
            bounds.mailbox_max[label] = max(bounds.mailbox_max.get(label, 0), depth)
            if depth > CREDITS:
                bounds.violations.append(f"{at:.0f}s: writer {label} mailbox depth {depth} "
                                         f"> credits {CREDITS}")
        bounds.outstanding_max = max(bounds.outstanding_max, outstanding)
        if outstanding > MAX_PENDING_EPOCHS:
            bounds.violations.append(f"{at:.0f}s: {outstanding} outstanding epochs > "
                                     f"max_pending_epochs {MAX_PENDING_EPOCHS}")
        self.probe_metastore(at)

    def probe_metastore(self, at: float) -> None:
        rows = metastore_rows(metastore_path(self.options.workdir))
        if rows is None:
            self.bounds.probe_errors += 1
            return
        epochs, status = rows
        self.bounds.epoch_rows_max = max(self.bounds.epoch_rows_max, epochs)
        self.bounds.status_rows_max = max(self.bounds.status_rows_max, status)
        limit = epoch_rows_limit(self.sinks)
        if epochs > limit:
            self.bounds.violations.append(f"{at:.0f}s: {epochs} meta store epoch rows > "
                                          f"{limit}")
        if status > self.sinks:
            self.bounds.violations.append(f"{at:.0f}s: {status} sink status rows > "
                                          f"{self.sinks}")

    def print_progress(self) -> None:
        elapsed = time.monotonic() - self.started
        driver = self.series.get("driver")
        driver_mib = driver.samples[-1][1] / MIB if driver and driver.samples else 0.0
        print(f"[soak] {_clock(elapsed)}  epochs {self.stats.epochs:,}  "
              f"rows {self.stats.rows:,}  {self.stats.rate:,.0f} rows/s  "
              f"driver USS {driver_mib:,.1f} MiB", file=sys.stderr, flush=True)


def epoch_rows_limit(sinks: int) -> int:
    return sinks * (MAX_PENDING_EPOCHS + 2)


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes:02d}:{secs:02d}"


# ---------------------------------------------------------------------- writing


def write_until(rt: SinkRuntime, options: Options, stats: WriteStats) -> None:
    """Write epochs until the deadline; stop at the first failed ``write_arrow``."""
    deadline = stats.started + options.minutes * 60
    rng = np.random.default_rng(1)
    try:
        while time.monotonic() < deadline:
            tables = epoch_tables(stats.rows, options.rows, options.batches, rng)
            report = rt.write_arrow(tables)
            stats.epochs += 1
            stats.rows += options.rows
            if not report.committed:
                stats.uncommitted.append(report.epoch)
            if report.rows != options.rows:
                stats.row_mismatches.append(report.epoch)
    except Exception as exc:
        stats.error = f"{type(exc).__name__}: {exc}"
        print(f"[soak] write failed, stopping: {stats.error}", file=sys.stderr)
    finally:
        stats.seconds = time.monotonic() - stats.started


# ---------------------------------------------------------------------- verification


@dataclass(frozen=True, kw_only=True)
class IdCheck:
    sink: str
    rows: int
    distinct: int
    missing: int
    duplicated: int
    unexpected: int
    error: str | None = None

    @property
    def ok(self) -> bool:
        return (self.error is None and self.missing == 0 and self.duplicated == 0
                and self.unexpected == 0)


def count_ids(sink: str, batches: Iterable[pa.RecordBatch], expected: int) -> IdCheck:
    """Every id in ``0 .. expected - 1`` once: counted in a compact array, batch by batch."""
    counts = np.zeros(expected, dtype=np.uint16)
    rows = unexpected = 0
    for batch in batches:
        ids = batch.column(0).to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
        rows += len(ids)
        inside = (ids >= 0) & (ids < expected)
        unexpected += int(len(ids) - np.count_nonzero(inside))
        np.add.at(counts, ids[inside], 1)
    seen = int(np.count_nonzero(counts))
    return IdCheck(sink=sink, rows=rows, distinct=seen, missing=expected - seen,
                   duplicated=int(np.count_nonzero(counts > 1)), unexpected=unexpected)


def id_batches(kind: str, path: Path) -> Iterator[pa.RecordBatch]:
    if kind == "parquet":
        import pyarrow.dataset as ds

        yield from ds.dataset(str(path), format="parquet").to_batches(columns=["id"])
    else:
        from deltalake import DeltaTable

        yield from DeltaTable(str(path)).to_pyarrow_dataset().to_batches(columns=["id"])


def check_tables(sinks: Iterable[str], workdir: Path, expected: int) -> list[IdCheck]:
    checks = []
    for name in sinks:
        try:
            checks.append(count_ids(name, id_batches(name, workdir / name), expected))
        except Exception as exc:
            checks.append(IdCheck(sink=name, rows=0, distinct=0, missing=expected,
                                  duplicated=0, unexpected=0,
                                  error=f"{type(exc).__name__}: {exc}"))
    return checks


@dataclass(frozen=True, kw_only=True)
class MemoryVerdict:
    label: str
    pids: list[int]
    samples: int
    first_mib: float
    last_mib: float
    peak_mib: float
    baseline_mib: float
    final_mib: float
    growth_mib: float
    growth_pct: float
    ok: bool


def memory_verdict(series: Series, run_seconds: float, max_mib: float,
                   max_pct: float) -> MemoryVerdict:
    """Growth from the median of the first 20% of the samples after the warm-up to the
    median of the last 20%."""
    warmup = min(WARMUP_CAP_SECONDS, EDGE_FRACTION * run_seconds)
    values = [v for at, v in series.samples if at >= warmup] or [v for _, v in series.samples]
    edge = max(1, round(len(values) * EDGE_FRACTION))
    baseline = statistics.median(values[:edge])
    final = statistics.median(values[-edge:])
    growth = final - baseline
    pct = 100.0 * growth / baseline if baseline else 0.0
    everything = [v for _, v in series.samples]
    return MemoryVerdict(
        label=series.label, pids=list(series.pids), samples=len(everything),
        first_mib=everything[0] / MIB, last_mib=everything[-1] / MIB,
        peak_mib=max(everything) / MIB, baseline_mib=baseline / MIB, final_mib=final / MIB,
        growth_mib=growth / MIB, growth_pct=pct,
        ok=growth / MIB <= max_mib and pct <= max_pct)


# ---------------------------------------------------------------------- verdict


def checks_of(options: Options, stats: WriteStats, sampler: Sampler,
              memory: list[MemoryVerdict], tables: list[IdCheck]) -> dict[str, bool]:
    bounds = sampler.bounds
    sinks = sampler.sinks
    return {
        "writes: no failed epoch, every epoch committed with its rows":
            stats.error is None and not stats.uncommitted and not stats.row_mismatches
            and stats.epochs > 0,
        f"memory steady (growth <= {options.max_growth_mib:g} MiB and "
        f"<= {options.max_growth_pct:g}% per process)": all(m.ok for m in memory),
        "no actor restarted": all(s.restarts == 0 for s in sampler.series.values()),
        f"mailbox depth <= credits ({CREDITS})":
            max(bounds.mailbox_max.values(), default=0) <= CREDITS,
        f"outstanding epochs <= max_pending_epochs ({MAX_PENDING_EPOCHS})":
            bounds.outstanding_max <= MAX_PENDING_EPOCHS,
        f"meta store epoch rows <= {epoch_rows_limit(sinks)}, status rows <= {sinks}":
            bounds.epoch_rows_max <= epoch_rows_limit(sinks)
            and bounds.status_rows_max <= sinks,
        "probes answered": bounds.probes > 0 and bounds.probe_errors == 0,
        "tables hold every id exactly once": bool(tables) and all(t.ok for t in tables),
    }


def print_summary(options: Options, stats: WriteStats, sampler: Sampler,
                  memory: list[MemoryVerdict], tables: list[IdCheck],
                  checks: dict[str, bool]) -> None:
    bounds = sampler.bounds
    print(f"\nraysink soak: sink={options.sink}, {options.rows:,} rows x {options.batches} "
          f"tables per epoch, {options.minutes:g} min, workdir {options.workdir}")
    print(f"  wrote {stats.epochs:,} epochs, {stats.rows:,} rows in {stats.seconds:,.1f}s: "
          f"{stats.rate:,.0f} rows/s, {stats.epochs / max(stats.seconds, 1e-9):.2f} epochs/s")
    if stats.error:
        print(f"  stopped by: {stats.error}")
    print("  USS per process (MiB):  first     last     peak  baseline  final  growth")
    for m in memory:
        print(f"    {m.label:<20} {m.first_mib:8.1f} {m.last_mib:8.1f} {m.peak_mib:8.1f} "
              f"{m.baseline_mib:8.1f} {m.final_mib:7.1f} {m.growth_mib:+7.1f} "
              f"({m.growth_pct:+.1f}%) {'ok' if m.ok else 'GROWING'}"
              + (f" restarted: pids {m.pids}" if len(m.pids) > 1 else ""))
    print(f"  probes {bounds.probes} ({bounds.probe_errors} failed): mailbox depth max "
          f"{bounds.mailbox_max}, outstanding epochs max {bounds.outstanding_max}, meta "
          f"store epoch rows max {bounds.epoch_rows_max}, status rows max "
          f"{bounds.status_rows_max}")
    for violation in bounds.violations[:10]:
        print(f"    over bound: {violation}")
    for t in tables:
        print(f"  table {t.sink}: {t.rows:,} rows, {t.distinct:,} distinct ids, "
              f"{t.missing:,} missing, {t.duplicated:,} duplicated, {t.unexpected:,} "
              f"unexpected" + (f", error {t.error}" if t.error else ""))
    for name, ok in checks.items():
        print(f"  [{'PASS' if ok else 'FAIL'}] {name}")
    print(f"  verdict: {'PASS' if all(checks.values()) else 'FAIL'}; report "
          f"{options.report}")


def write_report(options: Options, stats: WriteStats, sampler: Sampler,
                 memory: list[MemoryVerdict], tables: list[IdCheck],
                 checks: dict[str, bool]) -> None:
    report = {
        "options": {k: str(v) if isinstance(v, Path) else v
                    for k, v in asdict(options).items()},
        "writes": {"epochs": stats.epochs, "rows": stats.rows, "seconds": stats.seconds,
                   "rows_per_second": stats.rate, "uncommitted": stats.uncommitted,
                   "row_mismatches": stats.row_mismatches, "error": stats.error},
        "memory": [asdict(m) for m in memory],
        "samples": {s.label: s.samples for s in sampler.series.values()},
        "bounds": asdict(sampler.bounds),
        "tables": [{**asdict(t), "ok": t.ok} for t in tables],
        "checks": checks,
        "passed": all(checks.values()),
    }
    options.report.parent.mkdir(parents=True, exist_ok=True)
    options.report.write_text(json.dumps(report, indent=2))


# ---------------------------------------------------------------------- main


def soak(options: Options) -> bool:
    sinks = make_sinks(options.sink, options.workdir)
    stats = WriteStats()
    rt = open_runtime(options, sinks)
    sampler = Sampler(rt, options, stats, sinks=len(sinks))
    try:
        stats.started = sampler.started = time.monotonic()
        sampler.start()
        write_until(rt, options, stats)
        sampler.stop()
        sampler.probe_bounds()
    finally:
        rt.close()
    sampler.probe_metastore(time.monotonic() - sampler.started)
    memory = [memory_verdict(s, stats.seconds, options.max_growth_mib,
                             options.max_growth_pct) for s in sampler.series.values()]
    tables = check_tables(sinks, options.workdir, stats.rows)
    checks = checks_of(options, stats, sampler, memory, tables)
    print_summary(options, stats, sampler, memory, tables, checks)
    write_report(options, stats, sampler, memory, tables, checks)
    return all(checks.values())


def main(argv: list[str] | None = None) -> int:
    options = parse_args(argv)
    ray.init(num_cpus=8, include_dashboard=False, namespace="raysink")
    try:
        passed = soak(options)
    finally:
        ray.shutdown()
        if not options.keep:
            clean_workdir(options)
    return 0 if passed else 1


def clean_workdir(options: Options) -> None:
    """Remove the tables and the meta store of a temporary work directory; the report
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
