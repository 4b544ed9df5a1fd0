"""Benchmark: time from killing a writer or the coordinator to the next committed epoch.

Not a test. One runtime (ParquetSink, 2 writers) writes small epochs. For each kill, a
``sleep`` fault is armed at a protocol point of the next epoch *inside the victim*, the
epoch is written in a thread, and once the point fired the victim is killed — a real
SIGKILL of its process (Ray restarts the actor) or ``ray.kill`` (the runtime re-creates
it). The clock runs from the kill until ``write_arrow`` returns that epoch committed (it is
the next epoch to commit). The sleep dies with the victim, so it adds nothing.

Victims and points (the epoch in flight is held at the point when the kill lands):

* writer 0, ``writer.during_write``       (its data half applied)
* writer 0, ``writer.after_pre_commit``   (staged, before its commit request)
* coordinator, ``coordinator.after_open``     (OPEN recorded, before any data)
* coordinator, ``coordinator.after_pending``  (PENDING recorded, before the sink commit)

At the end the table is checked: every id of every epoch exactly once. Prints p50, p90 and
the maximum per victim and kill method (target: p50 < 3 s).

    .venv/bin/python bench/recovery.py [--kills 10] [--rows 20000]
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.dataset as ds
import ray

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from raysink import SinkRuntime
from raysink.sinks import ParquetSink
from raysink.testing import arm_fault, disarm_faults, fired

NAME = "bench-recovery"
CASES = [
    ("writer", "writer.during_write"),
    ("writer", "writer.after_pre_commit"),
    ("coordinator", "coordinator.after_open"),
    ("coordinator", "coordinator.after_pending"),
]
METHODS = ("sigkill", "ray.kill")


def epoch_table(epoch: int, rows: int) -> pa.Table:
    base = epoch * 10_000_000
    return pa.table({"id": pa.array(range(base, base + rows), pa.int64()),
                     "customer": pa.array([f"c{i % 97}" for i in range(rows)])})


class Runner:
    """Writes epochs in order; ``kill_one`` kills a victim inside the next epoch."""

    def __init__(self, rt: SinkRuntime, rows: int) -> None:
        self.rt = rt
        self.rows = rows
        self.epoch = 0

    def write(self) -> None:
        self.epoch += 1
        report = self.rt.write_arrow(epoch_table(self.epoch, self.rows), epoch=self.epoch)
        if not report.committed:
            raise SystemExit(f"epoch {self.epoch} not committed: {report}")

    def kill_one(self, victim: str, point: str, method: str) -> float:
        self.epoch += 1
        epoch = self.epoch
        when: dict[str, Any] = {"epoch": epoch}
        if victim == "writer":
            when.update({"writer": 0, "sink": "main"})
        arm_fault(NAME, point, action="sleep", seconds=30.0, when=when)
        box: dict[str, Any] = {}

        def target() -> None:
            try:
                box["report"] = self.rt.write_arrow(epoch_table(epoch, self.rows),
                                                    epoch=epoch)
            except BaseException as exc:  # reported below
                box["error"] = exc
            box["done"] = time.perf_counter()

        thread = threading.Thread(target=target, daemon=True)
        thread.start()
        deadline = time.monotonic() + 60
        while not fired(NAME, point):
            if time.monotonic() > deadline:
                raise SystemExit(f"{point} never fired")
            time.sleep(0.005)
        handle = self._victim(victim)
        pid = self._pid(victim) if method == "sigkill" else None
        killed = time.perf_counter()
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
        else:
            ray.kill(handle)
        thread.join(timeout=180)
        disarm_faults(NAME)
        if "error" in box or not box["report"].committed:
            raise SystemExit(f"epoch {epoch} after the kill: {box}")
        return float(box["done"] - killed)

    def _victim(self, victim: str) -> Any:
        actors = self.rt._actors
        assert actors is not None
        return actors.coordinator if victim == "coordinator" else actors.writers["main"][0]

    def _pid(self, victim: str) -> int:
        """The victim's process id (writer 0 of sink main, or the coordinator)."""
        for process in self.rt.processes(timeout=30):
            if (process.role, process.writer or 0) == (victim, 0) and process.pid is not None:
                return process.pid
        raise SystemExit(f"the {victim} did not tell its pid")


def check(path: Path, epochs: int, rows: int) -> None:
    ids = Counter(ds.dataset(str(path), format="parquet").to_table(columns=["id"])
                  .column("id").to_pylist())
    expected = {e * 10_000_000 + i for e in range(1, epochs + 1) for i in range(rows)}
    doubled = sum(1 for v in ids.values() if v > 1)
    missing = len(expected - set(ids))
    extra = len(set(ids) - expected)
    verdict = "exact" if not (doubled or missing or extra) else "WRONG"
    print(f"table check: {verdict} ({len(ids):,} ids; doubled {doubled}, missing {missing}, "
          f"extra {extra})")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kills", type=int, default=10, help="kills per victim/point/method")
    parser.add_argument("--rows", type=int, default=20_000, help="rows per epoch")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)  # the runtime warns at every kill, by design
    root = Path(tempfile.mkdtemp(prefix="raysink-recovery-"))
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False, namespace="raysink")
    results: dict[tuple[str, str, str], list[float]] = {}
    try:
        with SinkRuntime(NAME, ParquetSink(str(root / "table")), writers=2,
                         metastore=f"sqlite:///{root / 'meta.db'}", progress=False) as rt:
            runner = Runner(rt, args.rows)
            for _ in range(3):
                runner.write()
            for victim, point in CASES:
                for method in METHODS:
                    key = (victim, point, method)
                    for _ in range(args.kills):
                        results.setdefault(key, []).append(
                            runner.kill_one(victim, point, method))
                        runner.write()  # a plain epoch between kills
                    report(key, results[key])
            epochs = runner.epoch
        check(root / "table", epochs, args.rows)
        every = [s for values in results.values() for s in values]
        print(f"all {len(every)} kills: p50 {statistics.median(every):.2f} s "
              f"(target < 3 s), max {max(every):.2f} s")
    finally:
        disarm_faults(NAME)
        ray.shutdown()
        shutil.rmtree(root, ignore_errors=True)


def report(key: tuple[str, str, str], values: list[float]) -> None:
    victim, point, method = key
    ordered = sorted(values)
    p90 = ordered[min(len(ordered) - 1, round(0.9 * (len(ordered) - 1)))]
    print(f"{victim:<11} {method:<8} at {point:<27} n={len(values):<3} "
          f"p50 {statistics.median(values):5.2f} s  p90 {p90:5.2f} s  max {max(values):5.2f} s",
          flush=True)


if __name__ == "__main__":
    main()
