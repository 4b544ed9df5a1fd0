"""A year of epochs, shortened: many small epochs into each sink, one runtime per sink,
showing whether an epoch at the end costs what one at the start did (issue 37).

For each sink of ``--sinks`` (``parquet``, ``delta``, ``delta-part``, ``iceberg``,
``iceberg-part``; ``-part`` partitions by a ``day`` column that changes every 100 epochs
and cycles through 30 values), one runtime of ``--writers`` writers commits ``--epochs``
epochs of ``--rows`` rows through ``rt.write_arrow`` (the table cut in one piece per
writer), then reports:

* epoch p50 over the first and the last ``--window`` epochs, and their ratio;
* the live data files and bytes, the retained snapshots (Delta log versions), and the
  metadata on disk (Delta's ``_delta_log``, Iceberg's ``metadata/``, Parquet's ``_raysink/``);
* a fresh reader's open and row count (``pyarrow.dataset``, ``deltalake``, ``pyiceberg``),
  in seconds;
* the maintenance totals ``status()`` shows.

After the last sink, one RayDP Spark session counts each Delta and Iceberg table, twice,
and the same rows written in one go beside them (``bench/longrun_spark.py``, which says
what is timed; ``--spark off`` skips it, ``--spark-floor off`` the floor). Then issue
37's verdicts, per sink with the bound each checks (``bench/longrun_verdict.py``), and the
exit code: 1 when any fails. Timing verdicts (p50 growth, count seconds) need a quiet machine.

While it runs: a progress line every ``--every`` epochs or ``--progress-s`` seconds, and
after a sink's first 50 epochs an estimate of the whole run. Measured here (load 20-35 on
2 cores) at ``--epochs 300``: 11-16 min; ``--epochs 10000`` would take 4-5 h at that
load, Iceberg's epochs the dearest (0.5 s each against Delta's 0.12 s, on average).

``--maintenance off`` runs the same with maintenance switched off (the side-by-side
alternative); ``--policy`` sets ``raysink.Maintenance`` fields (``every_epochs=10,...``).
Writes a JSON report (``--report``, else ``longrun.json`` in ``--workdir``)::

    .venv/bin/python bench/longrun.py --epochs 2000 --sinks delta --maintenance on
    make longrun EPOCHS=10000 SINKS=parquet,delta,delta-part,iceberg,iceberg-part
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import ray
from longrun_spark import FLOORS, spark_counts
from longrun_verdict import Check, checks
from longrun_verdict import report as report_verdicts

from raysink import Maintenance, SinkRuntime
from raysink.sinks import DeltaSink, IcebergSink, ParquetSink, Sink

SINKS = ("parquet", "delta", "delta-part", "iceberg", "iceberg-part")


def epoch_rows(epoch: int, rows: int, writers: int) -> list[pa.Table]:
    base = epoch * rows
    table = pa.table({
        "id": pa.array(range(base, base + rows), pa.int64()),
        "day": pa.array([f"d{(epoch // 100) % 30:02d}"] * rows),
        "value": pa.array([float(i) for i in range(rows)], pa.float64()),
    })
    step = -(-rows // writers)
    return [table.slice(i * step, step) for i in range(writers)]


def policy(maintenance: str, fields: str) -> Maintenance | bool:
    if maintenance == "off":
        return False
    changes: dict[str, Any] = {}
    for item in filter(None, fields.split(",")):
        key, value = item.split("=")
        changes[key] = float(value) if "." in value else int(value)
    return Maintenance().replace(**changes)


def make_sink(kind: str, root: Path, maintenance: Maintenance | bool) -> Sink:
    part = ["day"] if kind.endswith("-part") else None
    if kind == "parquet":
        return ParquetSink(str(root / "parquet"))
    if kind.startswith("delta"):
        return DeltaSink(str(root / kind), partition_by=part, maintenance=maintenance)
    return IcebergSink(f"bench.{kind.replace('-', '_')}", catalog=iceberg_catalog(root),
                       maintenance=maintenance, partition_by=part)


def iceberg_catalog(root: Path) -> dict[str, str]:
    return {"type": "sql", "uri": f"sqlite:///{root / 'catalog.db'}",
            "warehouse": f"file://{root / 'warehouse'}"}


# ---------------------------------------------------------------------- the table


def dir_bytes(path: Path) -> tuple[int, int]:
    files = [p for p in path.rglob("*") if p.is_file()] if path.exists() else []
    return len(files), sum(p.stat().st_size for p in files)


def inspect_table(kind: str, root: Path, keep_seconds: float) -> dict[str, Any]:
    """Live data files and bytes, retained snapshots (and how many are younger than
    ``keep_seconds``), metadata on disk, and a fresh reader's open and count."""
    import deltalake
    import pyarrow.dataset as ds
    from pyiceberg.catalog import load_catalog

    started = time.perf_counter()  # a fresh reader's open and count; not its imports
    if kind == "parquet":
        rows = ds.dataset(str(root / "parquet"), format="parquet").count_rows()
        read_s = time.perf_counter() - started
        data = [p.stat().st_size for p in (root / "parquet").glob("*.parquet")]
        meta, snapshots, young, newest = dir_bytes(root / "parquet" / "_raysink"), 0, 0, 0
        reader = "pyarrow.dataset"
    elif kind.startswith("delta"):
        table = deltalake.DeltaTable(str(root / kind))
        rows = table.to_pyarrow_dataset().count_rows()
        read_s = time.perf_counter() - started
        data = pa.table(table.get_add_actions(flatten=False)).column("size_bytes").to_pylist()
        log = root / kind / "_delta_log"
        meta = dir_bytes(log)
        times = [p.stat().st_mtime for p in log.glob("*.json") if p.stem.isdigit()]
        snapshots, newest = len(times), 0
        young = sum(t >= max(times) - keep_seconds for t in times)
        reader = "deltalake"
    else:
        ice = load_catalog("raysink", **iceberg_catalog(root)).load_table(
            f"bench.{kind.replace('-', '_')}")
        tasks = list(ice.scan().plan_files())
        rows = sum(t.file.record_count for t in tasks)
        read_s = time.perf_counter() - started
        data = [t.file.file_size_in_bytes for t in tasks]
        location = Path(ice.metadata.location.removeprefix("file://"))
        meta = dir_bytes(location / "metadata")
        stamps = [snap.timestamp_ms for snap in ice.metadata.snapshots]
        snapshots = len(stamps)
        young = sum(t >= max(stamps) - keep_seconds * 1000 for t in stamps)
        newest = Path(ice.metadata_location.removeprefix("file://")).stat().st_size
        reader = "pyiceberg plan_files"
    return {"rows": rows, "data_files": len(data), "data_bytes": int(sum(data)),
            "snapshots": snapshots, "young": young, "metadata_files": meta[0],
            "metadata_bytes": meta[1], "metadata_json_bytes": newest, "reader": reader,
            "fresh_open_count_s": round(read_s, 3)}


