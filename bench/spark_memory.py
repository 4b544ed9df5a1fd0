"""Benchmark: a DataFrame larger than Ray's object store, written exactly once (not a test).

Ray starts with a small object store (``--store-mb``, default 256 MB) and spilling into a
directory of this run. For each scale (default 1x, then 3x the object store, in Arrow
bytes), a fresh ``SinkRuntime`` writes one cached DataFrame (an id, a double, a ~190-byte
string; partitions of constant size, so more of them at 3x) into a ``ParquetSink`` with
2 writers through ``rt.write(df)``, then reads the table back and checks that every id is
there exactly once.

A background thread samples the unique memory (USS, ``psutil``) of every process of this
Ray session every ``--interval`` seconds and keeps each one's peak: the driver, the writer
actors (pids from their ``ping()``), the coordinator (``pid()``), the raylet (which holds
the object store), the RayDP executor JVMs and Ray's task workers (which run the
partition fetches). Ray's spilled bytes come from ``memory_summary`` (before and after
each run) and from the peak size of the spill directory.

    .venv/bin/python bench/spark_memory.py [--store-mb 256] [--scales 1,3]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("PYSPARK_PYTHON", sys.executable)

import numpy as np
import psutil
import pyarrow.dataset as ds
import ray

from raysink import SinkRuntime
from raysink.progress import Progress
from raysink.sinks import ParquetSink

_STRING_BYTES = 190
_ROW_BYTES = 8 + 8 + _STRING_BYTES + 4 + 4  # id, x, string + offset, k (Arrow, roughly)
_PARTITION_MB = 32


class MemorySampler:
    """Peak USS per process, and the peak size of a directory, sampled in a thread."""

    def __init__(self, interval: float, spill_dir: Path) -> None:
        self.interval = interval
        self.spill_dir = spill_dir
        self.roles: dict[int, str] = {}
        self.peaks: dict[int, int] = collections.defaultdict(int)
        self.starts: dict[int, int] = {}
        self.spill_peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def watch(self, pid: int, role: str) -> None:
        self.roles[pid] = role

    def start(self) -> None:
        self.peaks.clear()
        self.starts.clear()
        self.spill_peak = 0
        self._sample()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="uss-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._sample()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def _sample(self) -> None:
        self._discover()
        for pid in list(self.roles):
            try:
                uss = psutil.Process(pid).memory_full_info().uss
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            self.peaks[pid] = max(self.peaks[pid], uss)
            self.starts.setdefault(pid, uss)
        self.spill_peak = max(self.spill_peak, _dir_bytes(self.spill_dir))

    def _discover(self) -> None:
        """Ray's raylet, task workers and the RayDP executor JVMs of this session."""
        for proc in psutil.Process().children(recursive=True):
            if proc.pid in self.roles:
                continue
            role = _role(proc)
            if role is not None:
                self.roles[proc.pid] = role


