"""Benchmark: one cached Spark DataFrame, raysink against RayDP's handoff and Spark's writer.

One DataFrame (default 5 M rows, 8 partitions: a long, a double, a string, an int) is
cached in Spark on Ray (RayDP, 2 executors x 1 core), then alternating rounds time:

* ``spark``       ``df.write.parquet``: Spark's own writer, in the executors;
* ``handoff``     RayDP's bare handoff: ``ray.data.from_spark(df)`` until every partition
                  is in the object store (nothing written), then released;
* ``raysink``     ``rt.write(df)`` into a ``ParquetSink`` with 2 writers: one exactly-once
                  epoch, committed (the runtime is started once, before the rounds);
* ``raysink-refs`` (``--with-refs``) ``rt.write(df)``'s path before the writers pulled
                  from the executors: a fetch task per partition, its table in the object
                  store, the ref handed to a writer;
* ``from_spark+tasks`` (``--with-tasks``) ``ray.data.from_spark(df)`` and one Ray task
                  per block writing it with ``pyarrow.parquet.write_table``: a Spark-on-Ray
                  user's write today, without exactly-once.

``--key k`` makes raysink's runtime keyed (rows routed by ``k``: one split task per
partition pulls and cuts it). Each round also prints the machine's busy CPU seconds
(``/proc/stat``, every process): on 2 cores every variant is bound by the CPUs.

Spark and raysink use the same compression (``--compression``, default snappy: Spark's
default). Each round prints seconds and rows/s; the end prints medians and the ratios
raysink / handoff (target >= 0.9) and raysink / spark (target >= 1.3).

``--phases``, after the rounds (the JIT warm), times the steps of raysink's handoff one
after the other in this process (Spark prepare = cache + count of the Arrow RDD; fetch of
every partition's IPC bytes from its executor; decode; Parquet write of the decoded tables
by one sink writer), wall and busy CPU seconds, and prints the CPU floor of raysink's path
(prepare + fetch + Parquet encoding) against Spark's write.
``--profile`` adds one more raysink epoch, timed phase by phase from the driver, with the
Ray timeline and, when ``py-spy`` is installed, a sampled profile of the writer actors
grouped by what they were doing.

    .venv/bin/python bench/spark_write.py [--rows 5000000] [--rounds 3] [--warmup 1] [--phases]
        [--profile] [--with-refs] [--with-tasks] [--key k]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("PYSPARK_PYTHON", sys.executable)

import pyarrow as pa
import pyarrow.parquet as pq
import ray

from raysink import SinkRuntime
from raysink.sinks import ParquetSink


@ray.remote(num_cpus=1)
def _write_block(table: pa.Table, path: str, compression: str) -> int:
    """One Ray task: one block to one Parquet file."""
    pq.write_table(table, path, compression=compression)
    return int(table.num_rows)


def build_frame(spark: Any, rows: int, partitions: int) -> Any:
    """The cached DataFrame every variant writes."""
    df = spark.range(0, rows, 1, partitions).selectExpr(
        "id",
        "id * 0.5 AS x",
        "concat('customer-', CAST(id % 100003 AS STRING)) AS s",
        "CAST(id % 97 AS INT) AS k",
    )
    df.cache()
    df.count()
    return df


class Bench:
    """The variants, sharing one output root and one started runtime."""

    def __init__(self, df: Any, root: Path, compression: str, writers: int,
                 key: list[str] | None = None) -> None:
        self.df = df
        self.root = root
        self.compression = compression
        self.rt = SinkRuntime(
            "bench-spark-write",
            ParquetSink(str(root / "raysink"), compression=compression),  # type: ignore[arg-type]
            writers=writers, key=key, metastore=f"sqlite:///{root / 'meta.db'}",
        ).start()

    def spark(self, round_no: int) -> int:
        target = self.root / f"spark-{round_no}"
        self.df.write.option("compression", self.compression).mode("overwrite").parquet(
            str(target))
        return -1

    def handoff(self, round_no: int) -> int:
        """RayDP's bare handoff: every partition in the object store, nothing written."""
        from raydp.spark.dataset import release_spark_recoverable

        dataset = ray.data.from_spark(self.df)
        refs = dataset.to_arrow_refs()
        ray.wait(refs, num_returns=len(refs), fetch_local=False)
        release_spark_recoverable(self.df)
        return -1

    def raysink_refs(self, round_no: int) -> int:
        """``rt.write(df)`` as it was before pulls: one fetch task per partition, its table
        in the object store, the ref handed to a writer as soon as it is ready."""
        from raysink.spark import SparkPartitions

        with SparkPartitions.open(self.df) as parts:
            ready = (ref for _, ref in parts.as_ready(window=2 * self.rt.writers))
            report = self.rt._write_refs(ready, None)
        if not report.committed:
            raise RuntimeError(f"raysink epoch not committed: {report}")
        return report.rows

    def from_spark_tasks(self, round_no: int) -> int:
        from raydp.spark.dataset import release_spark_recoverable

        target = self.root / f"from_spark-{round_no}"
        target.mkdir()
        dataset = ray.data.from_spark(self.df)
        refs = dataset.to_arrow_refs()
        done = [_write_block.remote(ref, str(target / f"part-{i:05d}.parquet"), self.compression)
                for i, ref in enumerate(refs)]
        rows = sum(ray.get(done))
        release_spark_recoverable(self.df)
        return rows

    def raysink(self, round_no: int) -> int:
        report = self.rt.write(self.df)
        if not report.committed:
            raise RuntimeError(f"raysink epoch not committed: {report}")
        return report.rows

    def close(self) -> None:
        self.rt.close()


