"""Sink-level benchmark of DeltaSink and IcebergSink (no Ray, no Spark yet).

For each sink: N writers (threads, standing in for writer actors) write their share of the
same Arrow data in batches and pre-commit, then one commit; compared with the library's own
one-shot write of the same table (``deltalake.write_deltalake`` / pyiceberg
``Table.append``). Then the overhead of committing an empty epoch (p50, p90).

    .venv/bin/python bench/sinks_delta_iceberg.py --rows 3000000 --writers 4 --repeat 3

Figures are wall seconds on this machine; the full runtime comparison (actors, RayDP
handoff) comes with the runtime.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from raysink.sinks.base import Manifest, Sink
from raysink.sinks.delta import DeltaSink
from raysink.sinks.iceberg import IcebergSink

BATCH_ROWS = 65_536


def make_data(rows: int) -> pa.Table:
    rng = np.random.default_rng(7)
    return pa.table({
        "id": pa.array(np.arange(rows, dtype=np.int64)),
        "k": pa.array(rng.integers(0, 1_000_000, rows, dtype=np.int64)),
        "x": pa.array(rng.random(rows)),
        "s": pa.array(np.char.add("s", (np.arange(rows) % 997).astype(str)).tolist(),
                      pa.string()),
    })


def write_share(sink: Sink, writer_id: int, share: pa.Table, epoch: int) -> Manifest:
    writer = sink.create_writer(writer_id)
    writer.open()
    for batch in share.to_batches(max_chunksize=BATCH_ROWS):
        writer.write(batch)
    manifest = writer.pre_commit(epoch, 1)
    writer.close()
    return manifest


def raysink_epoch(sink: Sink, data: pa.Table, writers: int, epoch: int) -> dict[str, float]:
    step = -(-data.num_rows // writers)
    shares = [data.slice(i * step, step) for i in range(writers)]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(writers) as pool:
        manifests = list(pool.map(lambda a: write_share(sink, a[0], a[1], epoch),
                                  enumerate(shares)))
    t1 = time.perf_counter()
    sink.commit(epoch, manifests)
    t2 = time.perf_counter()
    return {"write_precommit_s": t1 - t0, "commit_s": t2 - t1, "total_s": t2 - t0}


def empty_commits(sink: Sink, first_epoch: int, count: int) -> dict[str, float]:
    times = []
    for epoch in range(first_epoch, first_epoch + count):
        manifest = sink.create_writer(0).pre_commit(epoch, 1)
        t0 = time.perf_counter()
        sink.commit(epoch, [manifest])
        times.append(time.perf_counter() - t0)
    times.sort()
    return {"empty_commit_p50_ms": 1000 * statistics.median(times),
            "empty_commit_p90_ms": 1000 * times[int(0.9 * (len(times) - 1))]}


def timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench_delta(root: Path, data: pa.Table, writers: int, empties: int) -> dict[str, Any]:
    from deltalake import write_deltalake

    sink = DeltaSink(str(root / "raysink")).bind("bench", "delta")
    result: dict[str, Any] = {"sink": "delta", **raysink_epoch(sink, data, writers, 1)}
    result["baseline_write_deltalake_s"] = timed(
        lambda: write_deltalake(str(root / "baseline"), data))
    result.update(empty_commits(sink, 2, empties))
    return result


def bench_iceberg(root: Path, data: pa.Table, writers: int, empties: int) -> dict[str, Any]:
    from pyiceberg.catalog import load_catalog

    props = {"type": "sql", "uri": f"sqlite:///{root / 'catalog.db'}",
             "warehouse": f"file://{root / 'warehouse'}"}
    sink = IcebergSink("bench.raysink", catalog=props).bind("bench", "iceberg")
    result: dict[str, Any] = {"sink": "iceberg", **raysink_epoch(sink, data, writers, 1)}

    def baseline() -> None:
        catalog = load_catalog("raysink", **props)
        catalog.create_namespace_if_not_exists("bench")
        catalog.create_table("bench.baseline", schema=data.schema).append(data)

    result["baseline_table_append_s"] = timed(baseline)
    result.update(empty_commits(sink, 2, empties))
    return result


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=3_000_000)
    parser.add_argument("--writers", type=int, default=4)
    parser.add_argument("--empty-epochs", type=int, default=30)
    parser.add_argument("--sinks", default="delta,iceberg")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    import deltalake  # noqa: F401 - import costs stay out of the timings
    import pyiceberg.catalog.sql  # noqa: F401

    data = make_data(args.rows)
    print(json.dumps({"rows": args.rows, "writers": args.writers,
                      "arrow_mb": round(data.nbytes / 2**20, 1),
                      "cpus": os.cpu_count(), "load_1m": round(os.getloadavg()[0], 1)}))
    benches = {"delta": bench_delta, "iceberg": bench_iceberg}
    for name in args.sinks.split(","):
        runs = []
        for _ in range(args.repeat):  # each run on fresh tables; report the median
            with tempfile.TemporaryDirectory(prefix=f"raysink-bench-{name}-") as tmp:
                runs.append(benches[name](Path(tmp), data, args.writers, args.empty_epochs))
        result = {k: (statistics.median(r[k] for r in runs) if isinstance(v, float) else v)
                  for k, v in runs[0].items()}
        result["runs"] = len(runs)
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v
                          for k, v in result.items()}))


if __name__ == "__main__":
    main()