def _role(proc: psutil.Process) -> str | None:
    try:
        name = proc.name()
        cmdline = " ".join(proc.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None
    if name == "raylet":
        return "raylet (object store)"
    if "java" in name:
        if "SparkSubmit" in cmdline:
            return "Spark driver JVM"
        return "RayDP JVM (executor / app master)"
    if "default_worker.py" in cmdline or cmdline.startswith("ray::"):
        title = cmdline.split()[0] if cmdline.startswith("ray::") else "ray worker"
        if "SinkWriterActor" in title or "CoordinatorActor" in title:
            return None  # registered by pid with their names
        return "Ray worker (tasks, fetches)"
    return None


def _dir_bytes(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(root, name))
            except OSError:
                continue
    return total


def spilled_mib(address: str) -> tuple[float, float]:
    """Cumulative (spilled, restored) MiB of this Ray session, from its memory summary."""
    from ray._private.internal_api import memory_summary

    text = memory_summary(address=address, stats_only=True)  # type: ignore[no-untyped-call]
    spilled = re.search(r"Spilled (\d+(?:\.\d+)?) MiB", text)
    restored = re.search(r"Restored (\d+(?:\.\d+)?) MiB", text)
    return (float(spilled.group(1)) if spilled else 0.0,
            float(restored.group(1)) if restored else 0.0)


def build_frame(spark: Any, rows: int, partitions: int) -> Any:
    pad = "x" * (_STRING_BYTES - 12)
    df = spark.range(0, rows, 1, partitions).selectExpr(
        "id",
        "id * 0.5 AS x",
        f"concat(lpad(CAST(id AS STRING), 12, '0'), '{pad}') AS s",
        "CAST(id % 97 AS INT) AS k",
    )
    df.cache()
    df.count()
    return df


def check_table(path: Path, rows: int) -> str:
    ids = ds.dataset(str(path), format="parquet").to_table(columns=["id"])["id"].to_numpy()
    counts = np.bincount(ids, minlength=rows) if ids.size else np.zeros(rows, dtype=np.int64)
    missing = int((counts[:rows] == 0).sum())
    doubled = int((counts > 1).sum())
    extra = int(ids.size) - rows
    verdict = "yes" if missing == doubled == extra == 0 else "NO"
    return (f"{ids.size:,} rows read back; every id exactly once: {verdict} "
            f"(missing {missing}, doubled {doubled})")


def run_scale(spark: Any, scale: int, store_mb: int, root: Path, sampler: MemorySampler,
              address: str) -> dict[str, Any]:
    target_bytes = scale * store_mb * 1024 * 1024
    rows = target_bytes // _ROW_BYTES
    partitions = max(2, target_bytes // (_PARTITION_MB * 1024 * 1024))
    started = time.perf_counter()
    df = build_frame(spark, rows, partitions)
    print(f"\n{scale}x: {rows:,} rows (~{target_bytes / 2**20:.0f} MiB in Arrow) in {partitions} "
          f"partitions, cached in {time.perf_counter() - started:.1f} s", flush=True)
    table = root / f"table-{scale}x"
    rt = SinkRuntime(f"bench-memory-{scale}x", ParquetSink(str(table)), writers=2,
                     metastore=f"sqlite:///{root / f'meta-{scale}x.db'}").start()
    try:
        for process in rt.processes():  # the coordinator first, then the writers
            if process.pid is not None:
                label = process.role if process.writer is None else f"writer-{process.writer}"
                sampler.watch(process.pid, label)
        before = spilled_mib(address)
        sampler.start()
        start = time.perf_counter()
        with Progress(total_rows=rows, total_epochs=1, label=f"{scale}x") as progress:
            report = rt.write(df)
            progress.record(report)
        seconds = time.perf_counter() - start
        sampler.stop()
        after = spilled_mib(address)
    finally:
        rt.close()
        df.unpersist()
    print(f"{scale}x: rt.write {seconds:.1f} s, committed={report.committed}; "
          f"{check_table(table, rows)}")
    result = {"scale": scale, "rows": rows, "seconds": seconds,
              "spilled_mib": after[0] - before[0], "restored_mib": after[1] - before[1],
              "spill_dir_peak_mib": sampler.spill_peak / 2**20,
              "peaks": _peaks_by_role(sampler)}
    shutil.rmtree(table, ignore_errors=True)
    return result


def _peaks_by_role(sampler: MemorySampler) -> dict[str, float]:
    """Peak USS (MiB) per role, and for the driver also its growth during the write
    (``driver growth``); several processes of a role: the largest one."""
    peaks: dict[str, float] = {}
    for pid, peak in sampler.peaks.items():
        role = sampler.roles.get(pid, "?")
        peaks[role] = max(peaks.get(role, 0.0), peak / 2**20)
        if role == "driver":
            peaks["driver growth during the write"] = (peak - sampler.starts[pid]) / 2**20
    return peaks


def report(results: list[dict[str, Any]]) -> None:
    roles = sorted({role for r in results for role in r["peaks"]},
                   key=lambda role: (not role.startswith(("driver", "writer")), role))
    header = "".join(f"{r['scale']}x".rjust(12) for r in results)
    print(f"\npeak USS per process (MiB){' ' * 13}{header}")
    for role in roles:
        cells = "".join(f"{r['peaks'].get(role, float('nan')):12.0f}" for r in results)
        print(f"  {role:<37}{cells}")
    for key, label in (("spilled_mib", "Ray spilled (MiB, memory_summary)"),
                       ("restored_mib", "Ray restored (MiB)"),
                       ("spill_dir_peak_mib", "spill directory peak (MiB)"),
                       ("seconds", "rt.write seconds")):
        cells = "".join(f"{r[key]:12.1f}" for r in results)
        print(f"  {label:<37}{cells}")
    print(json.dumps(results, indent=None, default=str))


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--store-mb", type=int, default=256)
    parser.add_argument("--scales", default="1,3")
    parser.add_argument("--interval", type=float, default=0.2)
    args = parser.parse_args()

    from raysink.spark import init_spark, stop_spark

    root = Path(tempfile.mkdtemp(prefix="raysink-bench-memory-"))
    spill = root / "spill"
    spill.mkdir()
    spilling = {"type": "filesystem", "params": {"directory_path": str(spill)}}
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False,
             object_store_memory=args.store_mb * 1024 * 1024,
             _system_config={"object_spilling_config": json.dumps(spilling)})
    address = ray.get_runtime_context().gcs_address
    sampler = MemorySampler(args.interval, spill)
    sampler.watch(os.getpid(), "driver")
    spark = init_spark("raysink-bench-memory", executors=2, executor_cores=1,
                       executor_memory="1500m",
                       configs={"spark.ui.showConsoleProgress": "false"})
    try:
        spark.sparkContext.setLogLevel("ERROR")
        results = [run_scale(spark, int(s), args.store_mb, root, sampler, address)
                   for s in args.scales.split(",")]
        report(results)
    finally:
        stop_spark()
        ray.shutdown()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
