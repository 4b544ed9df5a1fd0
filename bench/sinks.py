"""Delta, Iceberg and PostgreSQL appends through ``SinkRuntime`` versus the library's own
single-process bulk write of the same Arrow data, in the same run (not a test).

    .venv/bin/python bench/sinks.py [--rows 1000000] [--rounds 3] [--empty 30] [--sinks ...]

The data is built once and put in the object store as 64 Ki-row tables. Per sink and per
round, alternating (library first in odd rounds, raysink first in even ones):

* raysink: one epoch ``write_arrow(refs)`` into a runtime with 2 writers (started once per
  sink, SQLite meta store), until the epoch is visible; its report must say every row;
* library: ``ray.get`` of the same refs in the driver, then ``write_deltalake(...,
  mode="append")`` (with zstd, DeltaSink's codec; its default is snappy), pyiceberg
  ``table.append(table)`` (zstd by default, as IcebergSink), or a plain ``COPY`` through
  psycopg (CSV rendered by pyarrow, the encoding the sink uses).

Each side appends to its own table; at the end both tables must hold every row written
(counted back from the target), or the run stops. Then the commit overhead of an empty epoch through
the runtime (``write_arrow([])``), p50 and p90. Targets: raysink/library >= 1.0x for Delta
and Iceberg, >= 0.8x for PostgreSQL, empty-epoch p50 < 100 ms. Ratios are printed, never
asserted. PostgreSQL runs on a throwaway server from ``tests/support/postgres.py``.

``--pin`` (Linux, 2 or more cores) separates the data work from Ray's own: the writer
actors run on the last core, and so does the driver while it does the library's write;
everything else (GCS, raylet, agents, the coordinator, idle workers, the driver while
raysink writes) runs on the other cores. Each side then encodes on one core, and the
writers do not compete with the raylet.
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from raysink import SinkRuntime
from raysink.sinks.base import Sink
from tests.support.postgres import PostgresServer

BATCH_ROWS = 65_536
SINKS = ("delta", "iceberg", "postgres")


def make_data(rows: int) -> pa.Table:
    """``rows`` rows: a unique id, a random key, a float and a short string."""
    rng = np.random.default_rng(7)
    labels = np.array([f"label-{i}" for i in range(997)], dtype=object)
    return pa.table({
        "id": pa.array(np.arange(rows, dtype=np.int64)),
        "k": pa.array(rng.integers(0, 1_000_000, rows, dtype=np.int64)),
        "x": pa.array(rng.random(rows)),
        "s": pa.array(labels[np.arange(rows) % 997], pa.string()),
    })


@dataclass(kw_only=True)
class Case:
    """One sink kind: the raysink sink and the library's own bulk append."""

    kind: str
    sink: Sink
    library: Callable[[pa.Table], None]
    count: Callable[[str], int]  # rows in the "raysink" or the "library" table
    raysink_s: list[float] = field(default_factory=list)
    library_s: list[float] = field(default_factory=list)


def delta_case(root: Path) -> Case:
    from deltalake import DeltaTable, WriterProperties, write_deltalake

    from raysink.sinks import DeltaSink

    target = str(root / "delta-library")
    # the same codec on both sides: DeltaSink's zstd (write_deltalake defaults to snappy)
    props = WriterProperties(compression="ZSTD")
    return Case(kind="delta", sink=DeltaSink(str(root / "delta-raysink")),
                library=lambda t: write_deltalake(target, t, mode="append",
                                                  writer_properties=props),
                count=lambda side: DeltaTable(str(root / f"delta-{side}")).to_pyarrow_dataset(
                ).count_rows())


def iceberg_case(root: Path) -> Case:
    from pyiceberg.catalog import load_catalog

    from raysink.sinks import IcebergSink
    from raysink.sinks.iceberg import default_catalog

    props = default_catalog(str(root))
    state: dict[str, Any] = {}

    def append(table: pa.Table) -> None:
        if "table" not in state:
            catalog = load_catalog("raysink", **props)
            catalog.create_namespace_if_not_exists("bench")
            state["table"] = catalog.create_table("bench.library", schema=table.schema)
        state["table"].append(table)

    def count(side: str) -> int:
        table = load_catalog("raysink", **props).load_table(f"bench.{side}")
        return int(table.scan().to_arrow().num_rows)

    return Case(kind="iceberg", sink=IcebergSink("bench.raysink", catalog=props),
                library=append, count=count)


def postgres_case(server: PostgresServer) -> Case:
    import psycopg
    import pyarrow.csv as pcsv

    from raysink.sinks import PostgresSink

    def copy(table: pa.Table) -> None:
        with psycopg.connect(server.dsn()) as conn:
            conn.execute("CREATE TABLE IF NOT EXISTS library_copy (id bigint, k bigint, "
                         "x double precision, s text)")
            buf = io.BytesIO()
            pcsv.write_csv(table, buf, write_options=pcsv.WriteOptions(include_header=False))
            with conn.cursor().copy("COPY library_copy FROM STDIN (FORMAT csv)") as cp:
                cp.write(buf.getvalue())
            conn.commit()

    def count(side: str) -> int:
        with psycopg.connect(server.dsn()) as conn:
            row = conn.execute(f"SELECT count(*) FROM {side}_copy").fetchone()
            return int(row[0]) if row else 0

    return Case(kind="postgres", sink=PostgresSink(server.dsn(), "raysink_copy"), library=copy,
                count=count)


