"""``raysink demo``: order events streamed through Spark on Ray into a table, then checked.

What runs, in one process:

1. a local Ray (``ray.init(num_cpus=8)``, driver logs off) and a RayDP Spark session
   (``raysink.spark.init_spark``, 2 executors of 1 core);
2. a synthetic stream of order events — ``order_id`` (unique, the event id),
   ``event_time`` (UTC timestamps), ``customer_id``, ``amount`` (decimal(10,2)),
   ``status``, ``items`` — written as Parquet files into ``<workdir>/input``, one file per
   micro-batch, a couple of files ahead of the query;
3. a Structured Streaming query reading that directory (``maxFilesPerTrigger=1``) with
   ``foreachBatch`` into a ``SinkRuntime`` writing a Delta table (or Parquet directory)
   under ``<workdir>/table``; its checkpoint in ``<workdir>/checkpoint`` and the meta
   store in ``<workdir>/meta``;
4. a summary: rows, epochs, throughput, epoch latency p50/p99, where the table is, and
   the table read back (with ``deltalake`` or ``pyarrow``) against the generated ids.

The work directory is emptied at the start of each run; a non-empty directory that is not
a previous demo's is refused.
"""

from __future__ import annotations

import logging
import os
import shutil
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any, Literal, TextIO

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from raysink.errors import ConfigError, RaySinkError
from raysink.progress import Progress, format_rate

__all__ = ["DemoOptions", "DemoResult", "TableCheck", "check_ids", "order_batch", "run_demo"]

log = logging.getLogger(__name__)

RUNTIME_NAME = "demo-orders"
_MARKER = ".raysink-demo"
_STATUSES = ("created", "paid", "packed", "shipped", "delivered", "cancelled")
_STATUS_WEIGHTS = (0.30, 0.25, 0.15, 0.15, 0.10, 0.05)
_CUSTOMERS = 5_000
_START_TIME_US = 1_717_200_000_000_000  # 2024-06-01 00:00:00 UTC
_FILES_AHEAD = 2
_STREAM_TIMEOUT = 1_200.0

ORDER_SCHEMA = pa.schema([
    pa.field("order_id", pa.int64(), nullable=False),
    pa.field("event_time", pa.timestamp("us", tz="UTC"), nullable=False),
    pa.field("customer_id", pa.string(), nullable=False),
    pa.field("amount", pa.decimal128(10, 2), nullable=False),
    pa.field("status", pa.string(), nullable=False),
    pa.field("items", pa.int32(), nullable=False),
])
_SPARK_DDL = ("order_id BIGINT, event_time TIMESTAMP, customer_id STRING, "
              "amount DECIMAL(10,2), status STRING, items INT")


