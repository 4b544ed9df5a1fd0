"""Avro values through ``KafkaSink`` on the session's broker: written, committed, read back
with ``read_committed`` and decoded by the reference decoder (``tests/support/avro.py``);
and a lost writer's part replayed from the log with its binary values as they are."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import pyarrow as pa
import pytest

from raysink import SinkRuntime
from raysink.testing import arm_fault
from tests.integration.helpers import run_in_thread, sigkill, wait_fired
from tests.kafka.conftest import ROWS, sink
from tests.kafka.test_kafka_faults import _writer_pid
from tests.support.avro import decode_record
from tests.support.kafka import KafkaBroker, read_topic

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.timeout(300)]

SCHEMA_ID = 42
SCHEMA: dict[str, Any] = {
    "type": "record", "name": "Order", "namespace": "shop",
    "fields": [
        {"name": "id", "type": "long"},
        {"name": "customer", "type": "string"},
        {"name": "epoch", "type": "int"},
        {"name": "note", "type": ["null", "string"]},
        {"name": "status", "type": {"type": "enum", "name": "Status",
                                    "symbols": ["NEW", "PAID"]}},
        {"name": "source", "type": "string", "default": "raysink"},
    ]}


def _halves(epoch: int) -> list[pa.Table]:
    ids = [epoch * 1_000_000 + i for i in range(ROWS)]
    table = pa.table({
        "id": pa.array(ids, pa.int64()),
        "customer": [f"c{i % 13}" for i in range(ROWS)],
        "epoch": pa.array([epoch] * ROWS, pa.int32()),
        "note": [None if i % 3 else f"nöte {i}" for i in range(ROWS)],
        "status": ["PAID" if i % 2 else "NEW" for i in range(ROWS)],
    })
    return [table.slice(0, ROWS // 2), table.slice(ROWS // 2)]


def _assert_exactly(broker: KafkaBroker, topic: str, epochs: list[int]) -> None:
    """Every row of ``epochs`` once, decoded whole, keyed by its customer, epochs in order
    in each partition."""
    messages = read_topic(broker.bootstrap, topic, committed=True)
    rows = [decode_record(SCHEMA, m.value(), SCHEMA_ID) for m in messages]
    got = Counter(int(r["id"]) for r in rows)
    want = Counter(e * 1_000_000 + i for e in epochs for i in range(ROWS))
    assert got == want
    order: dict[int, list[int]] = {}
    for message, row in zip(messages, rows, strict=True):
        i = int(row["id"]) % 1_000_000
        assert row == {"id": row["id"], "customer": f"c{i % 13}", "epoch": row["epoch"],
                       "note": None if i % 3 else f"nöte {i}",
                       "status": "PAID" if i % 2 else "NEW", "source": "raysink"}
        assert message.key() == row["customer"].encode()
        order.setdefault(message.partition(), []).append(int(row["epoch"]))
    assert all(o == sorted(o) for o in order.values()), order


def test_avro_values_exactly_once_and_a_lost_part_replayed(
        kafka_broker: KafkaBroker, topic: str, name: str, meta: str) -> None:
    """Epoch 1 commits; epoch 2 is decided and held, writer 0 SIGKILLed, so the commit
    replays its part from the log (the records' binary values copied as they are). Read
    with ``read_committed``: each row once, every record decoding to its row."""
    target = sink(kafka_broker, topic, value_format="avro", avro_schema=json.dumps(SCHEMA),
                  schema_id=SCHEMA_ID)
    with SinkRuntime(name, target, writers=2, metastore=meta, progress=False,
                     retry_cap=1.0, commit_timeout=120) as rt:
        # (not read back here: a committed transaction's markers reach the partitions
        # after the commit returns, so a read_committed reader may still stop before them)
        assert rt.write_arrow(_halves(1)).committed
        pid = _writer_pid(rt)
        arm_fault(name, "kafka.before_finish", action="sleep", seconds=3.0,
                  when={"epoch": 2})
        thread, box = run_in_thread(lambda: rt.write_arrow(_halves(2)))
        wait_fired(name, "kafka.before_finish", timeout=120)
        sigkill(pid)
        thread.join(timeout=240)
        assert box["result"].committed, box
    _assert_exactly(kafka_broker, topic, [1, 2])
    progress = [json.loads(m.value()) for m in
                read_topic(kafka_broker.bootstrap, f"{topic}-raysink-progress")
                if m.key() == f"raysink:{name}:main:w0".encode()]
    assert any(p["epoch"] == 2 and p.get("replayed") for p in progress), progress
