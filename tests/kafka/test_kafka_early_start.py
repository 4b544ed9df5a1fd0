"""An epoch's transaction begun before its pre-commit (``KafkaSink(early_start_records=)``,
``KafkaWriter.start_early``) on the session's broker: the records go out while the epoch
is still written, the manifest's runs name them exactly, and every way the early
transaction ends before the pre-commit (a rollback, the writer closed, the transaction
open too long, a failed produce) leaves none of it visible and the epoch whole."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from raysink import SinkRuntime
from raysink.sinks import KafkaSink
from raysink.sinks.kafka import _produced
from raysink.sinks.kafka._progress import Topics
from tests.kafka.conftest import Records, epoch_rows, sink
from tests.kafka.test_kafka_writer_path import PARTITIONS, _assert_runs_exact, _batches_of
from tests.support.kafka import KafkaBroker, read_topic

pytestmark = pytest.mark.timeout(240)

ROWS = 3_000


def _writer(broker: KafkaBroker, topic: str, **options: Any) -> Any:
    options.setdefault("early_start_records", 500)
    bound = KafkaSink(broker.bootstrap, topic, key="k", headers=["h"],
                      partitions=PARTITIONS, timeout=30.0, **options
                      ).bind(f"rt{uuid.uuid4().hex[:6]}", "main")
    Topics(bound.settings).create_progress()
    writer = bound.create_writer(1)
    writer.open()
    return writer


def _committed_ids(broker: KafkaBroker, topic: str) -> list[int]:
    return sorted(int(m.value().decode().split(",")[0].split(":")[1])
                  for m in read_topic(broker.bootstrap, topic, committed=True)
                  if m.topic() == topic)


def _uncommitted(broker: KafkaBroker, topic: str) -> int:
    return sum(1 for m in read_topic(broker.bootstrap, topic, committed=False)
               if m.topic() == topic)


def _write_early(writer: Any, epoch: int, attempt: int) -> list[Any]:
    """The first batch, the early start it asks for, and the records it produced
    reaching the log before the pre-commit; the other batches, not yet written."""
    first, *rest = [b.to_batches()[0] for b in _batches_of(ROWS)]
    assert not writer.wants_early_start()
    writer.write(first)
    assert writer.wants_early_start()
    writer.start_early(epoch, attempt)
    assert writer._early is not None and writer._early.records == first.num_rows
    return rest


def _commit_exact(broker: KafkaBroker, topic: str, writer: Any, epoch: int,
                  attempt: int) -> None:
    """Pre-commit, the manifest's runs naming exactly the epoch's records, and commit."""
    manifest = writer.pre_commit(epoch, attempt)
    _assert_runs_exact(broker, topic, manifest, ROWS)
    assert writer.finish(epoch, attempt, commit=True).name == "COMMITTED"


@contextlib.contextmanager
def _begun_early(broker: KafkaBroker, **options: Any) -> Iterator[tuple[str, Any, list[Any]]]:
    """A fresh topic, a writer with epoch 1 (attempt 0) begun early, and the epoch's
    batches not yet written; afterwards the writer is closed and the topic must hold
    every record of the epoch once."""
    topic = f"e-{uuid.uuid4().hex[:10]}"
    writer = _writer(broker, topic, **options)
    try:
        yield topic, writer, _write_early(writer, 1, 0)
    finally:
        writer.close()
    assert _committed_ids(broker, topic) == list(range(ROWS))


def test_an_epoch_begun_early_is_in_the_log_before_its_pre_commit_and_named_exactly(
        kafka_broker: KafkaBroker) -> None:
    with _begun_early(kafka_broker) as (topic, writer, rest):
        for batch in rest:
            writer.write(batch)
        writer._producer.flush(30)
        assert _uncommitted(kafka_broker, topic) == ROWS, "produced as written"
        assert not writer.wants_early_start(), "one transaction at a time"
        _commit_exact(kafka_broker, topic, writer, 1, 0)
        # the next epoch, below the threshold: begun at its pre-commit as before
        writer.write(_batches_of(300)[0].to_batches()[0])
        assert not writer.wants_early_start()
        writer.rollback(2, 0)


def test_a_rollback_aborts_what_was_produced_early_and_the_next_attempt_is_whole(
        kafka_broker: KafkaBroker) -> None:
    with _begun_early(kafka_broker) as (topic, writer, rest):
        writer.write(rest[0])
        writer._producer.flush(30)  # in the log (an abort drops what is still queued)
        writer.rollback(1, 0)
        assert writer._early is None and writer._rows == 0
        rest = _write_early(writer, 1, 1)  # the attempt again, begun early again
        for batch in rest:
            writer.write(batch)
        _commit_exact(kafka_broker, topic, writer, 1, 1)
    assert _uncommitted(kafka_broker, topic) > ROWS, "the aborted attempt reached the log"


def test_closing_the_writer_aborts_a_transaction_begun_early(
        kafka_broker: KafkaBroker) -> None:
    """Nothing of it is visible, and it does not hold ``read_committed`` readers back:
    another writer's epoch after it is read at once."""
    topic = f"e-{uuid.uuid4().hex[:10]}"
    writer = _writer(kafka_broker, topic)
    _write_early(writer, 1, 0)
    writer.close()
    other = _writer(kafka_broker, topic, early_start_records=None)
    try:
        for batch in _batches_of(ROWS):
            other.write(batch.to_batches()[0])
        other.pre_commit(1, 0)
        assert other.finish(1, 0, commit=True).name == "COMMITTED"
    finally:
        other.close()
    assert _committed_ids(kafka_broker, topic) == list(range(ROWS))