@dataclass(frozen=True, kw_only=True, slots=True)
class DemoOptions:
    """Sizes and places of one demo run."""

    events: int = 1_000_000
    batches: int = 8
    workdir: str = ".raysink/demo"
    sink: Literal["delta", "parquet"] = "delta"
    writers: int = 2
    executors: int = 2
    seed: int = 7

    def check(self) -> None:
        if self.events < self.batches:
            raise ConfigError(f"--events must be at least --batches ({self.batches}); "
                              f"got {self.events}")
        if self.sink not in ("delta", "parquet"):
            raise ConfigError(f"--sink must be 'delta' or 'parquet'; got {self.sink!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class TableCheck:
    """The table read back against the generated ids ``0 .. expected-1``."""

    expected: int
    rows: int
    missing: list[int]
    doubled: list[int]
    unexpected: list[int]
    amount_matches: bool

    @property
    def exact(self) -> bool:
        return not (self.missing or self.doubled or self.unexpected) and self.amount_matches

    def describe(self) -> str:
        if not (self.missing or self.doubled or self.unexpected):
            return "yes"
        parts = []
        for label, ids in (("missing", self.missing), ("doubled", self.doubled),
                           ("unexpected", self.unexpected)):
            if ids:
                parts.append(f"{len(ids):,} {label} (e.g. {', '.join(map(str, ids[:5]))})")
        return "NO: " + "; ".join(parts)


@dataclass(kw_only=True, slots=True)
class DemoResult:
    """What the run did; ``exact`` is the answer that matters."""

    rows: int = 0
    epochs: list[int] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    batch_seconds: list[float] = field(default_factory=list)
    seconds: float = 0.0
    table: str = ""
    metastore: str = ""
    check: TableCheck | None = None

    @property
    def exact(self) -> bool:
        return self.check is not None and self.check.exact


# ---------------------------------------------------------------------------- data


def order_batch(first_id: int, count: int, rng: np.random.Generator) -> pa.Table:
    """``count`` order events with ids ``first_id ..``; times rise about 50 ms apart."""
    ids = np.arange(first_id, first_id + count, dtype=np.int64)
    jitter = rng.integers(0, 40_000, size=count)
    times = _START_TIME_US + ids * 50_000 + jitter
    customers = rng.integers(0, _CUSTOMERS, size=count)
    cents = rng.lognormal(mean=8.0, sigma=0.9, size=count).astype(np.int64) + 99
    cents = np.minimum(cents, 99_999_999)
    statuses = rng.choice(len(_STATUSES), size=count, p=_STATUS_WEIGHTS)
    amounts = pa.array([Decimal(int(c)).scaleb(-2) for c in cents], pa.decimal128(10, 2))
    return pa.table({
        "order_id": pa.array(ids),
        "event_time": pa.array(times, pa.timestamp("us", tz="UTC")),
        "customer_id": pa.array([f"C-{c:05d}" for c in customers.tolist()]),
        "amount": amounts,
        "status": pa.array([_STATUSES[s] for s in statuses.tolist()]),
        "items": pa.array(rng.integers(1, 9, size=count, dtype=np.int32)),
    }, schema=ORDER_SCHEMA)


class OrderFeed:
    """Writes the stream's files into the input directory, one per micro-batch, each
    moved into place whole (written aside, then renamed)."""

    def __init__(self, workdir: Path, events: int, batches: int, seed: int) -> None:
        self.input = workdir / "input"
        self._aside = workdir / ".incoming"
        self._sizes = [len(part) for part in np.array_split(np.arange(events), batches)]
        self._rng = np.random.default_rng(seed)
        self._next_id = 0
        self.files = 0
        self.amount_total = Decimal(0)
        for directory in (self.input, self._aside):
            directory.mkdir(parents=True, exist_ok=True)

    @property
    def batches(self) -> int:
        return len(self._sizes)

    @property
    def done(self) -> bool:
        return self.files >= len(self._sizes)

    def write_next(self) -> None:
        count = self._sizes[self.files]
        table = order_batch(self._next_id, count, self._rng)
        self.amount_total += Decimal(str(pc.sum(table["amount"]).as_py()))
        name = f"orders-{self.files:05d}.parquet"
        pq.write_table(table, self._aside / name)
        os.replace(self._aside / name, self.input / name)
        self._next_id += count
        self.files += 1


# ---------------------------------------------------------------------------- check


def check_ids(ids: np.ndarray[Any, Any], expected: int, *, amount_matches: bool = True,
              limit: int = 20) -> TableCheck:
    """Compare the ids read back with ``0 .. expected-1``: missing, doubled, unexpected."""
    ids = np.asarray(ids, dtype=np.int64)
    inside = (ids >= 0) & (ids < expected)
    counts = np.bincount(ids[inside], minlength=expected)
    return TableCheck(
        expected=expected, rows=int(ids.size),
        missing=np.flatnonzero(counts == 0)[:limit].tolist(),
        doubled=np.flatnonzero(counts > 1)[:limit].tolist(),
        unexpected=np.unique(ids[~inside])[:limit].tolist(),
        amount_matches=amount_matches)


def read_back(table: Path, sink: str) -> pa.Table:
    """The table's ``order_id`` and ``amount`` columns, as a reader sees them."""
    columns = ["order_id", "amount"]
    if sink == "delta":
        from deltalake import DeltaTable

        # The files the Delta log references, read with pyarrow's own local filesystem:
        # delta-rs's Python filesystem hands out Python-owned buffers, which pyarrow's
        # read-ahead threads may still be releasing when the process exits (an abort in
        # interpreter shutdown, seen here).
        files = [uri.removeprefix("file://") for uri in DeltaTable(str(table)).file_uris()]
        parts = [pq.read_table(path, columns=columns) for path in files]
        empty = pa.schema([ORDER_SCHEMA.field(c) for c in columns]).empty_table()
        return pa.concat_tables(parts) if parts else empty
    import pyarrow.dataset as ds

    return ds.dataset(str(table), format="parquet").to_table(columns=columns)


def check_table(table: Path, sink: str, expected: int, amount_total: Decimal) -> TableCheck:
    data = read_back(table, sink)
    total = pc.sum(data["amount"]).as_py() if data.num_rows else Decimal(0)
    return check_ids(data["order_id"].to_numpy(), expected,
                     amount_matches=Decimal(str(total)) == amount_total)


# ---------------------------------------------------------------------------- run


def run_demo(options: DemoOptions, *, out: TextIO | None = None) -> DemoResult:
    """Run the demo end to end and print its summary to ``out`` (stdout by default)."""
    options.check()
    out = out if out is not None else sys.stdout
    workdir = prepare_workdir(Path(options.workdir))
    say = _sayer(out)
    result = DemoResult(table=str(workdir / "table"))
    started = time.monotonic()
    with _ray_and_spark(options, workdir, say) as spark:
        say(f"set-up took {time.monotonic() - started:.0f} s; streaming {options.events:,} "
            f"order events in {options.batches} micro-batches into a {options.sink} table")
        feed = OrderFeed(workdir, options.events, options.batches, options.seed)
        rt = _runtime(options, workdir)
        result.metastore = rt.metastore_url
        try:
            _stream(spark, rt, feed, workdir, options, result, out)
        finally:
            rt.close()
    result.check = check_table(workdir / "table", options.sink, options.events,
                               feed.amount_total)
    print_summary(result, options, out)
    return result


def prepare_workdir(workdir: Path) -> Path:
    """Make ``workdir`` empty for a run; refuse a non-empty directory not made by the demo."""
    workdir = workdir.absolute()
    if workdir.exists() and not workdir.is_dir():
        raise ConfigError(f"--workdir {workdir} is a file; give a directory")
    if workdir.is_dir() and any(workdir.iterdir()) and not (workdir / _MARKER).exists():
        raise ConfigError(f"--workdir {workdir} holds files the demo did not make; give an "
                          "empty or new directory")
    if workdir.is_dir():
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True)
    (workdir / _MARKER).write_text("made by `raysink demo`; emptied at each run\n")
    return workdir


