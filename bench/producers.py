"""Benchmark: writing from many producers, side by side in one run (not a test).

Part 1, Ray Data: the same materialized Dataset (``--rows`` rows in ``--blocks`` blocks)
written with Ray's own ``ds.write_parquet`` (not idempotent) and with
``ds.write_datasink(rt.datasink())`` into a ``ParquetSink`` (exactly once). Reports rows/s
of each and the ratio raysink / Ray.

Part 2, parallel feeds: the same rows as ``--feeds`` Ray tasks each writing its slice
through ``ep.feed()``, against the driver writing the whole table with ``write_arrow``
(the data is in the object store for both: the tasks get a ref each, the driver reads the
table once). Reports rows/s and the ratio feeds / driver.

Rounds alternate the contestants; the median round counts.

    .venv/bin/python bench/producers.py [--rows 2000000] [--blocks 16] [--feeds 8]
                                        [--writers 2] [--rounds 3] [--cpus 8]
"""

from __future__ import annotations

import argparse
import functools
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import pyarrow as pa
import ray

from raysink import Feed, SinkRuntime
from raysink.sinks import ParquetSink


def make_table(rows: int) -> pa.Table:
    ids = np.arange(rows, dtype=np.int64)
    return pa.table({"id": ids, "customer": pa.array((ids % 1000).astype(str)),
                     "amount": ids.astype(np.float64) * 0.5})


@ray.remote
def produce(feed: Feed, table: pa.Table) -> int:
    with feed:
        step = 65_536
        for start in range(0, table.num_rows, step):
            feed.write(table.slice(start, step))
    return int(table.num_rows)


def timed(fn: Callable[[], Any]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def run(args: argparse.Namespace, root: Path) -> dict[str, list[float]]:
    table = make_table(args.rows)
    step = -(-args.rows // args.blocks)
    dataset = ray.data.from_arrow([table.slice(i, step) for i in range(0, args.rows, step)])
    dataset = dataset.materialize()
    fstep = -(-args.rows // args.feeds)
    slices = [ray.put(table.slice(i, fstep)) for i in range(0, args.rows, fstep)]
    times: dict[str, list[float]] = {k: [] for k in ("ray_parquet", "raysink_datasink",
                                                      "driver_write_arrow", "feeds")}
    rt = SinkRuntime("bench-producers", ParquetSink(str(root / "table")),
                     writers=args.writers, metastore=f"sqlite:///{root / 'meta.db'}",
                     progress=False)
    with rt:
        for round_no in range(args.rounds):
            times["ray_parquet"].append(timed(functools.partial(
                dataset.write_parquet, str(root / f"ray-{round_no}"))))

            def datasink() -> None:
                sink = rt.datasink()
                dataset.write_datasink(sink)
                assert sink.report is not None and sink.report.rows == args.rows

            times["raysink_datasink"].append(timed(datasink))

            def driver() -> None:
                assert rt.write_arrow(table).rows == args.rows

            times["driver_write_arrow"].append(timed(driver))

            def feeds() -> None:
                ep = rt.open_epoch()
                assert sum(ray.get([produce.remote(ep.feed(), s) for s in slices])) == args.rows
                assert ep.commit().rows == args.rows

            times["feeds"].append(timed(feeds))
            print(f"round {round_no + 1}: " + ", ".join(
                f"{k} {v[-1]:.2f}s" for k, v in times.items()), flush=True)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2_000_000)
    parser.add_argument("--blocks", type=int, default=16)
    parser.add_argument("--feeds", type=int, default=8)
    parser.add_argument("--writers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cpus", type=int, default=8)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="raysink-bench-producers-"))
    ray.init(address="local", num_cpus=args.cpus, include_dashboard=False, log_to_driver=False)
    try:
        times = run(args, root)
    finally:
        ray.shutdown()
        shutil.rmtree(root, ignore_errors=True)
    rate = {k: args.rows / statistics.median(v) for k, v in times.items()}
    print(f"\n{args.rows:,} rows, {args.writers} writers, median of {args.rounds} rounds")
    for name, value in rate.items():
        print(f"  {name:<20} {value / 1e6:6.2f} M rows/s")
    print(f"  datasink / write_parquet  {rate['raysink_datasink'] / rate['ray_parquet']:.2f}x")
    print(f"  {args.feeds} feeds / write_arrow    "
          f"{rate['feeds'] / rate['driver_write_arrow']:.2f}x")


if __name__ == "__main__":
    main()
