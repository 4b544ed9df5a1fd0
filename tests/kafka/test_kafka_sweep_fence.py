"""The sweep of an attempt (``KafkaSink.abort(epoch, None)``) fences what this sink's own
producers left open on the progress partition (issue 36, item 8).

One open transaction on the shared progress partition hides every later record from
``read_committed`` readers until ``transaction_timeout``: a writer that added its part
record and died before committing, whose number no writer takes over again (the runtime
was rescaled to fewer writers), or a committer that died mid-commit. Before, the sweep's
fence path was dead code (the sweep passes no manifests) and fencing by key happened only
when a marker read behind the meta store (``heal_marker``): the next epochs committed,
their progress records invisible, the marker read as behind. Here each case is made by a
producer that takes the sink's own transactional id, begins a transaction, writes the
record and is abandoned; ``transaction_timeout`` is ten minutes, so only a fence can end
it within the test.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from raysink import SinkRuntime
from raysink.sinks import KafkaSink
from raysink.sinks.kafka import _hanging
from raysink.sinks.kafka._progress import epoch_key, part_key, record_value
from tests.kafka.conftest import Records, halves, sink
from tests.support.kafka import KafkaBroker

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.timeout(300)]

_TXN_TIMEOUT = 600.0


def _sink(broker: KafkaBroker, topic: str) -> KafkaSink:
    return sink(broker, topic, transaction_timeout=_TXN_TIMEOUT)


def _runtime(name: str, broker: KafkaBroker, topic: str, meta: str, writers: int
             ) -> SinkRuntime:
    return SinkRuntime(name, _sink(broker, topic), writers=writers, metastore=meta,
                       progress=False, retry_cap=1.0, commit_timeout=120)


def _abandoned(bound: KafkaSink, txn: str, key: str, value: bytes) -> Any:
    """A producer that took ``txn`` over, began a transaction and wrote ``key: value`` to
    the progress partition; kept open (the caller holds it, and never ends it)."""
    from confluent_kafka import Producer

    producer = Producer(bound.settings.producer_config(txn))
    producer.init_transactions(30)
    producer.begin_transaction()
    producer.produce(bound.settings.progress_topic, value, key)
    assert producer.flush(30) == 0
    return producer


def _epoch_records(broker: KafkaBroker, topic: str, name: str) -> list[int]:
    messages = Records(broker, f"{topic}-raysink-progress").messages
    return [int(json.loads(m.value())["epoch"]) for m in messages
            if m.key() == epoch_key(name, "main").encode()]


def _open(bound: KafkaSink) -> _hanging.OpenTransaction | None:
    return _hanging.find_open(bound.settings, bound.settings.progress_topic)


def test_a_dead_writers_part_record_is_fenced_by_the_sweep_after_a_rescale(
        kafka_broker: KafkaBroker, topic: str, name: str, meta: str) -> None:
    """Writer 1 added its part record of epoch 2 and died; the runtime comes back with one
    writer, so no writer 1 takes its id over. The new coordinator's recovery sweeps the
    unrecorded epoch 2 and fences writer 1's id: epoch 2's progress is visible to
    ``read_committed`` readers at once, and the topic holds epochs 1 and 2 exactly."""
    with _runtime(name, kafka_broker, topic, meta, writers=2) as rt:
        assert rt.write_arrow(halves(1)).committed
    bound = _sink(kafka_broker, topic).bind(name, "main")
    txn = bound.settings.writer_txn(name, "main", 1)
    producer = _abandoned(bound, txn, part_key(name, "main", 1),
                          record_value(2, 0, writer=1))
    held = _open(bound)
    assert held is not None and held.key == part_key(name, "main", 1)
    with _runtime(name, kafka_broker, topic, meta, writers=1) as rt:
        assert rt.write_arrow(halves(2)).committed
        deadline = time.monotonic() + 20
        while _epoch_records(kafka_broker, topic, name)[-1:] != [2]:
            assert time.monotonic() < deadline, (
                f"epoch 2's progress record still hidden: {_open(bound)}")
            time.sleep(0.5)
    assert _open(bound) is None
    Records(kafka_broker, topic).assert_exactly(range(1, 3))
    del producer


def test_a_dead_committers_epoch_record_is_fenced_by_a_sweep(
        kafka_broker: KafkaBroker, topic: str, name: str, meta: str) -> None:
    """The committer died mid-commit with its epoch record of epoch 2 open; the sweep of
    an attempt (``abort(epoch, None)``, as a new coordinator's recovery runs it) takes the
    committer's id over, which aborts that transaction: nothing holds the progress
    partition back, and the next epochs' records are visible."""
    with _runtime(name, kafka_broker, topic, meta, writers=2) as rt:
        assert rt.write_arrow(halves(1)).committed
    bound = _sink(kafka_broker, topic).bind(name, "main")
    producer = _abandoned(bound, bound.settings.committer_txn(name, "main"),
                          epoch_key(name, "main"), record_value(2, 0))
    assert _open(bound) is not None
    sweeper = _sink(kafka_broker, topic).bind(name, "main")
    try:
        started = time.monotonic()
        sweeper.abort(2, None)
        took = time.monotonic() - started
    finally:
        sweeper.close()
    assert _open(bound) is None, f"still held after the sweep ({took:.1f} s)"
    assert _epoch_records(kafka_broker, topic, name) == [1]
    with _runtime(name, kafka_broker, topic, meta, writers=2) as rt:
        assert rt.write_arrow(halves(2)).committed
        assert rt.write_arrow(halves(3)).committed
    assert _epoch_records(kafka_broker, topic, name) == [1, 2, 3]
    Records(kafka_broker, topic).assert_exactly(range(1, 4))
    del producer