def test_an_early_transaction_open_half_its_timeout_is_given_up_for_the_pre_commit(
        kafka_broker: KafkaBroker) -> None:
    """An epoch whose records come slowly would outlive ``transaction_timeout`` (and be
    aborted by the broker at every try): at half of it the early transaction is aborted
    and the epoch, still buffered, is produced in one go at its pre-commit."""
    with _begun_early(kafka_broker, transaction_timeout=60.0) as (topic, writer, rest):
        began = writer._early.began
        writer._clock = lambda: began + 29.0
        writer.write(rest[0])
        assert writer._early is not None, "open less than half of transaction_timeout"
        writer._clock = lambda: began + 31.0
        writer.write(rest[1])
        assert writer._early is None, "given up"
        assert not writer.wants_early_start(), "not begun early again in this epoch"
        _commit_exact(kafka_broker, topic, writer, 1, 0)


def test_a_produce_that_fails_early_leaves_the_epoch_to_its_pre_commit(
        kafka_broker: KafkaBroker, monkeypatch: pytest.MonkeyPatch) -> None:
    from confluent_kafka import KafkaError, KafkaException

    with _begun_early(kafka_broker) as (topic, writer, rest):
        send = _produced.Produced.send

        def refused(self: Any, buffer: Any) -> None:
            raise KafkaException(KafkaError(KafkaError._STATE, "refused here"))

        monkeypatch.setattr(_produced.Produced, "send", refused)
        writer.write(rest[0])
        assert writer._early is None
        monkeypatch.setattr(_produced.Produced, "send", send)
        writer.write(rest[1])
        _commit_exact(kafka_broker, topic, writer, 1, 0)


@pytest.mark.usefixtures("ray_session")
def test_epochs_begun_early_through_the_runtime_are_exactly_once_in_order(
        kafka_broker: KafkaBroker, topic: str, meta: str) -> None:
    """Each writer gets three tables of each epoch and begins the epoch's transaction
    after the first, once the epoch before it is committed (the runtime's answer)."""
    rows = 600
    with SinkRuntime(f"early-{uuid.uuid4().hex[:6]}", sink(kafka_broker, topic,
                                                          early_start_records=1),
                     writers=2, metastore=meta, progress=False) as rt:
        for epoch in (1, 2, 3):
            table = epoch_rows(epoch, rows)
            assert rt.write_arrow([table.slice(i * 100, 100) for i in range(6)]).committed
    Records(kafka_broker, topic).assert_exactly([1, 2, 3], rows)

