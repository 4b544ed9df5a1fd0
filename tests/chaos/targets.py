"""The sinks a chaos trial writes into, and reading each target back.

``build_sinks(spec, ...)`` makes the trial's sinks from its JSON-able description (the same
function runs in the test process and in a driver subprocess). ``read_target`` returns the
rows readers see (``id``, ``epoch``, ``feed``) and ``commit_order`` the epochs in the order
the target recorded their commits: the Parquet commit log (by ``committed_at``), Delta
versions (their ``txn`` actions), Iceberg snapshots (by sequence number; a maintenance
snapshot, which carries the marker of the epoch before it, left out), PostgreSQL
progress rows (by ``committed_at``), the epoch records of a Kafka sink's progress topic
(by offset).

A Kafka target (``kafka``) is a topic of the session's broker, named after the trial, keyed
by ``payload`` over three partitions; it is read back record by record by a
``read_committed`` consumer, each record's row from its JSON value. ``order_problems``
adds what only Kafka can get wrong: a partition whose records are not in epoch order.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Mapping
from itertools import pairwise
from pathlib import Path
from typing import Any

import pyarrow as pa

from raysink.sinks.base import Sink

__all__ = ["KINDS", "build_sinks", "commit_order", "epoch_table", "order_problems",
           "read_target", "sink_specs"]

KINDS = ("parquet", "delta", "iceberg", "postgres", "kafka")
COLUMNS = ["id", "epoch", "feed"]
ID_BASE = 1_000_000
_KAFKA_TIMEOUT = 90.0


def epoch_table(epoch: int, rows: int, feed: int) -> pa.Table:
    """Rows of ``epoch``: ids ``epoch * 1e6 + i`` (the same in every attempt), ``feed`` the
    driver's write call that carried them (tells an aborted feed's rows apart)."""
    return pa.table({
        "id": pa.array([epoch * ID_BASE + i for i in range(rows)], pa.int64()),
        "epoch": pa.array([epoch] * rows, pa.int64()),
        "feed": pa.array([feed] * rows, pa.int32()),
        "payload": pa.array([f"p{epoch}-{i % 97}" for i in range(rows)], pa.string()),
    })


def sink_specs(kind: str, trial_dir: Path, table: str, *, data_dir: Path | None = None,
               pg_dsn: str | None = None, kafka: str | None = None, two_sinks: bool = False,
               stall: Mapping[str, Any] | None = None,
               maintenance: Mapping[str, Any] | None = None) -> dict[str, dict[str, Any]]:
    """JSON-able descriptions of the trial's sinks: ``main`` of ``kind``, and optionally a
    Parquet ``copy``. ``data_dir`` holds file targets (a tmpfs in filesystem trials);
    ``kafka`` is the broker's bootstrap address (the topic is ``table``); ``maintenance``
    the fields of a Delta or Iceberg ``main``'s ``raysink.Maintenance`` (else the sink's
    default policy)."""
    root = data_dir or trial_dir
    main: dict[str, Any] = {"kind": kind}
    if kind == "parquet":
        main["path"] = str(root / "main")
    elif kind == "delta":
        main["path"] = str(root / "delta")
    elif kind == "iceberg":
        main["catalog"] = {"uri": f"sqlite:///{trial_dir / 'catalog.db'}",
                           "warehouse": f"file://{trial_dir / 'warehouse'}"}
        main["identifier"] = "chaos.t"
        main["partition_by"] = [["id", "bucket[2]"]]  # a writer stages a file per bucket
    elif kind == "postgres":
        main["dsn"] = pg_dsn
        main["table"] = table
    elif kind == "kafka":
        main["bootstrap"] = kafka
        main["topic"] = table
        # half the trials (by the topic's name: no draw from the plan's random stream)
        # begin each epoch's transactions at the first record written, before the
        # barrier (KafkaSink(early_start_records=)), so every fault meets that path too
        main["early_start_records"] = 1 if zlib.crc32(table.encode()) % 2 else None
    if stall:
        main["stall"] = {**stall, "state_dir": str(trial_dir / "failing")}
    if maintenance:
        main["maintenance"] = dict(maintenance)
    specs = {"main": main}
    if two_sinks:
        specs["copy"] = {"kind": "parquet", "path": str(trial_dir / "copy")}
    return specs


def _policy(spec: Mapping[str, Any]) -> Any:
    """The sink's ``maintenance=`` option: the spec's policy, or ``None`` (the default)."""
    if not spec.get("maintenance"):
        return None
    from raysink import Maintenance

    return Maintenance(**spec["maintenance"])


def _build_one(spec: Mapping[str, Any]) -> Sink:
    kind = spec["kind"]
    sink: Sink
    if kind == "parquet":
        from raysink.sinks import ParquetSink

        sink = ParquetSink(spec["path"])
    elif kind == "delta":
        from raysink.sinks import DeltaSink

        sink = DeltaSink(spec["path"], maintenance=_policy(spec))
    elif kind == "iceberg":
        from raysink.sinks import IcebergSink

        sink = IcebergSink(spec["identifier"], catalog=spec["catalog"],
                           catalog_name="chaos", partition_by=spec.get("partition_by"),
                           maintenance=_policy(spec))
    elif kind == "postgres":
        from raysink.sinks import PostgresSink

        sink = PostgresSink(spec["dsn"], spec["table"])
    elif kind == "kafka":
        from raysink.sinks import KafkaSink

        # a restarted broker takes 10-20 s to answer: the sink's calls wait that long
        sink = KafkaSink(spec["bootstrap"], spec["topic"], key="payload", partitions=3,
                         timeout=_KAFKA_TIMEOUT,
                         early_start_records=spec.get("early_start_records"))
    else:
        raise ValueError(f"unknown sink kind {kind!r}")
    stall = spec.get("stall")
    if stall:
        from raysink.testing import FailingSink

        sink = FailingSink(sink, state_dir=stall["state_dir"],
                           stall_commit_seconds=float(stall["seconds"]),
                           stall_commit_times=stall.get("times"))
    return sink


def build_sinks(specs: Mapping[str, Mapping[str, Any]]) -> dict[str, Sink]:
    return {name: _build_one(spec) for name, spec in specs.items()}


# --------------------------------------------------------------------------- reading back


def _empty() -> pa.Table:
    return pa.table({"id": pa.array([], pa.int64()), "epoch": pa.array([], pa.int64()),
                     "feed": pa.array([], pa.int32())})


def read_target(spec: Mapping[str, Any], pg: Any = None) -> pa.Table:
    """Every row readers of the target see (columns ``id``, ``epoch``, ``feed``)."""
    kind = spec["kind"]
    if kind == "parquet":
        return _read_parquet(Path(spec["path"]))
    if kind == "delta":
        return _read_delta(spec["path"])
    if kind == "iceberg":
        return _read_iceberg(spec)
    if kind == "kafka":
        return _read_kafka(spec)
    return _read_postgres(spec, pg)


def _read_parquet(path: Path) -> pa.Table:
    import pyarrow.dataset as ds

    if not path.is_dir():
        return _empty()
    dataset = ds.dataset(str(path), format="parquet")
    if not dataset.files:
        return _empty()
    return dataset.to_table(columns=COLUMNS)


def _read_delta(path: str) -> pa.Table:
    from deltalake import DeltaTable
    from deltalake.exceptions import TableNotFoundError

    try:
        table = DeltaTable(path)
    except TableNotFoundError:
        return _empty()
    return table.to_pyarrow_table(columns=COLUMNS)


def _iceberg_table(spec: Mapping[str, Any]) -> Any:
    from pyiceberg.catalog import load_catalog
    from pyiceberg.exceptions import NoSuchTableError

    catalog = load_catalog("chaos", **spec["catalog"])
    try:
        return catalog.load_table(spec["identifier"])
    except NoSuchTableError:
        return None


def _read_iceberg(spec: Mapping[str, Any]) -> pa.Table:
    table = _iceberg_table(spec)
    if table is None:
        return _empty()
    return table.scan(selected_fields=tuple(COLUMNS)).to_arrow().select(COLUMNS)


def _read_postgres(spec: Mapping[str, Any], pg: Any) -> pa.Table:
    from psycopg import sql

    exists = pg.execute("SELECT to_regclass(%s)", (f'public."{spec["table"]}"',),
                        dbname="raysink")
    if not exists or exists[0][0] is None:
        return _empty()
    query = sql.SQL("SELECT id, epoch, feed FROM public.{}").format(
        sql.Identifier(spec["table"])).as_string(None)
    rows = pg.execute(query, dbname="raysink")
    return pa.table({"id": pa.array([r[0] for r in rows], pa.int64()),
                     "epoch": pa.array([r[1] for r in rows], pa.int64()),
                     "feed": pa.array([r[2] for r in rows], pa.int32())})


def _kafka_rows(spec: Mapping[str, Any]) -> tuple[list[Any], list[dict[str, Any]]]:
    """The data topic's records as a ``read_committed`` consumer sees them, and their
    rows (JSON values)."""
    from tests.support.kafka import read_topic

    messages = read_topic(spec["bootstrap"], spec["topic"], timeout=_KAFKA_TIMEOUT)
    return messages, [json.loads(m.value()) for m in messages]


def _read_kafka(spec: Mapping[str, Any]) -> pa.Table:
    _, rows = _kafka_rows(spec)
    return pa.table({"id": pa.array([int(r["id"]) for r in rows], pa.int64()),
                     "epoch": pa.array([int(r["epoch"]) for r in rows], pa.int64()),
                     "feed": pa.array([int(r["feed"]) for r in rows], pa.int32())})


def order_problems(spec: Mapping[str, Any], *, epochs: bool = True) -> list[str]:
    """A Kafka target's partitions whose records are out of epoch order (``epochs``: the
    rows' ``epoch`` column holds their epoch, not a stream producer's group); a record
    keyed by anything but its ``payload``. Nothing for other targets."""
    if spec["kind"] != "kafka":
        return []
    messages, rows = _kafka_rows(spec)
    problems: list[str] = []
    by_partition: dict[int, list[int]] = {}
    for message, row in zip(messages, rows, strict=True):
        if message.key() != str(row["payload"]).encode():
            problems.append(f"record {row['id']} keyed {message.key()!r}")
        by_partition.setdefault(message.partition(), []).append(int(row["epoch"]))
    if epochs:
        problems += [f"partition {p}: epochs out of order" for p, order in
                     by_partition.items() if any(b < a for a, b in pairwise(order))]
    return problems[:20]


def commit_order(spec: Mapping[str, Any], runtime: str, sink: str, pg: Any = None) -> list[int]:
    """The epochs the target recorded as committed, in the order it recorded them."""
    kind = spec["kind"]
    if kind == "parquet":
        return _parquet_order(Path(spec["path"]))
    if kind == "delta":
        return _delta_order(Path(spec["path"]))
    if kind == "iceberg":
        return _iceberg_order(spec)
    if kind == "kafka":
        return _kafka_order(spec, runtime, sink)
    return _postgres_order(runtime, sink, pg)


def _parquet_order(path: Path) -> list[int]:
    folder = path / "_raysink" / "commits"
    entries = [json.loads(p.read_text()) for p in folder.glob("*.json")] if folder.is_dir() else []
    entries.sort(key=lambda e: (float(e["committed_at"]), int(e["epoch"])))
    return [int(e["epoch"]) for e in entries]


def _delta_order(path: Path) -> list[int]:
    order: list[int] = []
    log_dir = path / "_delta_log"
    files = sorted(log_dir.glob("*.json")) if log_dir.is_dir() else []
    for file in files:
        for line in file.read_text().splitlines():
            action = json.loads(line) if line.strip() else {}
            txn = action.get("txn")
            if txn and str(txn.get("appId", "")).startswith("raysink:"):
                order.append(int(txn["version"]))
    return order


def _iceberg_order(spec: Mapping[str, Any]) -> list[int]:
    table = _iceberg_table(spec)
    if table is None:
        return []
    snapshots = sorted(table.metadata.snapshots, key=lambda s: s.sequence_number or 0)
    order: list[int] = []
    for snapshot in snapshots:
        summary = snapshot.summary
        if summary is not None and summary.get("raysink.maintenance") is not None:
            continue  # a maintenance snapshot carries the marker of the epoch before it
        value = summary.get("raysink.epoch") if summary is not None else None
        if value is not None:
            order.append(int(value))
    return order


def _postgres_order(runtime: str, sink: str, pg: Any) -> list[int]:
    exists = pg.execute("SELECT to_regclass('public._raysink_progress')", dbname="raysink")
    if not exists or exists[0][0] is None:
        return []
    rows = pg.execute("SELECT epoch FROM public._raysink_progress WHERE runtime = %s AND "
                      "sink = %s AND writer = -1 ORDER BY committed_at, epoch",
                      (runtime, sink), dbname="raysink")
    return [int(r[0]) for r in rows]


def _kafka_order(spec: Mapping[str, Any], runtime: str, sink: str) -> list[int]:
    """The epoch records of the sink in its progress topic, by offset (a record written
    again for the same epoch, by a commit run again, counts once)."""
    from tests.support.kafka import read_topic

    key = f"raysink:{runtime}:{sink}".encode()
    messages = read_topic(spec["bootstrap"], f"{spec['topic']}-raysink-progress",
                          timeout=_KAFKA_TIMEOUT)
    epochs = [int(json.loads(m.value())["epoch"]) for m in messages if m.key() == key]
    return list(dict.fromkeys(epochs))