# ---------------------------------------------------------------------- one sink


class Progress:
    """A line every ``every`` epochs or ``period_s`` seconds, whichever comes first, and
    after the first ``ESTIMATE_AT`` epochs of a sink an estimate of the time left."""

    ESTIMATE_AT, WARM = 50, 10

    def __init__(self, kind: str, epochs: int, every: int, period_s: float,
                 run: RunClock) -> None:
        self.kind, self.epochs, self.every, self.period_s = kind, epochs, every, period_s
        self.run = run
        self.started = self.last = time.monotonic()
        self.since = 0
        self.warm = self.started

    def epoch(self, epoch: int, seconds: list[float]) -> None:
        now = time.monotonic()
        if epoch == self.WARM:
            self.warm = now  # the first epochs (a table created, actors warming) left out
        if epoch == min(self.ESTIMATE_AT, self.epochs):
            per_epoch = ((now - self.warm) / (epoch - self.WARM) if epoch > self.WARM
                         else (now - self.started) / epoch)
            self.run.estimate(self.kind, now - self.started + per_epoch * (self.epochs - epoch))
        if epoch % self.every and now - self.last < self.period_s and epoch != self.epochs:
            return
        recent, self.since, self.last = seconds[self.since:], epoch, now
        left = (now - self.started) / epoch * (self.epochs - epoch)
        print(f"{self.kind}: epoch {epoch:,}/{self.epochs:,}, p50 of the last {len(recent)}: "
              f"{statistics.median(recent) * 1000:.1f} ms, {now - self.started:.0f} s in, "
              f"about {left / 60:.1f} min left for this sink", file=sys.stderr, flush=True)


