"""KafkaSink against Spark's own Kafka sink and bare producers, side by side in one run.

One run, one broker (started here from the jars ``make setup`` fetched, full JIT, or
``--bootstrap`` for one of yours), a fresh topic with the same partitions per case, the
same records (``--rows`` rows of about 100 bytes of JSON, keyed by ``customer``):

* ``encode``          the encoding alone (``raysink.sinks.kafka._encode``: Arrow JSON,
                      then the Python objects the client takes), one process;
* ``bare x2``         two processes, each one idempotent producer (not transactional, no
                      delivery callback) writing its half of the records, encoded before
                      the clock starts, with the sink's default producer settings;
* ``write_arrow``     ``rt.write_arrow`` of the table as one epoch into a ``KafkaSink``
                      with ``--writers`` writers (exactly once);
* ``spark``           Spark's own ``df.write.format("kafka")`` (at least once;
                      ``spark-sql-kafka-0-10`` from the cached Maven packages) of a cached
                      DataFrame of the same rows, ``to_json`` of each row as the value,
                      2 executors of 1 core (``--no-spark`` leaves both Spark cases out);
* ``rt.write(df)``    the same cached DataFrame into a ``KafkaSink`` (exactly once).

Each prints records/s (from the first row handed over to the last record acknowledged or
committed) and, for ``encode``, ``bare x2`` and ``write_arrow``, the CPU seconds per record
of the processes doing the work, every thread counted (librdkafka's are in-process): the
bare producers' own (``getrusage``, from the start signal to the end of their flush), the
writer actors' (``psutil``, the processes under this driver titled ``SinkWriterActor``,
around the epoch). On a loaded machine the wall clock says more about the neighbours
than about the sink; CPU per record much less so. Then the ratios against the targets:
``rt.write(df)`` / Spark (at least 2), ``write_arrow`` / bare x2 (at least 0.8) by
records/s and by CPU per record (the bare producers' CPU per record over the writers').
``--early-start 50000,off`` runs every raysink case once per setting of
``KafkaSink(early_start_records=)`` listed (``off``: ``None``, the transaction begins at
pre-commit; ``default``: the sink's own), each labelled, side by side in the same run.
``--repeat N`` runs ``bare x2`` and ``write_arrow`` N times in turn, each
``write_arrow`` in a fresh runtime: its first large epoch, then a second one (``2nd
epoch``: the writers' memory already grown, as in a stream). Last, epoch
latency (``--epochs 0`` leaves it out): ``--epochs`` epochs of ``--epoch-rows`` records
each through ``write_arrow``, p50 and p99 (targets 30 and 100 ms). The machine's load
average is printed at the start and the end: on a shared machine only the ratios of one
run carry over.

    .venv/bin/python bench/kafka.py                          # 1 M records
    .venv/bin/python bench/kafka.py --rows 300000 --epochs 100 --no-spark
    .venv/bin/python bench/kafka.py --rows 500000 --no-spark --epochs 0 --repeat 3
    .venv/bin/python bench/kafka.py --early-start 50000,off --epoch-early-start 1,off
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import resource
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)  # before ray.init: Spark's workers

NOTE = "order placed through the web shop"


@dataclass(frozen=True)
class Rate:
    """One case: records/s (wall clock) and, where measured, CPU seconds per record of the
    processes that do the case's work (every thread: librdkafka's are in-process)."""

    per_second: float
    cpu: float | None = None

    def line(self, case: str) -> str:
        cpu = "" if self.cpu is None else f"  {self.cpu * 1e6:6.2f} us CPU/record"
        return f"{case:>30}: {self.per_second:12,.0f} records/s{cpu}"


Early = int | None | str
"""A setting of ``early_start_records``: a count, ``None`` (off), or ``"default"``."""


def parse_early(text: str) -> list[Early]:
    """``50000,off,default`` -> [50000, None, "default"]."""
    settings: list[Early] = []
    for part in text.split(","):
        part = part.strip()
        settings.append(None if part == "off" else part if part == "default" else int(part))
    return settings


def early_label(early: Early) -> str:
    return "" if early == "default" else f" [early {early or 'off'}]"


def kafka_sink(bootstrap: str, topic: str, partitions: int, early: Early) -> Any:
    """The benchmark's sink: keyed by customer, ``early_start_records`` as given."""
    from raysink.sinks import KafkaSink

    extra = {} if early == "default" else {"early_start_records": early}
    return KafkaSink(bootstrap, topic, key="customer", partitions=partitions, **extra)


