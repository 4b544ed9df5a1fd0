"""The Kafka layer: one broker for the whole test session (``kafka_broker``, from
``tests/support/kafka.py``), the session's Ray, and what the tests share.

``topic``    a fresh topic name (the sink creates the topic at its first epoch)
``meta``     a SQLite meta store URL in the test's ``tmp_path``

``Records`` reads a topic back as consumers see it: ``read_committed`` (what the sink
promises) or ``read_uncommitted`` (aborted attempts included, so a test can tell that a
fault happened), each record's epoch and row id from its JSON value.
"""

from __future__ import annotations

import json
import uuid
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from raysink.sinks import KafkaSink
from tests.support.kafka import KafkaBroker, read_topic

ROWS = 200


@pytest.fixture
def topic() -> str:
    return f"t-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def meta(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'meta.db'}"


def epoch_rows(epoch: int, rows: int = ROWS) -> pa.Table:
    """Rows with globally unique ids ``epoch * 1_000_000 + i`` and a key column."""
    ids = [epoch * 1_000_000 + i for i in range(rows)]
    return pa.table({"id": pa.array(ids, pa.int64()),
                     "customer": pa.array([f"c{i % 13}" for i in range(rows)]),
                     "epoch": pa.array([epoch] * rows, pa.int64())})


def halves(epoch: int, rows: int = ROWS) -> list[pa.Table]:
    """The epoch's rows in two tables (two writers each get one)."""
    table = epoch_rows(epoch, rows)
    return [table.slice(0, rows // 2), table.slice(rows // 2)]


def sink(broker: KafkaBroker, topic: str, **options: Any) -> KafkaSink:
    options.setdefault("key", "customer")
    options.setdefault("partitions", 3)
    options.setdefault("timeout", 30.0)
    return KafkaSink(broker.bootstrap, topic, **options)


class Records:
    """A topic read back (see the module docstring)."""

    def __init__(self, broker: KafkaBroker, topic: str, *, committed: bool = True) -> None:
        self.messages = read_topic(broker.bootstrap, topic, committed=committed)
        self.rows = [json.loads(m.value()) for m in self.messages]

    def ids(self) -> list[int]:
        return [int(r["id"]) for r in self.rows]

    def assert_exactly(self, epochs: Sequence[int], rows: int = ROWS) -> None:
        """Every row of ``epochs`` exactly once, nothing else, and in each partition the
        epochs in order; each record keyed by its customer."""
        got = Counter(self.ids())
        want = Counter(e * 1_000_000 + i for e in epochs for i in range(rows))
        doubled = sorted(k for k, v in got.items() if v > 1)
        missing = sorted(set(want) - set(got))
        extra = sorted(set(got) - set(want))
        assert not doubled, f"records read twice: {doubled[:10]} ({len(doubled)} in all)"
        assert not missing, f"records lost: {missing[:10]} ({len(missing)} in all)"
        assert not extra, f"records from nowhere: {extra[:10]} ({len(extra)} in all)"
        by_partition: dict[int, list[int]] = {}
        for message, row in zip(self.messages, self.rows, strict=True):
            assert message.key() == row["customer"].encode()
            by_partition.setdefault(message.partition(), []).append(int(row["epoch"]))
        for partition, order in by_partition.items():
            assert order == sorted(order), f"partition {partition}: epochs out of order"


def assert_aborted_reached_log(broker: KafkaBroker, topic: str, epoch: int) -> None:
    """A ``read_uncommitted`` reader sees a row of ``epoch`` more than once: an aborted
    attempt (or a lost transaction) did reach the log, so the fault really happened."""
    ids = Records(broker, topic, committed=False).ids()
    repeated = [i for i, n in Counter(ids).items() if n > 1 and i // 1_000_000 == epoch]
    assert repeated, f"no record of epoch {epoch} was written twice to the log"