def _sayer(out: TextIO) -> Callable[[str], None]:
    def say(text: str) -> None:
        print(f"raysink demo: {text}", file=out, flush=True)
    return say


@contextmanager
def _ray_and_spark(options: DemoOptions, workdir: Path,
                   say: Callable[[str], None]) -> Iterator[Any]:
    """A quiet local Ray and a RayDP session; both stopped on the way out.

    While they start, this process's file descriptors 1 and 2 point at
    ``<workdir>/logs/setup.log``: the Spark driver JVM, started then, inherits them and
    keeps writing its log there, and Ray's C++ start-up lines land there too.
    """
    import ray

    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    logs = workdir / "logs" / "setup.log"
    say(f"starting Ray (local, 8 logical CPUs) and Spark on Ray (RayDP, {options.executors} "
        f"executors); their start-up output goes to {logs}")
    with _output_to(logs):
        ray.init(num_cpus=8, log_to_driver=False, include_dashboard=False,
                 logging_level=logging.ERROR, configure_logging=True)
    try:
        from raysink.spark import init_spark, stop_spark

        with _output_to(logs):
            spark = init_spark("raysink-demo", executors=options.executors, executor_cores=1,
                               executor_memory="1g", configs=_quiet_spark_configs())
        try:
            spark.sparkContext.setLogLevel("ERROR")
            yield spark
        finally:
            with _output_to(logs):
                stop_spark()
    finally:
        with _output_to(logs):
            ray.shutdown()


@contextmanager
def _output_to(path: Path) -> Iterator[None]:
    """Point file descriptors 1 and 2 at ``path`` (appending) for the block; child
    processes started meanwhile keep writing there."""
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = (os.dup(1), os.dup(2))
    target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.dup2(target, 1)
        os.dup2(target, 2)
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (target, *saved):
            os.close(fd)


def _quiet_spark_configs() -> dict[str, str]:
    return {"spark.ui.showConsoleProgress": "false", "spark.ui.enabled": "false",
            "spark.sql.shuffle.partitions": "4",
            "spark.sql.streaming.forceDeleteTempCheckpointLocation": "true"}


