"""A year of epochs, shortened: many small epochs into each sink, one runtime per sink,
showing whether an epoch at the end costs what one at the start did (issue 37).

For each sink of ``--sinks`` (``parquet``, ``delta``, ``delta-part``, ``iceberg``,
``iceberg-part``; ``-part`` partitions by a ``day`` column that changes every 100 epochs),
one runtime of ``--writers`` writers commits ``--epochs`` epochs of ``--rows`` rows through
``rt.write_arrow`` (the table cut in one piece per writer), then reports:

* epoch p50 over the first and the last ``--window`` epochs, and their ratio;
* the live data files, and the metadata on disk (Delta's ``_delta_log``, Iceberg's
  ``metadata/``, Parquet's ``_raysink/``);
* a fresh reader's open and row count (``pyarrow.dataset``, ``deltalake``, ``pyiceberg``),
  in seconds;
* the maintenance totals ``status()`` shows.

``--maintenance off`` runs the same with maintenance switched off (the side-by-side
alternative); ``--policy`` sets ``raysink.Maintenance`` fields (``every_epochs=10,...``).
A sink whose class cannot do something asked (a partitioned Iceberg table before it
exists) is reported as skipped with the error. Writes a JSON report (``--report``)::

    .venv/bin/python bench/longrun.py --epochs 2000 --sinks delta --maintenance on
    make longrun EPOCHS=10000 SINKS=parquet,delta,delta-part,iceberg,iceberg-part
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
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

from raysink import Maintenance, SinkRuntime
from raysink.sinks import DeltaSink, ParquetSink, Sink

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
    part = kind.endswith("-part")
    if kind == "parquet":
        return ParquetSink(str(root / "parquet"))
    if kind.startswith("delta"):
        return DeltaSink(str(root / kind), partition_by=["day"] if part else None,
                         maintenance=maintenance)
    from raysink.sinks.iceberg import IcebergSink

    options: dict[str, Any] = {"catalog": iceberg_catalog(root)}
    params = inspect.signature(IcebergSink).parameters
    if "maintenance" in params:
        options["maintenance"] = maintenance
    if part:
        if "partition_by" not in params:
            raise NotImplementedError("IcebergSink has no partition_by= in this tree")
        options["partition_by"] = ["day"]
    return IcebergSink(f"bench.{kind.replace('-', '_')}", **options)


def iceberg_catalog(root: Path) -> dict[str, str]:
    return {"type": "sql", "uri": f"sqlite:///{root / 'catalog.db'}",
            "warehouse": f"file://{root / 'warehouse'}"}


# ---------------------------------------------------------------------- the table


def dir_bytes(path: Path) -> tuple[int, int]:
    files = [p for p in path.rglob("*") if p.is_file()] if path.exists() else []
    return len(files), sum(p.stat().st_size for p in files)


def inspect_table(kind: str, root: Path) -> dict[str, Any]:
    """Live data files, metadata on disk, and a fresh reader's open and count."""
    started = time.perf_counter()
    if kind == "parquet":
        import pyarrow.dataset as ds

        rows = ds.dataset(str(root / "parquet"), format="parquet").count_rows()
        read_s = time.perf_counter() - started
        files = len(list((root / "parquet").glob("*.parquet")))
        meta = dir_bytes(root / "parquet" / "_raysink")
    elif kind.startswith("delta"):
        import deltalake

        table = deltalake.DeltaTable(str(root / kind))
        rows = table.to_pyarrow_dataset().count_rows()
        read_s = time.perf_counter() - started
        files = len(table.file_uris())
        meta = dir_bytes(root / kind / "_delta_log")
    else:
        from pyiceberg.catalog import load_catalog

        table = load_catalog("raysink", **iceberg_catalog(root)).load_table(
            f"bench.{kind.replace('-', '_')}")
        tasks = list(table.scan().plan_files())
        rows = sum(t.file.record_count for t in tasks)
        read_s = time.perf_counter() - started
        files = len(tasks)
        location = Path(table.metadata.location.removeprefix("file://"))
        meta = dir_bytes(location / "metadata")
    return {"rows": rows, "data_files": files, "metadata_files": meta[0],
            "metadata_bytes": meta[1], "fresh_open_count_s": round(read_s, 3)}


# ---------------------------------------------------------------------- one sink


def run_sink(kind: str, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    sink = make_sink(kind, root, policy(args.maintenance, args.policy))
    seconds: list[float] = []
    meta = f"sqlite:///{root / f'{kind}.db'}"
    with SinkRuntime(f"longrun-{kind}", {kind: sink}, writers=args.writers, metastore=meta,
                     progress=False) as rt:
        for epoch in range(1, args.epochs + 1):
            parts = epoch_rows(epoch, args.rows, args.writers)
            started = time.perf_counter()
            report = rt.write_arrow(parts)
            seconds.append(time.perf_counter() - started)
            if not report.committed:
                raise SystemExit(f"{kind}: epoch {epoch} not committed: {report}")
            if epoch % args.every == 0:
                print(f"{kind}: epoch {epoch}, p50 of the last {args.every}: "
                      f"{statistics.median(seconds[-args.every:]) * 1000:.1f} ms",
                      file=sys.stderr, flush=True)
        status = rt.status().sinks[kind]
    window = min(args.window, len(seconds) // 2)
    first = statistics.median(seconds[:window])
    last = statistics.median(seconds[-window:])
    result: dict[str, Any] = {
        "sink": kind, "epochs": args.epochs, "window": window,
        "p50_first_ms": round(first * 1000, 2), "p50_last_ms": round(last * 1000, 2),
        "growth": round(last / first, 3),
        "maintenance": dataclasses.asdict(status.maintenance) if status.maintenance else None,
        **inspect_table(kind, root)}
    if result["rows"] != args.epochs * args.rows:
        result["error"] = f"rows {result['rows']} != {args.epochs * args.rows}"
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=10_000)
    parser.add_argument("--rows", type=int, default=1_000)
    parser.add_argument("--writers", type=int, default=2)
    parser.add_argument("--sinks", default="parquet,delta,delta-part,iceberg,iceberg-part")
    parser.add_argument("--window", type=int, default=500)
    parser.add_argument("--every", type=int, default=500, help="progress line period")
    parser.add_argument("--maintenance", choices=("on", "off"), default="on")
    parser.add_argument("--policy", default="", help="Maintenance fields: every_epochs=10,...")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--report", default=None)
    args = parser.parse_args(argv)
    kinds = [k for k in args.sinks.split(",") if k]
    unknown = sorted(set(kinds) - set(SINKS))
    if unknown:
        parser.error(f"unknown sinks {unknown}; choose from {SINKS}")
    root = Path(args.workdir or tempfile.mkdtemp(prefix="raysink-longrun-"))
    root.mkdir(parents=True, exist_ok=True)
    ray.init(num_cpus=4, include_dashboard=False, logging_level="WARNING")
    results = []
    try:
        for kind in kinds:
            try:
                results.append(run_sink(kind, args, root))
            except NotImplementedError as exc:
                results.append({"sink": kind, "skipped": str(exc)})
            print(json.dumps(results[-1]), flush=True)
    finally:
        ray.shutdown()
    report = Path(args.report or root / "longrun.json")
    report.write_text(json.dumps({"args": vars(args), "results": results}, indent=2))
    print(f"report: {report}", file=sys.stderr)
    if args.workdir is None:
        shutil.rmtree(root, ignore_errors=True)
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