# ---------------------------------------------------------------------------- profile

#: What a writer's sampled stack was doing, first match wins (matched on the frame text).
_CATEGORIES = (
    ("coordinator commit wait", ("_request_commit",)),
    ("executor pull: waiting for the IPC bytes", ("fetch_ipc", "getRDDPartition")),
    ("executor pull: decode", ("decode (", "open_stream", "read_all")),
    ("object fetch (ray.get of refs)", ("_fetch (", "get_objects", "ray.get")),
    ("parquet encode + file write", ("write_table", "ParquetWriter", "_write_buffer")),
    ("fsync / rename", ("fsync", "_stage_flushed", "_finish_file")),
    ("batch split / schema conform", ("to_batches", "_conform", "_as_table", "from_batches")),
    ("reorder / mailbox", ("mailbox", "_drain")),
)


class _PhaseClock:
    """Wraps driver-side steps of ``rt.write`` to time them (profile round only)."""

    def __init__(self) -> None:
        self.marks: dict[str, list[tuple[float, float]]] = collections.defaultdict(list)
        self._undo: list[Callable[[], None]] = []

    def wrap(self, owner: Any, name: str, label: str) -> None:
        original = owner.__dict__[name]
        func = original.__func__ if isinstance(original, classmethod) else original

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return func(*args, **kwargs)
            finally:
                self.marks[label].append((start, time.perf_counter()))

        setattr(owner, name, classmethod(timed) if isinstance(original, classmethod) else timed)
        self._undo.append(lambda: setattr(owner, name, original))

    def restore(self) -> None:
        for undo in reversed(self._undo):
            undo()


def _actor_pids(rt: SinkRuntime) -> dict[str, int]:
    """The coordinator's and each writer's pid (the runtime has one sink)."""
    return {(p.role if p.writer is None else f"writer-{p.writer}"): p.pid
            for p in rt.processes() if p.pid is not None and p.role != "standby"}


