"""A hanging transaction on the progress partition: told from a lost marker, named, ended.

Chaos seed 29 trial t0021 found the case: a broker fenced while it wrote an epoch's
commit markers skipped the progress partition's, so the committer's epoch record stayed
in a transaction nobody would end. ``read_committed`` readers stopped there; raysink read
its marker as gone ("the progress marker ... is gone ... Restore the marker or the
target", a ``DataLossError``) and stalled for good. Here the same partition state is made
on demand (``tests.support.kafka_hanging``: a transactional batch no coordinator knows),
before an epoch whose records then hide behind it, and the coordinator is killed so that
the next one meets it with an epoch pending, as in the trial.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest

from raysink import SinkRuntime
from raysink.sinks.kafka._wire import ProducerState, write_txn_marker
from raysink.testing import arm_fault
from tests.integration.helpers import run_in_thread
from tests.kafka.conftest import Records, halves, sink
from tests.support.kafka import KafkaBroker
from tests.support.kafka_hanging import allow_unverified_writes, hang_transaction, leader_address

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.timeout(400)]


def _runtime(name: str, broker: KafkaBroker, topic: str, meta: str) -> SinkRuntime:
    return SinkRuntime(name, sink(broker, topic), writers=1, metastore=meta, progress=False,
                       retry_cap=1.0, commit_timeout=120, max_attempts=3)


@pytest.fixture
def unverified(kafka_broker: KafkaBroker) -> Iterator[KafkaBroker]:
    """The broker accepts transactional writes its coordinators did not add (KIP-890's
    check off) for the test only."""
    allow_unverified_writes(kafka_broker.bootstrap)
    time.sleep(0.5)
    try:
        yield kafka_broker
    finally:
        allow_unverified_writes(kafka_broker.bootstrap, False)


def _hang(broker: KafkaBroker, topic: str, key: str, value: dict[str, Any]
          ) -> ProducerState:
    progress = f"{topic}-raysink-progress"
    return hang_transaction(broker.bootstrap, progress, 0,
                            [(key.encode(), json.dumps(value).encode())])


def _progress_epochs(broker: KafkaBroker, topic: str, name: str) -> list[int]:
    messages = Records(broker, f"{topic}-raysink-progress").messages
    return [int(json.loads(m.value())["epoch"]) for m in messages
            if m.key() == f"raysink:{name}:main".encode()]


def test_hanging_epoch_record_is_committed_and_the_sink_goes_on(
        unverified: KafkaBroker, topic: str, name: str, meta: str) -> None:
    """The hanging transaction holds this sink's epoch record of a committed epoch: the
    new coordinator fences its committer, finds the transaction still open (hanging),
    proves its outcome (every record it holds says a committed epoch is in) and writes
    its COMMIT marker; the pending epoch commits and every later record is visible."""
    broker = unverified
    with _runtime(name, broker, topic, meta) as rt:
        assert rt.write_arrow(halves(1)).committed
        _hang(broker, topic, f"raysink:{name}:main", {"epoch": 1, "attempt": 0})
        assert rt.write_arrow(halves(2)).committed  # its progress hides behind the hang
        assert _progress_epochs(broker, topic, name) == [1]
        arm_fault(name, "coordinator.after_pending", action="kill", when={"epoch": 3})
        assert rt.write_arrow(halves(3)).committed
        assert rt.write_arrow(halves(4)).committed
    Records(broker, topic).assert_exactly(range(1, 5))
    assert _progress_epochs(broker, topic, name)[-1] == 4  # nothing held back any more


def test_a_hanging_transaction_it_cannot_judge_is_named_until_an_operator_ends_it(
        unverified: KafkaBroker, topic: str, name: str, meta: str) -> None:
    """A hanging transaction of a producer the sink does not own, younger than the
    broker's transaction.max.timeout.ms: left alone, the sink is stalled with the
    transaction named in ``status()`` (partition, producer id, first offset, age) and the
    command that ends it; once an operator aborts it (as ``kafka-transactions.sh abort``
    does), the pending epoch commits."""
    broker = unverified
    with _runtime(name, broker, topic, meta) as rt:
        assert rt.write_arrow(halves(1)).committed
        hung = _hang(broker, topic, "someone-else", {"epoch": 99})
        assert rt.write_arrow(halves(2)).committed
        arm_fault(name, "coordinator.after_pending", action="kill", when={"epoch": 3})
        thread, box = run_in_thread(lambda: rt.write_arrow(halves(3)))
        held = _await_held(rt)
        assert held["producer_id"] == hung.producer_id
        assert held["first_offset"] == hung.txn_start_offset
        assert held["partition"] == 0 and held["age_seconds"] is not None
        error = rt.status().sinks["main"].last_error or ""
        assert "TransactionHeldError" in error and "kafka-transactions.sh" in error
        assert f"--start-offset {hung.txn_start_offset}" in error
        progress = f"{topic}-raysink-progress"
        write_txn_marker(leader_address(broker.bootstrap, progress, 0), progress, 0, hung,
                         commit=False)
        thread.join(timeout=240)
        assert not thread.is_alive(), "epoch 3 never committed after the abort"
        assert "error" not in box, box.get("error")
        assert box["result"].committed
        assert rt.status().sinks["main"].held_by is None
    Records(broker, topic).assert_exactly(range(1, 4))


def _await_held(rt: SinkRuntime, seconds: float = 180.0) -> dict[str, Any]:
    deadline = time.monotonic() + seconds
    while True:
        status = rt.status().sinks["main"]
        if status.held_by is not None:
            return status.held_by
        assert time.monotonic() < deadline, f"never named: {status}"
        time.sleep(0.5)
