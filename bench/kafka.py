"""KafkaSink against one confluent-kafka producer in one process, on the same broker.

One run, one broker (started here from the jars ``make setup`` fetched, full JIT, or
``--bootstrap`` for one of yours), a fresh topic per case with the same partitions:

* ``raysink``        ``SinkRuntime`` with a ``KafkaSink`` and ``--writers`` writers,
                     ``rt.write_arrow`` of the whole table as one epoch (exactly once);
* ``transactional``  one transactional producer: the same rows, the same encoding
                     (``raysink.sinks.kafka._encode``: Arrow JSON), one transaction;
* ``idempotent``     one idempotent, non-transactional producer, the same rows.

Each prints records/s (from the first row handed over to the last record acknowledged or
committed); then the ratios: raysink / transactional (the target: at least 1.0) and
raysink / idempotent (exactly once may cost at most 15%: at least 0.85). Last, epoch
latency: ``--epochs`` epochs of ``--epoch-rows`` records each through the runtime, p50
and p99 seconds per ``write_arrow``.

    .venv/bin/python bench/kafka.py                    # 1 M records of about 100 bytes
    .venv/bin/python bench/kafka.py --rows 200000 --epochs 50
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def make_table(rows: int) -> pa.Table:
    """About 100 bytes of JSON per row."""
    rng = np.random.default_rng(7)
    return pa.table({
        "id": pa.array(np.arange(rows), pa.int64()),
        "customer": pa.array([f"customer-{i % 9973:05d}" for i in range(rows)]),
        "amount": pa.array(np.round(rng.random(rows) * 1000, 2)),
        "note": pa.array(["order placed through the web shop"] * rows),
    })


def producer_run(bootstrap: str, topic: str, table: pa.Table, *, transactional: bool,
                 partitions: int) -> float:
    """One producer in this process; returns records/s."""
    from confluent_kafka import Producer

    from raysink.sinks.kafka._encode import encode
    from raysink.sinks.kafka._writer import _Deliveries, _produce_all
    from tests.support.kafka import KafkaBroker

    KafkaBroker.create_on(bootstrap, topic, partitions)
    config: dict[str, Any] = {"bootstrap.servers": bootstrap, "linger.ms": 5,
                              "batch.size": 1_000_000, "acks": "all",
                              "queue.buffering.max.messages": 1_000_000,
                              "queue.buffering.max.kbytes": 1_048_576}
    if transactional:
        config["transactional.id"] = f"bench-{topic}"
    else:
        config["enable.idempotence"] = True
    producer = Producer(config)
    if transactional:
        producer.init_transactions(60)
    started = time.perf_counter()
    if transactional:
        producer.begin_transaction()
    deliveries = _Deliveries()
    for batch in table.to_batches(max_chunksize=65_536):
        encoded = encode(batch, key="customer", value=None, headers=())
        _produce_all(producer, topic, encoded, deliveries.report)
    left = producer.flush(300)
    if transactional:
        producer.commit_transaction(120)
    took = time.perf_counter() - started
    assert left == 0 and deliveries.count == table.num_rows, (left, deliveries.count)
    return table.num_rows / took


def raysink_run(bootstrap: str, topic: str, table: pa.Table, *, writers: int,
                partitions: int, meta: str) -> float:
    from raysink import SinkRuntime
    from raysink.sinks import KafkaSink

    sink = KafkaSink(bootstrap, topic, key="customer", partitions=partitions)
    chunks = table.to_batches(max_chunksize=65_536)
    with SinkRuntime(f"bench-{topic}", sink, writers=writers, metastore=meta,
                     progress=False, commit_timeout=600) as rt:
        rt.write_arrow(make_table(10))  # warm: producers made, topic created
        started = time.perf_counter()
        report = rt.write_arrow([pa.Table.from_batches([b]) for b in chunks])
        took = time.perf_counter() - started
        assert report.committed and report.rows == table.num_rows, report
    return table.num_rows / took


def latency_run(bootstrap: str, topic: str, *, writers: int, partitions: int, epochs: int,
                rows: int, meta: str) -> list[float]:
    from raysink import SinkRuntime
    from raysink.sinks import KafkaSink

    sink = KafkaSink(bootstrap, topic, key="customer", partitions=partitions)
    table = make_table(rows)
    seconds: list[float] = []
    with SinkRuntime(f"lat-{topic}", sink, writers=writers, metastore=meta,
                     progress=False) as rt:
        rt.write_arrow(table)
        for _ in range(epochs):
            started = time.perf_counter()
            assert rt.write_arrow(table).committed
            seconds.append(time.perf_counter() - started)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--writers", type=int, default=2)
    parser.add_argument("--partitions", type=int, default=6)
    parser.add_argument("--epochs", type=int, default=200)
    parser.add_argument("--epoch-rows", type=int, default=1_000)
    parser.add_argument("--bootstrap", help="an existing broker (default: start one)")
    args = parser.parse_args()

    import tempfile

    import ray

    from tests.support.kafka import KafkaBroker

    broker = None if args.bootstrap else KafkaBroker(jit=True, heap="1g")
    bootstrap = args.bootstrap or broker.bootstrap  # type: ignore[union-attr]
    tmp = Path(tempfile.mkdtemp(prefix="raysink-bench-kafka-"))
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    try:
        if broker is not None:
            print(f"broker started in {broker.start():.1f} s")
        table = make_table(args.rows)
        json_bytes = sum(len(v) for v in __import__(
            "raysink.sinks.kafka._encode", fromlist=["json_rows"]).json_rows(
                table.slice(0, 1000)).to_pylist()) / 1000
        print(f"{args.rows:,} records, about {json_bytes:.0f} bytes of JSON each, "
              f"{args.partitions} partitions")
        name = f"b{uuid.uuid4().hex[:6]}"
        rates = {
            "idempotent": producer_run(bootstrap, f"{name}-idem", table, transactional=False,
                                       partitions=args.partitions),
            "transactional": producer_run(bootstrap, f"{name}-txn", table,
                                          transactional=True, partitions=args.partitions),
            "raysink": raysink_run(bootstrap, f"{name}-rs", table, writers=args.writers,
                                   partitions=args.partitions,
                                   meta=f"sqlite:///{tmp / 'meta.db'}"),
        }
        for case, rate in rates.items():
            print(f"{case:>14}: {rate:12,.0f} records/s")
        print(f"raysink / transactional producer: {rates['raysink'] / rates['transactional']:.2f}x"
              " (target >= 1.0)")
        print(f"raysink / idempotent producer:    {rates['raysink'] / rates['idempotent']:.2f}x"
              " (target >= 0.85)")
        seconds = latency_run(bootstrap, f"{name}-lat", writers=args.writers,
                              partitions=args.partitions, epochs=args.epochs,
                              rows=args.epoch_rows, meta=f"sqlite:///{tmp / 'lat.db'}")
        q = statistics.quantiles(seconds, n=100)
        print(f"epoch latency at {args.epoch_rows:,} records per epoch ({args.epochs} epochs):"
              f" p50 {q[49] * 1000:.1f} ms, p99 {q[98] * 1000:.1f} ms")
    finally:
        ray.shutdown()
        if broker is not None:
            broker.cleanup()


if __name__ == "__main__":
    main()