def _start_pyspy(pids: dict[str, int], out: Path) -> dict[str, tuple[Any, Path]]:
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(spy).exists():
        print("(py-spy not installed: no sampled profile of the actors)")
        return {}
    running = {}
    for name, pid in pids.items():
        path = out / f"pyspy-{name}.txt"
        proc = subprocess.Popen([spy, "record", "-p", str(pid), "-r", "200", "-f", "raw",
                                 "-o", str(path), "--nonblocking", "-d", "600"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        running[name] = (proc, path)
    time.sleep(1.0)  # let py-spy attach
    return running


def _stop_pyspy(running: dict[str, tuple[Any, Path]]) -> None:
    for proc, _ in running.values():
        proc.send_signal(signal.SIGINT)
    for proc, _ in running.values():
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def _categorise(path: Path, hz: int = 200) -> tuple[float, dict[str, float]]:
    """Seconds of active samples in a py-spy raw profile, by category."""
    if not path.exists():
        return 0.0, {}
    seconds: dict[str, float] = collections.defaultdict(float)
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        label = next((cat for cat, keys in _CATEGORIES if any(k in stack for k in keys)),
                     "other (" + stack.split(";")[-1][:60] + ")")
        seconds[label] += int(count) / hz
    return sum(seconds.values()), dict(seconds)


def _timeline(since: float, out: Path) -> dict[str, tuple[int, float, float]]:
    """Ray timeline events after ``since``: name -> (count, total s, max s)."""
    path = out / "timeline.json"
    ray.timeline(filename=str(path))
    stats: dict[str, list[float]] = collections.defaultdict(list)
    for event in json.loads(path.read_text()):
        if event.get("ph") != "X" or float(event.get("ts", 0)) < since * 1e6:
            continue
        name = str(event.get("name", "?"))
        if name.startswith("task::") or name.startswith("task:"):
            name = name.split("::", 1)[-1]
        stats[name].append(float(event.get("dur", 0)) / 1e6)
    return {n: (len(v), sum(v), max(v)) for n, v in stats.items()}


class _Stopwatch:
    """Wall seconds and the machine's busy CPU seconds of consecutive steps."""

    def __init__(self) -> None:
        self.steps: dict[str, tuple[float, float]] = {}
        self._mark = (time.perf_counter(), busy_cpu_seconds())

    def lap(self, label: str) -> None:
        now = (time.perf_counter(), busy_cpu_seconds())
        self.steps[label] = (now[0] - self._mark[0], now[1] - self._mark[1])
        self._mark = now

    def skip(self) -> None:
        """Leave out what ran since the last lap."""
        self._mark = (time.perf_counter(), busy_cpu_seconds())


#: The steps ``phases`` times; all but the decode are the floor of raysink's path.
PREPARE = "Spark prepare (toArrowBatchRdd, persist, count)"
FETCH = "fetch IPC bytes from the executors (serial)"
DECODE = "decode"
ENCODE = "Parquet write of every table by one sink writer"


def _phase_run(df: Any, root: Path, compression: str) -> tuple[_Stopwatch, dict[str, Any]]:
    """raysink's handoff step by step, one after the other in this process."""
    from raysink.sinks import ParquetSink
    from raysink.spark import SparkPartitions
    from raysink.spark.partitions import ExecutorPartition, decode

    watch = _Stopwatch()
    with SparkPartitions.open(df) as parts:
        watch.lap(PREPARE)
        items = [item for item in parts.pulls() if isinstance(item, ExecutorPartition)]
        fetched = [item.fetch_ipc() for item in items]
        watch.lap(FETCH)
        tables = [decode(ipc, parts.schema) for ipc in fetched]
        watch.lap(DECODE)
        first = pa.ipc.open_stream(pa.py_buffer(fetched[0])).read_all()
        facts = {"partitions": len(items), "ipc_bytes": sum(len(ipc) for ipc in fetched),
                 "batches": len(first.to_batches()),
                 "casts": not first.replace_schema_metadata().schema.equals(parts.schema)}
    sink = ParquetSink(str(root / "phases"), compression=compression)  # type: ignore[arg-type]
    writer = sink.bind("bench-phases", "main").create_writer(0)
    writer.open()
    watch.skip()
    for table in tables:
        for batch in table.to_batches():
            writer.write(batch)
    writer.flush()
    watch.lap(ENCODE)
    writer.close()
    shutil.rmtree(root / "phases", ignore_errors=True)
    return watch, facts


def phases(df: Any, rows: int, root: Path, compression: str) -> dict[str, float]:
    """Times raysink's handoff step by step (a warm-up run, then the one reported) and
    returns each step's busy CPU seconds."""
    _phase_run(df, root, compression)  # JIT and first-use costs
    watch, facts = _phase_run(df, root, compression)
    print(f"\nphases of raysink's handoff, one after the other ({rows:,} rows, "
          f"{facts['partitions']} partitions, {facts['ipc_bytes'] / 2**20:.0f} MiB of Arrow "
          f"IPC, {facts['batches']} batches per partition, schema cast: "
          f"{'YES' if facts['casts'] else 'no'}); the second of two runs:")
    for label, (seconds, cpu) in watch.steps.items():
        print(f"  {label:<50} {seconds:6.2f} s  {rate(rows, seconds)}  "
              f"{cpu:5.2f} CPU-s ({cpu / seconds:.1f} of {os.cpu_count()} cores)")
    return {label: cpu for label, (_, cpu) in watch.steps.items()}


def profile_raysink_epoch(rt: Any, df: Any, rows: int, out: Path) -> None:
    """One more ``rt.write(df)``, with phase timings, the Ray timeline and py-spy."""
    from raysink.driver.epoch import EpochDriver
    from raysink.spark.handoff import SparkPartitions

    clock = _PhaseClock()
    clock.wrap(SparkPartitions, "open", "spark prepare (JVM toArrowBatchRdd, cache, count)")
    clock.wrap(EpochDriver, "_open_epoch", "open epoch at the coordinator (first epoch only)")
    clock.wrap(EpochDriver, "_feed_and_commit",
               "feed writers + barriers + decision and sink commits")
    spies = _start_pyspy(_actor_pids(rt), out)
    wall_start = time.time()
    start = time.perf_counter()
    try:
        report = rt.write(df)
    finally:
        total = time.perf_counter() - start
        _stop_pyspy(spies)
        clock.restore()
    print(f"\nprofile: one raysink epoch of {report.rows:,} rows, {total:.2f} s "
          f"({rows / total / 1e6:.2f} M rows/s; EpochReport.seconds {report.seconds:.2f})")
    for label, spans in clock.marks.items():
        for begin, end in spans:
            print(f"  {label:<52} {begin - start:6.2f} -> {end - start:6.2f} s  "
                  f"({end - begin:.2f} s)")
    print("  Ray timeline (count, total s, longest s):")
    for name, (count, seconds, longest) in sorted(_timeline(wall_start, out).items(),
                                                  key=lambda kv: -kv[1][1])[:12]:
        print(f"    {name[:60]:<60} {count:4d} {seconds:7.2f} {longest:6.2f}")
    for name, (_, path) in spies.items():
        active, cats = _categorise(path)
        print(f"  py-spy {name}: {active:.2f} s active (of {total:.2f} s)")
        for label, seconds in sorted(cats.items(), key=lambda kv: -kv[1])[:8]:
            print(f"    {label[:70]:<70} {seconds:6.2f} s")


def busy_cpu_seconds() -> float:
    """CPU seconds the whole machine spent busy so far (``/proc/stat``; 0 elsewhere): the
    difference over a round says whether it was bound by the cores."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    except OSError:
        return 0.0
    ticks = [int(f) for f in fields]
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)
    return (sum(ticks) - idle) / os.sysconf("SC_CLK_TCK")


def rate(rows: int, seconds: float) -> str:
    return f"{rows / seconds / 1e6:.2f} M rows/s"


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rows", type=int, default=5_000_000)
    parser.add_argument("--partitions", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1,
                        help="rounds run first and not counted (JIT, worker start-up)")
    parser.add_argument("--writers", type=int, default=2)
    parser.add_argument("--key", default=None,
                        help="route raysink's rows by this column (a keyed runtime; e.g. k)")
    parser.add_argument("--compression", default="snappy",
                        choices=["snappy", "zstd", "lz4", "gzip", "none"])
    parser.add_argument("--profile", action="store_true",
                        help="after the rounds, profile one more raysink epoch")
    parser.add_argument("--phases", action="store_true",
                        help="after the rounds, time the handoff's steps one by one")
    parser.add_argument("--with-tasks", action="store_true",
                        help="also time from_spark + Ray tasks writing Parquet")
    parser.add_argument("--with-refs", action="store_true",
                        help="also time rt.write through fetch tasks and object refs (the "
                             "handoff before writers pulled from the executors)")
    parser.add_argument("--dir", default=None, help="output root (default: a temp dir)")
    parser.add_argument("--conf", action="append", default=[], metavar="KEY=VALUE",
                        help="an extra Spark setting (repeatable)")
    args = parser.parse_args()
    extra = dict(item.split("=", 1) for item in args.conf)

    from raysink.spark import init_spark, stop_spark

    root = Path(args.dir or tempfile.mkdtemp(prefix="raysink-bench-write-"))
    root.mkdir(parents=True, exist_ok=True)
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    configs = {"spark.ui.showConsoleProgress": "false", **extra}
    spark = init_spark("raysink-bench-write", executors=2, executor_cores=1,
                       executor_memory="2g", configs=configs)
    bench: Bench | None = None
    try:
        spark.sparkContext.setLogLevel("ERROR")
        started = time.perf_counter()
        df = build_frame(spark, args.rows, args.partitions)
        print(f"cached {args.rows:,} rows in {args.partitions} partitions "
              f"({time.perf_counter() - started:.1f} s); output under {root}")
        bench = Bench(df, root, args.compression, args.writers,
                      key=[args.key] if args.key else None)
        variants: dict[str, Callable[[int], int]] = {
            "spark": bench.spark, "handoff": bench.handoff, "raysink": bench.raysink}
        if args.with_tasks:
            variants["from_spark+tasks"] = bench.from_spark_tasks
        if args.with_refs:
            variants["raysink-refs"] = bench.raysink_refs
        times: dict[str, list[float]] = {name: [] for name in variants}
        cpus: dict[str, list[float]] = {name: [] for name in variants}
        for round_no in range(args.warmup + args.rounds):
            order = list(variants)
            if round_no % 2:
                order.reverse()  # alternate which variant runs first
            warmup = round_no < args.warmup
            for name in order:
                cpu = busy_cpu_seconds()
                start = time.perf_counter()
                rows = variants[name](round_no)
                seconds = time.perf_counter() - start
                cpu = busy_cpu_seconds() - cpu
                if not warmup:
                    times[name].append(seconds)
                    cpus[name].append(cpu)
                if rows not in (-1, args.rows):
                    raise RuntimeError(f"{name} wrote {rows} rows, expected {args.rows}")
                print(f"{'warm-up' if warmup else 'round'} {round_no} {name:>16}: "
                      f"{seconds:6.2f} s  {rate(args.rows, seconds)}  machine busy "
                      f"{cpu:5.2f} CPU-s ({cpu / seconds:.1f} of {os.cpu_count()} cores)",
                      flush=True)
        summarise(times, args.rows)
        if args.phases:  # after the rounds: the JVMs' JIT is warm by then
            cpu_floor(cpus, phases(df, args.rows, root, args.compression))
        if args.profile:
            profile_raysink_epoch(bench.rt, df, args.rows, root)
    finally:
        if bench is not None:
            bench.close()
        stop_spark()
        ray.shutdown()
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)


def summarise(times: dict[str, list[float]], rows: int) -> None:
    """Medians per variant, then raysink's ratios: of the medians, and the median of the
    per-round ratios (each round runs the variants back to back)."""
    median = {name: statistics.median(values) for name, values in times.items()}
    print()
    for name, seconds in median.items():
        print(f"{name:>16}: median {seconds:6.2f} s  {rate(rows, seconds)} "
              f"(best {rate(rows, min(times[name]))})")
    targets = {"handoff": ">= 0.9", "spark": ">= 1.3", "from_spark+tasks": "",
               "raysink-refs": ""}
    for other, target in targets.items():
        if other not in times:
            continue
        per_round = [o / r for o, r in zip(times[other], times["raysink"], strict=True)]
        print(f"raysink / {other + ':':<17} {median[other] / median['raysink']:.2f}x of medians, "
              f"{statistics.median(per_round):.2f}x median per round"
              + (f" (target {target})" if target else ""))


def cpu_floor(cpus: dict[str, list[float]], phase_cpu: dict[str, float]) -> None:
    """What 1.3x Spark asks of raysink's CPU when every variant keeps the cores busy: the
    steps raysink cannot leave out (RayDP's prepare in the executors' JVMs, the fetch of
    the Arrow bytes out of them, Parquet encoding of every row) against Spark's write."""
    median = {name: statistics.median(values) for name, values in cpus.items()}
    steps = {"prepare": PREPARE, "fetch": FETCH, "Parquet encoding": ENCODE}
    floor = sum(phase_cpu[label] for label in steps.values())
    print("\nbusy CPU per round (median): "
          + ", ".join(f"{name} {cpu:.2f} CPU-s" for name, cpu in median.items()))
    print("floor of raysink's path: "
          + " + ".join(f"{short} {phase_cpu[label]:.2f}" for short, label in steps.items())
          + f" = {floor:.2f} CPU-s (fsyncs, Ray messages and the commit come on top)")
    print(f"1.3x Spark on busy cores needs raysink <= {median['spark'] / 1.3:.2f} CPU-s; "
          f"at the floor alone raysink / spark would be {median['spark'] / floor:.2f}x")


if __name__ == "__main__":
    main()