class RunClock:
    """The whole run's time: done sinks as they took, the running one and each one left
    at the running one's pace, and Spark's session and counts."""

    SPARK_S = 300.0  # RayDP's start took 100 s at load 20-35, the warm-up and counts
    # each sink's time relative to Parquet's, from two runs of --epochs 300 of the five
    # here (27.8, 38.0, 40.3, 197.6, 246.8 s and 25.9, 35.5, 40.1, 161.5, 152.5 s): for the
    # sinks not started yet
    WEIGHT = {"parquet": 1.0, "delta": 1.4, "delta-part": 1.5, "iceberg": 6.5,
              "iceberg-part": 7.0}

    def __init__(self, kinds: list[str], spark: bool) -> None:
        self.kinds, self.spark = kinds, spark
        self.started = time.monotonic()
        self.done: list[str] = []

    def estimate(self, kind: str, sink_s: float) -> None:
        left = [k for k in self.kinds if k not in self.done and k != kind]
        later = sum(self.WEIGHT[k] / self.WEIGHT[kind] * sink_s for k in left)
        elapsed = time.monotonic() - self.started
        total = elapsed + sink_s + later + (self.SPARK_S if self.spark else 0)
        print(f"estimate: {kind} takes about {sink_s / 60:.1f} min at its first epochs' "
              f"pace; the whole run about {total / 60:.0f} min (the sinks after it scaled "
              f"by their cost relative to it measured here: {self.WEIGHT})",
              file=sys.stderr, flush=True)


