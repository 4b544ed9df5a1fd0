"""Benchmark: partitioned Iceberg writes (not a test).

Part 1, the transforms: each of ``bucket[16]`` of a long, ``day`` and ``hour`` of a
timestamp, ``truncate[4]`` of a string and ``bucket[16]`` of a string over ``--rows``
values, computed by raysink's Arrow transforms (``raysink.sinks.iceberg._transforms``)
and, side by side, by pyiceberg's per-value ``transform`` (what a writer without
``pyiceberg-core`` would call per row); the ratio.

Part 2, an epoch: one ``IcebergSinkWriter`` writes ``--rows`` rows (batches of 10,000)
and pre-commits them to a local table, and the sink commits the epoch, unpartitioned and
then partitioned by ``day(ts), bucket[16](id)`` (the rows span two days: 48 files),
``--repeat`` times each, alternating; the median of each and the ratio.

    .venv/bin/python bench/iceberg_partition.py [--rows 1000000] [--repeat 3]
        [--only transforms|epochs]
"""

from __future__ import annotations

import argparse
import datetime as dt
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa


def _timed(fn: Callable[[], Any]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def _columns(rows: int) -> dict[str, pa.Array]:
    base = dt.datetime(2024, 1, 1, 12, tzinfo=dt.timezone.utc)
    step = 2 * 86_400_000_000 // rows  # the epoch's rows span two days (three dates)
    return {
        "id": pa.array(range(rows), pa.int64()),
        "ts": pa.array([base + dt.timedelta(microseconds=step * i) for i in range(rows)],
                       pa.timestamp("us", "UTC")),
        "name": pa.array([f"customer-{i % 9973}" for i in range(rows)]),
    }


def transforms(rows: int) -> None:
    from pyiceberg.transforms import parse_transform
    from pyiceberg.types import LongType, StringType, TimestamptzType

    from raysink.sinks.iceberg._transforms import apply_transform

    cols = _columns(rows)
    types = {"id": LongType(), "ts": TimestamptzType(), "name": StringType()}
    internal = {"id": cols["id"].to_pylist(),
                "ts": cols["ts"].cast(pa.int64()).to_pylist(),
                "name": cols["name"].to_pylist()}
    print(f"transforms over {rows:,} values: raysink (Arrow) vs pyiceberg per value")
    for column, transform in (("id", "bucket[16]"), ("ts", "day"), ("ts", "hour"),
                              ("name", "truncate[4]"), ("name", "bucket[16]")):
        ours = _timed(lambda c=column, t=transform: apply_transform(t, cols[c]))
        fn = parse_transform(transform).transform(types[column])
        theirs = _timed(lambda c=column, f=fn: [f(v) for v in internal[c]])
        print(f"  {transform}({column}): {ours * 1e3:8.1f} ms vs {theirs * 1e3:8.1f} ms "
              f"({theirs / ours:5.1f}x)")


def _epoch(root: Path, rows: int, partition_by: Any, epoch: int) -> tuple[float, float, int]:
    from raysink.sinks.iceberg import IcebergSink

    props = {"type": "sql", "uri": f"sqlite:///{root / 'catalog.db'}",
             "warehouse": f"file://{root / 'warehouse'}"}
    sink = IcebergSink("ns.t", catalog=props, partition_by=partition_by).bind("bench", "main")
    table = pa.table(_columns(rows))
    writer = sink.create_writer(0)
    writer.open()
    started = time.perf_counter()
    for batch in table.to_batches(max_chunksize=10_000):
        writer.write(batch)
    manifest = writer.pre_commit(epoch, 1)
    written = time.perf_counter() - started
    committed = _timed(lambda: sink.commit(epoch, [manifest]))
    writer.close()
    return written, committed, len(manifest["files"])


def epochs(rows: int, repeat: int) -> None:
    kinds: dict[str, Any] = {"unpartitioned": None,
                             "day(ts), bucket[16](id)": [("ts", "day"), ("id", "bucket[16]")]}
    times: dict[str, list[tuple[float, float]]] = {k: [] for k in kinds}
    files: dict[str, int] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(repeat):
            for kind, spec in kinds.items():
                root = Path(tmp) / f"{r}-{len(files)}-{kind[:3]}"
                written, committed, files[kind] = _epoch(root, rows, spec, 1)
                times[kind].append((written, committed))
    print(f"an epoch of {rows:,} rows, one writer (median of {repeat}): write + pre_commit, "
          "commit")
    base = None
    for kind, runs in times.items():
        write = statistics.median(w for w, _ in runs)
        commit = statistics.median(c for _, c in runs)
        base = base or (write, commit)
        print(f"  {kind:26s} {write * 1e3:8.1f} ms ({write / base[0]:4.2f}x), "
              f"{commit * 1e3:7.1f} ms ({commit / base[1]:4.2f}x), {files[kind]} files")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--only", choices=["transforms", "epochs"])
    args = parser.parse_args()
    if args.only != "epochs":
        transforms(args.rows)
    if args.only != "transforms":
        epochs(args.rows, args.repeat)


if __name__ == "__main__":
    main()