def make_table(rows: int) -> pa.Table:
    """About 100 bytes of JSON per row."""
    rng = np.random.default_rng(7)
    return pa.table({
        "id": pa.array(np.arange(rows), pa.int64()),
        "customer": pa.array([f"customer-{i % 9973:05d}" for i in range(rows)]),
        "amount": pa.array(np.round(rng.random(rows) * 1000, 2)),
        "note": pa.array([NOTE] * rows),
    })


def producer_settings(bootstrap: str) -> dict[str, Any]:
    """The sink's default producer settings, without the transaction."""
    from raysink.sinks.kafka._config import KafkaSettings

    config = KafkaSettings(bootstrap_servers=bootstrap, topic="t",
                           progress_topic="p").producer_config("bench")
    for name in ("transactional.id", "transaction.timeout.ms", "logger"):
        config.pop(name)
    return config


def encode_run(table: pa.Table) -> Rate:
    """The encoding alone, to the Python objects produce() takes."""
    from raysink.sinks.kafka._encode import encode

    cpu = time.process_time()
    started = time.perf_counter()
    for batch in table.to_batches(max_chunksize=65_536):
        encoded = encode(batch, key="customer", value=None, headers=())
        encoded.values, encoded.keys  # noqa: B018 - what a producer takes
    return Rate(table.num_rows / (time.perf_counter() - started),
                (time.process_time() - cpu) / table.num_rows)


def _bare_producer(bootstrap: str, topic: str, table: pa.Table, ready: Any, go: Any,
                   out: Any) -> None:
    """One bare idempotent producer process: encode first, then produce at ``go``."""
    from confluent_kafka import Producer

    from raysink.sinks.kafka._encode import encode

    records = []
    for batch in table.to_batches(max_chunksize=65_536):
        encoded = encode(batch, key="customer", value=None, headers=())
        records.extend(zip(encoded.values, encoded.keys or [], strict=True))
    producer = Producer(producer_settings(bootstrap))
    producer.produce(topic, b"warm")
    producer.flush(60)
    ready.set()
    go.wait()
    cpu = _process_cpu()
    produce = producer.produce
    for value, key in records:
        while True:
            try:
                produce(topic, value, key)
                break
            except BufferError:
                producer.poll(0.05)
    left = producer.flush(300)
    out.put((time.time(), left, _process_cpu() - cpu))


