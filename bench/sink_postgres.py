"""Benchmark PostgresSink's two commit methods against a plain COPY (not a test).

Run: ``.venv/bin/python bench/sink_postgres.py [--rows 1000000] [--epochs 200]``
(``--upsert-only`` for the upsert comparison alone, ``--runtime`` to add it through
``SinkRuntime``, ``--rounds N`` for its rounds, ``--add-columns`` to run each method also
with ``schema_evolution="add_columns"``, whose rows go through each writer's own stage)

Starts its own throwaway server through ``tests/support/postgres.py`` and reports:

* plain COPY: one process COPYs the Arrow data (rendered by pyarrow's CSV writer, the same
  encoding the sink uses) straight into a fresh table, one transaction;
* per method (``prepared``, ``staging``), append and upsert: 2 writers in 2 threads each
  ``write`` half the rows in 64 Ki-row batches and ``pre_commit``, then ``commit``; rows/s
  over the whole epoch and its ratio to plain COPY;
* the p50/p95 of ``commit`` for empty epochs (2 writers, no rows), with a warm connection;
* upserts of ``--rows`` rows into a table already holding half of their keys (half new
  keys, half existing), alternating rounds of: ``single``, one process COPYing into a
  temporary table and running ``INSERT … SELECT … ON CONFLICT DO UPDATE`` from it;
  ``prepared``, ``PostgresSink(key=["id"])`` with 2 writers in threads, rows routed by
  raysink's vnode hash as a runtime routes them, whole epoch (write, pre-commit, commit);
  and with ``--runtime`` ``rt.write_arrow`` of the same table through a started
  ``SinkRuntime`` (2 writer actors). Each prints seconds, rows/s, the PostgreSQL server's
  CPU seconds (all its processes, from ``/proc``) and the machine's busy CPU seconds;
  the end prints medians, ratios to ``single`` and the target (0.5 M rows/s).
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute
import pyarrow.csv as pcsv

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from raysink.sinks.base import Manifest
from raysink.sinks.postgres import PostgresSink
from tests.support.postgres import PostgresServer

BATCH = 65_536


def make_data(rows: int) -> pa.Table:
    """``rows`` rows: a unique id, a float, a short string and a bool."""
    rng = np.random.default_rng(7)
    names = np.array([f"name-{i}" for i in range(1000)], dtype=object)
    return pa.table({
        "id": pa.array(np.arange(rows, dtype=np.int64)),
        "value": pa.array(rng.random(rows)),
        "label": pa.array(names[rng.integers(0, 1000, rows)], pa.string()),
        "flag": pa.array(rng.random(rows) > 0.5),
    })


def plain_copy(server: PostgresServer, data: pa.Table) -> float:
    """Seconds for a single-process COPY of ``data`` into a fresh table."""
    import psycopg

    with psycopg.connect(server.dsn()) as conn:
        conn.execute("DROP TABLE IF EXISTS plain_copy")
        conn.execute("CREATE TABLE plain_copy (id bigint, value double precision, label text, "
                     "flag boolean)")
        conn.commit()
        started = time.perf_counter()
        buf = io.BytesIO()
        pcsv.write_csv(data, buf, write_options=pcsv.WriteOptions(include_header=False))
        with conn.cursor().copy("COPY plain_copy FROM STDIN (FORMAT csv)") as copy:
            copy.write(buf.getvalue())
        conn.commit()
        return time.perf_counter() - started


def run_writer(sink: PostgresSink, writer_id: int, part: pa.Table, epoch: int,
               out: dict[int, Manifest]) -> None:
    writer = sink.create_writer(writer_id)
    writer.open()
    for batch in part.to_batches(max_chunksize=BATCH):
        writer.write(batch)
    out[writer_id] = writer.pre_commit(epoch, 0)
    writer.close()


def sink_epoch(sink: PostgresSink, data: pa.Table, epoch: int) -> tuple[float, float]:
    """Seconds for 2 parallel writers' write+pre_commit, then for the commit."""
    half = data.num_rows // 2
    parts = [data.slice(0, half), data.slice(half)]
    manifests: dict[int, Manifest] = {}
    started = time.perf_counter()
    threads = [threading.Thread(target=run_writer, args=(sink, k, p, epoch, manifests))
               for k, p in enumerate(parts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    staged = time.perf_counter()
    sink.commit(epoch, [manifests[k] for k in sorted(manifests)])
    return staged - started, time.perf_counter() - staged


def empty_commits(sink: PostgresSink, epochs: int) -> list[float]:
    """Commit seconds of ``epochs`` empty epochs (2 writers with no rows)."""
    writers = [sink.create_writer(k) for k in range(2)]
    for w in writers:
        w.open()
    times = []
    for epoch in range(1, epochs + 1):
        manifests = [w.pre_commit(epoch, 0) for w in writers]
        started = time.perf_counter()
        sink.commit(epoch, manifests)
        times.append(time.perf_counter() - started)
    for w in writers:
        w.close()
    return times


def bench_method(server: PostgresServer, data: pa.Table, method: Any, key: list[str] | None,
                 plain: float, epochs: int, evolution: Any = "fail") -> None:
    table = f"bench_{method}_{'upsert' if key else 'append'}_{evolution}"
    sink = PostgresSink(server.dsn(), table, method=method, key=key,
                        schema_evolution=evolution).bind("bench", table)
    if evolution != "fail":
        method = f"{method}+{evolution}"
    sink_epoch(sink, data.slice(0, 1000), 1)  # warm up: tables created, connection cached
    write_s, commit_s = sink_epoch(sink, data, 2)
    total = write_s + commit_s
    print(f"{method:9s} {'upsert' if key else 'append':6s}: write+pre_commit {write_s:6.2f} s, "
          f"commit {commit_s:6.3f} s, total {total:6.2f} s = {data.num_rows / total / 1e6:5.2f}"
          f" M rows/s = {plain / total:4.2f}x plain COPY")
    if key is None:
        times = empty_commits(sink.bind("bench-empty", table), epochs)
        q = statistics.quantiles(times, n=20)
        print(f"{method:9s} empty-epoch commit: p50 {statistics.median(times) * 1e3:.2f} ms, "
              f"p95 {q[18] * 1e3:.2f} ms over {epochs} epochs")
    sink.close()


# ---------------------------------------------------------------------------- upserts

UPSERT_TABLE = "bench_upsert"
_COLUMNS = "id bigint PRIMARY KEY, value double precision, label text, flag boolean"


def upsert_data(rows: int) -> pa.Table:
    """``rows`` rows whose ids are a permutation of ``0 .. rows-1``; the table starts with
    the lower half of them, so half the rows update and half insert."""
    table = make_data(rows)
    order = np.random.default_rng(11).permutation(rows)
    return table.set_column(0, "id", pa.array(order.astype(np.int64)))


def reset_upsert_table(server: PostgresServer, rows: int) -> None:
    import psycopg

    with psycopg.connect(server.dsn(), autocommit=True) as conn:
        conn.execute(f"DROP TABLE IF EXISTS {UPSERT_TABLE}")
        conn.execute(f"CREATE TABLE {UPSERT_TABLE} ({_COLUMNS})")
        conn.execute(f"INSERT INTO {UPSERT_TABLE} SELECT g, 0.0, 'old', false "
                     f"FROM generate_series(0, {rows // 2 - 1}) g")
        conn.execute(f"VACUUM ANALYZE {UPSERT_TABLE}")


def single_upsert(server: PostgresServer, data: pa.Table) -> None:
    """One process: COPY into a temporary table, then one INSERT ... ON CONFLICT."""
    import psycopg

    with psycopg.connect(server.dsn()) as conn:
        conn.execute("CREATE TEMP TABLE staged (id bigint, value double precision, "
                     "label text, flag boolean) ON COMMIT DROP")
        buf = io.BytesIO()
        pcsv.write_csv(data, buf, write_options=pcsv.WriteOptions(include_header=False))
        with conn.cursor().copy("COPY staged FROM STDIN (FORMAT csv)") as copy:
            copy.write(buf.getvalue())
        conn.execute(f"INSERT INTO {UPSERT_TABLE} SELECT * FROM staged ON CONFLICT (id) DO "
                     "UPDATE SET value = EXCLUDED.value, label = EXCLUDED.label, "
                     "flag = EXCLUDED.flag")
        conn.commit()


def routed(data: pa.Table, writers: int) -> list[pa.Table]:
    """The rows each writer of a runtime keyed by ``id`` receives (raysink's vnodes)."""
    from raysink.protocol.vnodes import assign, split_by_writer

    pieces = split_by_writer(data, ["id"], assign(writers))
    return [pa.Table.from_batches([p]) if isinstance(p, pa.RecordBatch) else p
            for p in pieces]


def sink_upsert(server: PostgresServer, parts: list[pa.Table], epoch: int) -> None:
    sink = PostgresSink(server.dsn(), UPSERT_TABLE, key=["id"]).bind("bench-up", "main")
    manifests: dict[int, Manifest] = {}
    threads = [threading.Thread(target=run_writer, args=(sink, k, p, epoch, manifests))
               for k, p in enumerate(parts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    sink.commit(epoch, [manifests[k] for k in sorted(manifests)])
    sink.close()


def server_cpu_seconds(server: PostgresServer) -> float:
    """CPU seconds used so far by every process of the server (postmaster and children,
    exited backends included through the postmaster's children counters)."""
    pid_file = server.data_dir / "postmaster.pid"
    try:
        postmaster = int(pid_file.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0.0
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        pid, ppid = int(entry.name), int(fields[1])
        if pid == postmaster:
            total += (int(fields[11]) + int(fields[12]) + int(fields[13]) + int(fields[14]))
        elif ppid == postmaster:
            total += int(fields[11]) + int(fields[12])
    return total / tick


def busy_cpu_seconds() -> float:
    """CPU seconds the whole machine spent busy so far (``/proc/stat``)."""
    try:
        ticks = [int(f) for f in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    except OSError:
        return 0.0
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def bench_upserts(server: PostgresServer, rows: int, rounds: int, runtime: bool) -> None:
    data = upsert_data(rows)
    parts = routed(data, 2)
    variants: dict[str, Any] = {
        "single": lambda epoch: single_upsert(server, data),
        "prepared": lambda epoch: sink_upsert(server, parts, epoch),
    }
    rt = _start_runtime(server) if runtime else None
    if rt is not None:
        variants["runtime"] = lambda epoch: rt.write_arrow(data)
    print(f"\nupsert {rows:,} rows, half new keys, half existing (target 0.5 M rows/s):")
    times: dict[str, list[float]] = {name: [] for name in variants}
    epoch = 100
    try:
        for round_no in range(rounds):
            order = list(variants) if round_no % 2 == 0 else list(reversed(variants))
            for name in order:
                reset_upsert_table(server, rows)
                epoch += 1
                cpu, busy = server_cpu_seconds(server), busy_cpu_seconds()
                started = time.perf_counter()
                variants[name](epoch)
                seconds = time.perf_counter() - started
                cpu, busy = server_cpu_seconds(server) - cpu, busy_cpu_seconds() - busy
                check_upserted(server, data)
                times[name].append(seconds)
                print(f"  round {round_no} {name:>8}: {seconds:6.2f} s = "
                      f"{rows / seconds / 1e6:5.2f} M rows/s; server {cpu:5.2f} CPU-s "
                      f"({cpu / rows * 1e6:.1f} us/row), machine busy {busy:5.2f} CPU-s",
                      flush=True)
    finally:
        if rt is not None:
            rt.close()
    median = {name: statistics.median(v) for name, v in times.items()}
    for name, seconds in median.items():
        ratio = median["single"] / seconds
        print(f"  {name:>8}: median {seconds:6.2f} s = {rows / seconds / 1e6:5.2f} M rows/s"
              f" = {ratio:4.2f}x single")


def check_upserted(server: PostgresServer, data: pa.Table) -> None:
    """Every key of ``data`` holds its value and nothing else is there."""
    import psycopg

    with psycopg.connect(server.dsn()) as conn:
        count, total = conn.execute(
            f"SELECT count(*), sum(value) FROM {UPSERT_TABLE}").fetchone() or (0, 0.0)
    expected = float(pa.compute.sum(data.column("value")).as_py())
    if count != data.num_rows or abs(float(total) - expected) > 1e-6 * data.num_rows:
        raise RuntimeError(f"upsert left {count} rows (sum {total}), expected "
                           f"{data.num_rows} (sum {expected})")


def _start_runtime(server: PostgresServer) -> Any:
    import ray

    from raysink import SinkRuntime

    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    meta = tempfile.mkdtemp(prefix="raysink-bench-pg-")
    sink = PostgresSink(server.dsn(), UPSERT_TABLE, key=["id"])
    return SinkRuntime("bench-pg-upsert", sink, writers=2, progress=False,
                       metastore=f"sqlite:///{meta}/meta.db").start()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--epochs", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the upsert comparison")
    parser.add_argument("--upsert-only", action="store_true",
                        help="only the upsert comparison (half new keys, half existing)")
    parser.add_argument("--runtime", action="store_true",
                        help="add the upsert through SinkRuntime (starts Ray)")
    parser.add_argument("--add-columns", action="store_true",
                        help="each method also with schema_evolution='add_columns'")
    args = parser.parse_args()
    server = PostgresServer()
    try:
        server.start()
        server.create_role("raysink", "bench-secret")
        server.create_database("raysink", owner="raysink")
        if not args.upsert_only:
            data = make_data(args.rows)
            plain = min(plain_copy(server, data) for _ in range(2))
            print(f"plain COPY        : {plain:6.2f} s = {args.rows / plain / 1e6:5.2f} M "
                  f"rows/s ({args.rows:,} rows, 1 process)")
            evolutions = ("fail", "add_columns") if args.add_columns else ("fail",)
            for method in ("prepared", "staging"):
                for key in (None, ["id"]):
                    for evolution in evolutions:
                        bench_method(server, data, method, key, plain, args.epochs,
                                     evolution)
        bench_upserts(server, args.rows, args.rounds, args.runtime)
    finally:
        server.cleanup()


if __name__ == "__main__":
    main()