class Pinning:
    """CPU affinity of this run's processes, every thread of each (``--pin``)."""

    def __init__(self, rt: SinkRuntime) -> None:
        import psutil

        cpus = list(range(os.cpu_count() or 1))
        if len(cpus) < 2:
            raise SystemExit("--pin needs at least 2 cores")
        self.data, self.ray = {cpus[-1]}, set(cpus[:-1])
        ours = psutil.Process().children(recursive=True)
        writers = {p.pid for p in rt.processes() if p.role == "writer"}
        for proc in ours:
            pin(proc.pid, self.data if proc.pid in writers else self.ray)
        print(f"pinned: {len(writers)} writers on CPU {sorted(self.data)}, "
              f"{len(ours) - len(writers)} Ray processes on CPU {sorted(self.ray)}",
              flush=True)

    def driver_does(self, side: str) -> None:
        pin(os.getpid(), self.data if side == "library" else self.ray)


def pin(pid: int, cpus: set[int]) -> None:
    """Every thread of ``pid`` on ``cpus`` (a thread's affinity is its own)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except (ProcessLookupError, FileNotFoundError):
            continue


def run_raysink(case: Case, rt: SinkRuntime, refs: list[Any], rows: int) -> None:
    started = time.perf_counter()
    report = rt.write_arrow(refs)
    case.raysink_s.append(time.perf_counter() - started)
    if not report.committed or report.skipped or report.rows != rows:
        raise SystemExit(f"{case.kind}: the epoch did not commit {rows} rows: {report}")


def run_library(case: Case, refs: list[Any]) -> None:
    import ray

    started = time.perf_counter()
    table = pa.concat_tables(ray.get(refs))
    case.library(table)
    case.library_s.append(time.perf_counter() - started)


def empty_epochs(rt: SinkRuntime, count: int) -> list[float]:
    times = []
    for _ in range(count):
        started = time.perf_counter()
        assert rt.write_arrow([]).committed
        times.append(time.perf_counter() - started)
    return times


def bench_case(case: Case, refs: list[Any], warm: list[Any], rows: int, args: Any,
               meta: str) -> None:
    import ray

    rt = SinkRuntime(f"bench-{case.kind}", case.sink, writers=2, metastore=meta,
                     progress=False)
    rt.start()
    try:
        rt.write_arrow(warm)  # warm-up: tables created, connections open
        case.library(pa.concat_tables(ray.get(warm)))
        pinning = Pinning(rt) if args.pin else None
        for round_no in range(args.rounds):
            library_first = round_no % 2 == 0
            for side in ("library", "raysink") if library_first else ("raysink", "library"):
                if pinning is not None:
                    pinning.driver_does(side)
                if side == "library":
                    run_library(case, refs)
                else:
                    run_raysink(case, rt, refs, rows)
            ratio = case.library_s[-1] / case.raysink_s[-1]
            print(f"{case.kind:8s} round {round_no + 1}: raysink {case.raysink_s[-1]:6.2f} s, "
                  f"library {case.library_s[-1]:6.2f} s, ratio {ratio:4.2f}x", flush=True)
        empty = empty_epochs(rt, args.empty)
    finally:
        rt.close()
    expected = sum(t.num_rows for t in ray.get(warm)) + args.rounds * rows
    counted = {side: case.count(side) for side in ("raysink", "library")}
    if set(counted.values()) != {expected}:
        raise SystemExit(f"{case.kind}: expected {expected} rows in each table, {counted}")
    med_r, med_l = statistics.median(case.raysink_s), statistics.median(case.library_s)
    q = statistics.quantiles(empty, n=10)
    print(f"{case.kind:8s} median: raysink {rows / med_r / 1e6:5.2f} M rows/s, library "
          f"{rows / med_l / 1e6:5.2f} M rows/s, ratio {med_l / med_r:4.2f}x; empty epoch "
          f"p50 {statistics.median(empty) * 1e3:5.1f} ms, p90 {q[8] * 1e3:5.1f} ms "
          f"({args.empty} epochs)", flush=True)


def main() -> None:
    import ray

    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--empty", type=int, default=30)
    parser.add_argument("--sinks", nargs="+", choices=SINKS, default=list(SINKS))
    parser.add_argument("--pin", action="store_true",
                        help="writers (and the library's write) on the last core, Ray's "
                             "processes on the others")
    args = parser.parse_args()
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    data = make_data(args.rows)
    refs = [ray.put(pa.Table.from_batches([b]))
            for b in data.to_batches(max_chunksize=BATCH_ROWS)]
    warm = [ray.put(data.slice(0, 1000))]
    print(f"{args.rows} rows in {len(refs)} tables in the object store; "
          f"{os.cpu_count()} cores", flush=True)
    server: PostgresServer | None = None
    with tempfile.TemporaryDirectory(prefix="raysink-bench-sinks-") as tmp:
        root = Path(tmp)
        try:
            for kind in args.sinks:
                if kind == "postgres":
                    server = PostgresServer()
                    server.start()
                    server.create_role("raysink", "bench-" + os.urandom(6).hex())
                    server.create_database("raysink", owner="raysink")
                    case = postgres_case(server)
                else:
                    case = delta_case(root) if kind == "delta" else iceberg_case(root)
                bench_case(case, refs, warm, args.rows, args, f"sqlite:///{root / 'meta.db'}")
        finally:
            if server is not None:
                server.cleanup()
            ray.shutdown()


if __name__ == "__main__":
    main()