def _process_cpu() -> float:
    """CPU seconds of this process so far, every thread (librdkafka's too)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _writer_processes() -> list[Any]:
    """This run's writer actors: the processes under this driver (its own Ray) whose
    title names ``SinkWriterActor``."""
    import psutil

    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            if "SinkWriterActor" in " ".join(child.cmdline()):
                found.append(child)
        except psutil.Error:
            continue
    return found


def _cpu_of(processes: list[Any]) -> float:
    import psutil

    total = 0.0
    for process in processes:
        try:
            times = process.cpu_times()
        except psutil.Error:
            continue
        total += times.user + times.system
    return total


def bare_run(bootstrap: str, topic: str, table: pa.Table, *, processes: int,
             partitions: int) -> Rate:
    """``processes`` bare producers at once, each its share of the rows."""
    from tests.support.kafka import KafkaBroker

    KafkaBroker.create_on(bootstrap, topic, partitions)
    ctx = multiprocessing.get_context("spawn")
    go, out = ctx.Event(), ctx.Queue()
    share = -(-table.num_rows // processes)
    readies = [ctx.Event() for _ in range(processes)]
    workers = [ctx.Process(target=_bare_producer,
                           args=(bootstrap, topic, table.slice(i * share, share), ready, go,
                                 out))
               for i, ready in enumerate(readies)]
    for worker in workers:
        worker.start()
    for ready in readies:
        ready.wait(300)
    started = time.time()
    go.set()
    ends = [out.get(timeout=600) for _ in workers]
    for worker in workers:
        worker.join(60)
    assert all(left == 0 for _, left, _ in ends), ends
    return Rate(table.num_rows / (max(end for end, _, _ in ends) - started),
                sum(cpu for _, _, cpu in ends) / table.num_rows)


def raysink_run(bootstrap: str, topic: str, table: pa.Table, *, writers: int,
                partitions: int, meta: str, early: Early) -> tuple[Rate, Rate]:
    """The table as one epoch in a fresh runtime (the writers' first large epoch: their
    memory pools and the client's buffers grow), then again as a second epoch."""
    from raysink import SinkRuntime

    sink = kafka_sink(bootstrap, topic, partitions, early)
    chunks = table.to_batches(max_chunksize=65_536)
    with SinkRuntime(f"bench-{topic}", sink, writers=writers, metastore=meta,
                     progress=False, commit_timeout=600) as rt:
        rt.write_arrow(make_table(10))  # warm: producers made, topic created
        actors = _writer_processes()
        assert len(actors) == writers, actors
        rates = []
        for _ in range(2):
            cpu = _cpu_of(actors)
            started = time.perf_counter()
            report = rt.write_arrow([pa.Table.from_batches([b]) for b in chunks])
            took = time.perf_counter() - started
            cpu = _cpu_of(actors) - cpu
            assert report.committed and report.rows == table.num_rows, report
            rates.append(Rate(table.num_rows / took, cpu / table.num_rows))
    return rates[0], rates[1]


def _ratios(writers: Rate, bare: Rate) -> tuple[float, float]:
    """write_arrow against the bare producers: by records/s, and by CPU per record (the
    bare producers' CPU per record over the writer actors': above 1, the writers spend
    less)."""
    assert writers.cpu and bare.cpu
    return writers.per_second / bare.per_second, bare.cpu / writers.cpu


def spark_frame(spark: Any, rows: int) -> Any:
    """The rows of ``make_table`` (the amounts drawn by Spark), cached in the executors."""
    df = spark.range(0, rows, 1, 4).selectExpr(
        "id", "concat('customer-', lpad(cast(id % 9973 AS string), 5, '0')) AS customer",
        "round(rand(7) * 1000, 2) AS amount", f"'{NOTE}' AS note")
    df.cache()
    df.count()
    return df


def spark_run(bootstrap: str, topic: str, df: Any, rows: int, *, partitions: int) -> float:
    """Spark's own Kafka sink: the row as JSON, keyed by customer."""
    from tests.support.kafka import KafkaBroker

    KafkaBroker.create_on(bootstrap, topic, partitions)
    started = time.perf_counter()
    (df.selectExpr("customer AS key", "to_json(struct(*)) AS value")
     .write.format("kafka").option("kafka.bootstrap.servers", bootstrap)
     .option("topic", topic).save())
    return rows / (time.perf_counter() - started)


def raysink_df_run(bootstrap: str, topic: str, df: Any, rows: int, *, writers: int,
                   partitions: int, meta: str, early: Early) -> float:
    from raysink import SinkRuntime

    sink = kafka_sink(bootstrap, topic, partitions, early)
    with SinkRuntime(f"bench-{topic}", sink, writers=writers, metastore=meta,
                     progress=False, commit_timeout=600) as rt:
        rt.write_arrow(make_table(10))  # warm: producers made, topic created
        started = time.perf_counter()
        report = rt.write(df)
        took = time.perf_counter() - started
        assert report.committed and report.rows == rows, report
    return rows / took


def latency_run(bootstrap: str, topic: str, *, writers: int, partitions: int, epochs: int,
                rows: int, meta: str, early: Early) -> list[float]:
    from raysink import SinkRuntime

    sink = kafka_sink(bootstrap, topic, partitions, early)
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


def spark_cases(args: argparse.Namespace, bootstrap: str, name: str, tmp: Path
                ) -> dict[str, float]:
    from raysink.spark import init_spark, stop_spark
    from raysink.spark.packages import KAFKA

    spark = init_spark("raysink-bench-kafka", executors=2, executor_cores=1,
                       executor_memory="2g", packages=[KAFKA],
                       configs={"spark.ui.showConsoleProgress": "false"})
    try:
        spark.sparkContext.setLogLevel("ERROR")
        df = spark_frame(spark, args.rows)
        spark_run(bootstrap, f"{name}-warm", df.limit(1000), 1000,
                  partitions=args.partitions)
        rates = {"spark": spark_run(bootstrap, f"{name}-spark", df, args.rows,
                                    partitions=args.partitions)}
        for i, early in enumerate(args.early_start):
            rates[f"rt.write(df){early_label(early)}"] = raysink_df_run(
                bootstrap, f"{name}-df{i}", df, args.rows, writers=args.writers,
                partitions=args.partitions, meta=f"sqlite:///{tmp / f'df{i}.db'}",
                early=early)
        return rates
    finally:
        stop_spark()


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--writers", type=int, default=2)
    parser.add_argument("--partitions", type=int, default=6)
    parser.add_argument("--epochs", type=int, default=200)
    parser.add_argument("--epoch-rows", type=int, default=1_000)
    parser.add_argument("--no-spark", action="store_true")
    parser.add_argument("--repeat", type=int, default=1,
                        help="run bare x2 and write_arrow this many times, in turn")
    parser.add_argument("--bootstrap", help="an existing broker (default: start one)")
    parser.add_argument("--early-start", type=parse_early, default=["default"],
                        help="early_start_records for the large cases: counts, off, "
                             "default; comma-separated runs each in turn")
    parser.add_argument("--epoch-early-start", type=parse_early, default=["default"],
                        help="the same for the latency case")
    args = parser.parse_args()

    import ray

    from tests.support.kafka import KafkaBroker

    print(f"load average at the start: {os.getloadavg()[0]:.1f} ({os.cpu_count()} cores)")
    broker = None if args.bootstrap else KafkaBroker(jit=True, heap="1g")
    bootstrap = args.bootstrap or broker.bootstrap  # type: ignore[union-attr]
    tmp = Path(tempfile.mkdtemp(prefix="raysink-bench-kafka-"))
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    try:
        if broker is not None:
            print(f"broker started in {broker.start():.1f} s")
        table = make_table(args.rows)
        print(f"{args.rows:,} records of about 97 bytes of JSON, {args.partitions} "
              f"partitions, {args.writers} writers")
        name = f"b{uuid.uuid4().hex[:6]}"
        pairs: dict[str, list[tuple[float, ...]]] = {}
        cases: dict[str, Any] = {
            "encode": lambda _: encode_run(table),
            "bare x2": lambda _: bare_run(bootstrap, f"{name}-bare{len(pairs)}", table,
                                          processes=2, partitions=args.partitions),
        }
        for i, early in enumerate(args.early_start):
            cases[f"write_arrow{early_label(early)}"] = (
                lambda turn, i=i, early=early: raysink_run(
                    bootstrap, f"{name}-rs{i}-{turn}", table, writers=args.writers,
                    partitions=args.partitions, meta=f"sqlite:///{tmp / 'meta.db'}",
                    early=early))
        rates: dict[str, Rate] = {}
        for turn in range(args.repeat):
            for case, run in cases.items():
                if case == "encode" and turn:
                    continue
                got = run(turn)
                named = ({case: got} if isinstance(got, Rate)
                         else {case: got[0], f"{case} 2nd": got[1]})
                for label, rate in named.items():
                    rates[label] = rate
                    print(f"{rate.line(label)}  (load {os.getloadavg()[0]:.1f})", flush=True)
                if case.startswith("write_arrow"):
                    pairs.setdefault(case, []).append(
                        (*_ratios(rates[case], rates["bare x2"]),
                         *_ratios(rates[f"{case} 2nd"], rates["bare x2"])))
        if not args.no_spark:
            for case, rate in spark_cases(args, bootstrap, name, tmp).items():
                rates[case] = Rate(rate)
                print(rates[case].line(case), flush=True)
        print("write_arrow / bare x2 (target >= 0.8), by records/s and by CPU per record "
              "(bare's CPU per record / the writers'):")
        for case, turns in pairs.items():
            for turn, (wall, cpu, wall2, cpu2) in enumerate(turns):
                print(f"  {case}, turn {turn + 1}: first epoch {wall:.2f}x records/s, "
                      f"{cpu:.2f}x CPU; 2nd epoch {wall2:.2f}x records/s, {cpu2:.2f}x CPU")
        for case, rate in rates.items():
            if case.startswith("rt.write(df)"):
                print(f"{case} / spark: {rate.per_second / rates['spark'].per_second:.2f}x"
                      " (target >= 2)")
        for i, early in enumerate(args.epoch_early_start if args.epochs else []):
            seconds = latency_run(bootstrap, f"{name}-lat{i}", writers=args.writers,
                                  partitions=args.partitions, epochs=args.epochs,
                                  rows=args.epoch_rows,
                                  meta=f"sqlite:///{tmp / f'lat{i}.db'}", early=early)
            q = statistics.quantiles(seconds, n=100)
            print(f"epoch latency{early_label(early)} at {args.epoch_rows:,} records per "
                  f"epoch ({args.epochs} epochs): p50 {q[49] * 1000:.1f} ms, "
                  f"p99 {q[98] * 1000:.1f} ms (targets 30, 100)")
        print(f"load average at the end: {os.getloadavg()[0]:.1f}")
    finally:
        ray.shutdown()
        if broker is not None:
            broker.cleanup()


if __name__ == "__main__":
    main()
