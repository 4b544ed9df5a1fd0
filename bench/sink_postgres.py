"""Benchmark PostgresSink's two commit methods against a plain COPY (not a test).

Run: ``.venv/bin/python bench/sink_postgres.py [--rows 1000000] [--epochs 200]``

Starts its own throwaway server through ``tests/support/postgres.py`` and reports:

* plain COPY: one process COPYs the Arrow data (rendered by pyarrow's CSV writer, the same
  encoding the sink uses) straight into a fresh table, one transaction;
* per method (``prepared``, ``staging``), append and upsert: 2 writers in 2 threads each
  ``write`` half the rows in 64 Ki-row batches and ``pre_commit``, then ``commit``; rows/s
  over the whole epoch and its ratio to plain COPY;
* the p50/p95 of ``commit`` for empty epochs (2 writers, no rows), with a warm connection.
"""

from __future__ import annotations

import argparse
import io
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
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
                 plain: float, epochs: int) -> None:
    table = f"bench_{method}_{'upsert' if key else 'append'}"
    sink = PostgresSink(server.dsn(), table, method=method, key=key).bind("bench", table)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--epochs", type=int, default=200)
    args = parser.parse_args()
    server = PostgresServer()
    try:
        server.start()
        server.create_role("raysink", "bench-secret")
        server.create_database("raysink", owner="raysink")
        data = make_data(args.rows)
        plain = min(plain_copy(server, data) for _ in range(2))
        print(f"plain COPY        : {plain:6.2f} s = {args.rows / plain / 1e6:5.2f} M rows/s "
              f"({args.rows:,} rows, 1 process)")
        for method in ("prepared", "staging"):
            for key in (None, ["id"]):
                bench_method(server, data, method, key, plain, args.epochs)
    finally:
        server.cleanup()


if __name__ == "__main__":
    main()