def run_sink(kind: str, args: argparse.Namespace, root: Path, clock: RunClock
             ) -> dict[str, Any]:
    maintenance = policy(args.maintenance, args.policy)
    sink = make_sink(kind, root, maintenance)
    seconds: list[float] = []
    meta = f"sqlite:///{root / f'{kind}.db'}"
    progress = Progress(kind, args.epochs, args.every, args.progress_s, clock)
    with SinkRuntime(f"longrun-{kind}", {kind: sink}, writers=args.writers, metastore=meta,
                     progress=False) as rt:
        for epoch in range(1, args.epochs + 1):
            parts = epoch_rows(epoch, args.rows, args.writers)
            started = time.perf_counter()
            report = rt.write_arrow(parts)
            seconds.append(time.perf_counter() - started)
            if not report.committed:
                raise SystemExit(f"{kind}: epoch {epoch} not committed: {report}")
            progress.epoch(epoch, seconds)
        status = rt.status().sinks[kind]
    clock.done.append(kind)
    window = min(args.window, len(seconds) // 2)
    first = statistics.median(seconds[:window])
    last = statistics.median(seconds[-window:])
    keep_s = maintenance.keep_seconds if isinstance(maintenance, Maintenance) else 0.0
    return {
        "sink": kind, "epochs": args.epochs, "window": window,
        "p50_first_ms": round(first * 1000, 2), "p50_last_ms": round(last * 1000, 2),
        "growth": round(last / first, 3), "seconds": round(sum(seconds), 1),
        "maintenance": dataclasses.asdict(status.maintenance) if status.maintenance else None,
        **inspect_table(kind, root, keep_s)}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=10_000)
    parser.add_argument("--rows", type=int, default=1_000)
    parser.add_argument("--writers", type=int, default=2)
    parser.add_argument("--sinks", default="parquet,delta,delta-part,iceberg,iceberg-part")
    parser.add_argument("--window", type=int, default=500)
    parser.add_argument("--every", type=int, default=500, help="progress line every N epochs")
    parser.add_argument("--progress-s", type=float, default=10.0,
                        help="...or every this many seconds, whichever comes first")
    parser.add_argument("--maintenance", choices=("on", "off"), default="on")
    parser.add_argument("--policy", default="", help="Maintenance fields: every_epochs=10,...")
    parser.add_argument("--spark", choices=("on", "off"), default="on",
                        help="count the Delta and Iceberg tables from Spark (RayDP) too")
    parser.add_argument("--spark-floor", choices=("on", "off"), default="on",
                        help="also count the same rows written in one go (the floor)")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--report", default=None)
    args = parser.parse_args(argv)
    kinds = [k for k in args.sinks.split(",") if k]
    unknown = sorted(set(kinds) - set(SINKS))
    if unknown:
        parser.error(f"unknown sinks {unknown}; choose from {SINKS}")
    root = Path(args.workdir or tempfile.mkdtemp(prefix="raysink-longrun-"))
    root.mkdir(parents=True, exist_ok=True)
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"longrun: {args.epochs:,} epochs x {args.rows:,} rows at {args.writers} writers "
          f"into {', '.join(kinds)}; maintenance {args.maintenance}; load average {load} "
          f"on {os.cpu_count()} cores; workdir {root}", file=sys.stderr, flush=True)
    # Spark's Python workers are started by Ray's raylet: it must know the interpreter
    os.environ["PYSPARK_PYTHON"] = sys.executable
    # RayDP's executors wait forever for CPUs Ray does not have: logical CPUs to spare
    ray.init(num_cpus=8, include_dashboard=False, logging_level=logging.WARNING)
    clock = RunClock(kinds, args.spark == "on")
    results: list[dict[str, Any]] = []
    try:
        for kind in kinds:
            try:
                results.append(run_sink(kind, args, root, clock))
            except Exception as exc:  # one sink's failure is reported, the others still run
                results.append({"sink": kind, "error": f"{type(exc).__name__}: {exc}"})
                clock.done.append(kind)
            print(json.dumps(results[-1]), flush=True)
        if args.spark == "on":
            floor = args.epochs * args.rows if args.spark_floor == "on" else None
            read_with_spark(root, results, floor)
    finally:
        ray.shutdown()
    elapsed = time.monotonic() - clock.started
    ok = verdicts(results, args)
    print(f"took {elapsed / 60:.1f} min", file=sys.stderr)
    report = Path(args.report or root / "longrun.json")
    report.write_text(json.dumps({"args": vars(args), "results": results,
                                  "minutes": round(elapsed / 60, 1)}, indent=2))
    print(f"report: {report}", file=sys.stderr)
    if args.workdir is None:
        shutil.rmtree(root, ignore_errors=True)
    return 0 if ok else 1


def read_with_spark(root: Path, results: list[dict[str, Any]], floor_rows: int | None
                    ) -> None:
    """Spark's first and warm count of each Delta and Iceberg table, into its result, with
    the floor of its format (the same rows written in one go) beside it."""
    readable = [r for r in results if "error" not in r and r["sink"] != "parquet"]
    try:
        counts = spark_counts(root, [r["sink"] for r in readable], floor_rows)
    except Exception as exc:  # Spark not there or failing: every table's read fails
        counts = {r["sink"]: {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
                  for r in readable}
    for result in readable:
        result["spark"] = counts.get(result["sink"], {"error": "not read"})
        floor = counts.get(FLOORS[result["sink"].split("-")[0]], {})
        if "first_s" in floor and "first_s" in result["spark"]:
            result["spark"]["floor"] = {"first_s": floor["first_s"], "warm_s": floor["warm_s"],
                                        "rows": floor["counts"]["first"]}
    if "session" in counts:
        print(f"spark: session {counts['session']}", file=sys.stderr)


def verdicts(results: list[dict[str, Any]], args: argparse.Namespace) -> bool:
    found: list[Check] = []
    maintenance = policy(args.maintenance, args.policy)
    for result in results:
        if "error" in result:
            found.append(Check(result["sink"], "run", 1, 0, result["error"][:300]))
        else:
            found += checks(result, maintenance, args.writers, args.rows)
    return report_verdicts(found)


if __name__ == "__main__":
    sys.exit(main())