def _runtime(options: DemoOptions, workdir: Path) -> Any:
    from raysink.runtime import SinkRuntime
    from raysink.sinks import DeltaSink, ParquetSink

    table = str(workdir / "table")
    sink = DeltaSink(table) if options.sink == "delta" else ParquetSink(table)
    metastore = f"sqlite:///{workdir / 'meta' / 'demo.db'}"
    return SinkRuntime(RUNTIME_NAME, sink, writers=options.writers,
                       metastore=metastore).start()


def _stream(spark: Any, rt: Any, feed: OrderFeed, workdir: Path, options: DemoOptions,
            result: DemoResult, out: TextIO) -> None:
    """Feed the files and run the query until every event is committed."""
    lock = threading.Lock()
    progress = Progress(total_rows=options.events, total_epochs=options.batches,
                        label="streaming", stream=out)

    def on_batch(df: Any, batch_id: int) -> None:
        begun = time.monotonic()
        report = rt.foreach_batch(df, batch_id)
        with lock:
            result.rows += report.rows
            result.epochs.append(report.epoch)
            result.latencies.append(report.seconds)
            result.batch_seconds.append(time.monotonic() - begun)
        progress.record(report)

    stream = (spark.readStream.schema(_SPARK_DDL).option("maxFilesPerTrigger", 1)
              .parquet(str(feed.input)))
    started = time.monotonic()
    for _ in range(_FILES_AHEAD):
        feed.write_next()
    progress.start()
    query = (stream.writeStream.foreachBatch(on_batch)
             .option("checkpointLocation", str(workdir / "checkpoint"))
             .queryName("raysink_demo_orders").start())
    try:
        with progress:
            _keep_feeding(query, feed, lambda: len(result.epochs))
            query.processAllAvailable()
    finally:
        query.stop()
    result.seconds = time.monotonic() - started


def _keep_feeding(query: Any, feed: OrderFeed, epochs_done: Callable[[], int]) -> None:
    """Write the next file whenever the query is within ``_FILES_AHEAD`` of the feed."""
    deadline = time.monotonic() + _STREAM_TIMEOUT
    while not feed.done:
        if not query.isActive:
            _raise_query_error(query)
        if feed.files - epochs_done() < _FILES_AHEAD:
            feed.write_next()
            continue
        if time.monotonic() > deadline:
            raise RaySinkError(f"the streaming query made no progress for "
                               f"{_STREAM_TIMEOUT:.0f} s; see `raysink status {RUNTIME_NAME}`")
        time.sleep(0.1)


def _raise_query_error(query: Any) -> None:
    error = query.exception()
    cause = str(error).strip().splitlines()[0] if error is not None else "stopped"
    raise RaySinkError(f"the streaming query ended before the feed did: {cause}")


# ---------------------------------------------------------------------------- summary


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile ``q`` (0-100) of ``values``."""
    ordered = sorted(values)
    rank = max(1, int(np.ceil(q / 100 * len(ordered))))
    return ordered[rank - 1]


def print_summary(result: DemoResult, options: DemoOptions, out: TextIO) -> None:
    """The person-readable summary of a run."""
    check = result.check
    rate = result.rows / result.seconds if result.seconds else 0.0
    epochs = f"{min(result.epochs)}-{max(result.epochs)}" if result.epochs else "none"
    lines = [
        "",
        "raysink demo summary",
        f"  rows written        {result.rows:,} order events",
        f"  epochs              {len(result.epochs)} (one per micro-batch; epochs {epochs})",
        f"  streaming time      {result.seconds:.1f} s (first file to last commit)",
        f"  throughput          {format_rate(rate)} end to end",
    ]
    if result.latencies:
        lines.append(
            f"  epoch latency       p50 {percentile(result.latencies, 50):.2f} s, "
            f"p99 {percentile(result.latencies, 99):.2f} s (write + two-phase commit, "
            f"n={len(result.latencies)}); whole micro-batch p50 "
            f"{statistics.median(result.batch_seconds):.2f} s")
    lines += [
        f"  {f'table ({options.sink})':<20}{result.table}",
        f"  meta store          {result.metastore}",
        f"  status              raysink status {RUNTIME_NAME} --metastore {result.metastore}",
    ]
    if check is not None:
        lines += [
            f"  read back           {check.rows:,} rows (expected {check.expected:,})",
            f"  every event id present exactly once: {check.describe()}",
            f"  amounts sum to the input's total: {'yes' if check.amount_matches else 'NO'}",
        ]
    print("\n".join(lines), file=out, flush=True)
