"""The Kafka sink's committer against a scripted producer that behaves as librdkafka does
where a broker cannot be made to on demand: a ``commit_transaction`` that times out stays
the call in progress (every other transactional call is refused with a retriable
``_CONFLICT`` until it is called again, which resumes it), and fatal errors of every kind
(fencing, authorization, an invalid transaction state).

``KafkaSink.commit`` runs for real; what it needs of the rest of the world is stubbed:
the topics exist, the progress topic shows no epoch yet, and every writer answers
``COMMITTED`` for its part.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import confluent_kafka as ck
import pytest

from raysink.errors import FencedError, SinkUnavailableError
from raysink.sinks import KafkaSink
from raysink.sinks.base import CommitResult, Held
from raysink.sinks.kafka._writer import KafkaWriter

E = ck.KafkaError
Step = Callable[["FakeProducer"], None]


def _error(code: int, text: str = "scripted", **flags: bool) -> ck.KafkaException:
    return ck.KafkaException(E(code, text, **flags))


def _timed_out(producer: FakeProducer) -> None:
    raise _error(E._TIMED_OUT, "Failed to flush all outstanding messages within the "
                 "API timeout: 1 message(s) remaining", retriable=True)


class Broker:
    """What read_committed readers would see, and the script of the producers' calls:
    ``script[method]`` is a list of steps, one taken per call (none left: it succeeds)."""

    def __init__(self) -> None:
        self.committed: list[tuple[str, Any, Any]] = []
        self.producers: list[FakeProducer] = []
        self.script: dict[str, list[Step]] = {}

    def step(self, producer: FakeProducer, method: str) -> None:
        steps = self.script.get(method)
        if steps:
            steps.pop(0)(producer)


class FakeProducer:
    """A transactional producer as librdkafka keeps its state (see the module docstring)."""

    def __init__(self, broker: Broker, config: dict[str, Any]) -> None:
        self.broker = broker
        self.config = config
        self.calls: list[str] = []
        self.in_progress: str | None = None  # a timed-out call, resumable
        self.open: list[tuple[str, Any, Any]] | None = None
        broker.producers.append(self)

    def _call(self, method: str) -> None:
        self.calls.append(method)
        if self.in_progress is not None and self.in_progress != method:
            raise _error(E._CONFLICT, f"Conflicting {self.in_progress} API call is already "
                         "in progress", retriable=True)

    def init_transactions(self, timeout: float) -> None:
        self._call("init_transactions")
        self.broker.step(self, "init_transactions")

    def begin_transaction(self) -> None:
        self._call("begin_transaction")
        self.broker.step(self, "begin_transaction")
        if self.open is not None:
            raise _error(E._STATE, "Operation not valid in state InTransaction")
        self.open = []

    def produce(self, topic: str, value: Any = None, key: Any = None, **_: Any) -> None:
        assert self.open is not None, "produce outside a transaction"
        self.broker.step(self, "produce")
        self.open.append((topic, key, value))

    def flush(self, timeout: float = 0) -> int:
        return 0

    def commit_transaction(self, timeout: float) -> None:
        self._call("commit_transaction")
        try:
            self.broker.step(self, "commit_transaction")
        except ck.KafkaException as exc:
            if exc.args[0].retriable():
                self.in_progress = "commit_transaction"
            raise
        self.in_progress = None
        self.broker.committed.extend(self.open or [])
        self.open = None

    def abort_transaction(self, timeout: float) -> None:
        self._call("abort_transaction")
        try:
            self.broker.step(self, "abort_transaction")
        except ck.KafkaException as exc:
            if exc.args[0].retriable():
                self.in_progress = "abort_transaction"
            raise
        self.in_progress = None
        self.open = None


@pytest.fixture
def broker(monkeypatch: pytest.MonkeyPatch) -> Iterator[Broker]:
    broker = Broker()
    monkeypatch.setattr(ck, "Producer", lambda config: FakeProducer(broker, config))
    yield broker


def _sink(**options: Any) -> KafkaSink:
    sink = KafkaSink("127.0.0.1:9", "orders", timeout=1.0, **options).bind("rt", "main")
    sink._topics_ready = lambda epoch, parts: True  # type: ignore[method-assign]
    sink._committed_recently = lambda: None  # type: ignore[method-assign]
    sink._finish = lambda epoch, parts, commit: [Held.COMMITTED] * len(parts)  # type: ignore[method-assign]
    return sink


def _part(epoch: int, writer: int = 0) -> dict[str, Any]:
    return {"writer": writer, "rows": 10, "epoch": epoch, "attempt": 0,
            "txn": f"raysink.rt.main.w{writer}", "actor": f"w{writer}", "topic": "orders",
            "runs": {"0": [[0, 10]]}}


def _epoch_records(broker: Broker) -> list[int]:
    """The epochs of the epoch records committed, in order."""
    return [int(json.loads(value)["epoch"]) for topic, key, value in broker.committed
            if topic == "orders-raysink-progress" and key == "raysink:rt:main"]


# -- item 1: a commit that timed out ------------------------------------------------------


def test_a_timed_out_commit_is_resumed_not_aborted(broker: Broker) -> None:
    """Before: the next try aborted (``_CONFLICT``, retriable, for ever); now it calls
    ``commit_transaction`` again, which ends the commit: the epoch is in, written once."""
    sink = _sink()
    broker.script["commit_transaction"] = [_timed_out]
    with pytest.raises(SinkUnavailableError):
        sink.commit(1, [_part(1)])
    for _ in range(3):  # before the fix: _CONFLICT at each try, for ever
        try:
            result = sink.commit(1, [_part(1)])
            break
        except SinkUnavailableError as exc:
            last = exc
    else:
        raise AssertionError(f"the committer is stuck: {last}")
    assert result is CommitResult.COMMITTED
    assert sink.commit(2, [_part(2)]) is CommitResult.COMMITTED
    (producer,) = broker.producers
    assert "abort_transaction" not in producer.calls
    assert producer.calls.count("commit_transaction") == 3
    assert _epoch_records(broker) == [1, 2]


def test_a_commit_that_times_out_again_and_again_is_resumed_each_time(broker: Broker
                                                                    ) -> None:
    sink = _sink()
    broker.script["commit_transaction"] = [_timed_out] * 3
    for _ in range(3):
        with pytest.raises(SinkUnavailableError, match="did not end the committer's commit"):
            sink.commit(1, [_part(1)])
    assert sink.commit(1, [_part(1)]) is CommitResult.COMMITTED
    assert sink.commit(2, [_part(2)]) is CommitResult.COMMITTED
    assert len(broker.producers) == 1
    assert _epoch_records(broker) == [1, 2]


def test_a_resumed_commit_that_must_abort_runs_the_epoch_again(broker: Broker) -> None:
    def abortable(_: FakeProducer) -> None:
        raise _error(E._MSG_TIMED_OUT, "delivery failed", txn_requires_abort=True)

    sink = _sink()
    broker.script["commit_transaction"] = [_timed_out, abortable]
    for _ in range(2):
        with pytest.raises(SinkUnavailableError):
            sink.commit(1, [_part(1)])
    assert sink.commit(1, [_part(1)]) is CommitResult.COMMITTED
    assert _epoch_records(broker) == [1]
    assert broker.producers[0].calls.count("abort_transaction") == 1


def test_a_timed_out_abort_is_resumed(broker: Broker) -> None:
    """The epoch record refused by the client leaves the transaction open; the next try's
    abort times out; the one after calls ``abort_transaction`` again and commits."""
    def too_large(_: FakeProducer) -> None:
        raise _error(E.MSG_SIZE_TOO_LARGE, "Message size too large")

    sink = _sink()
    broker.script["produce"] = [too_large]
    broker.script["abort_transaction"] = [_timed_out]
    with pytest.raises(SinkUnavailableError, match="MSG_SIZE_TOO_LARGE"):
        sink.commit(1, [_part(1)])
    with pytest.raises(SinkUnavailableError, match="did not end the committer's abort"):
        sink.commit(1, [_part(1)])
    assert sink.commit(1, [_part(1)]) is CommitResult.COMMITTED
    assert len(broker.producers) == 1
    assert _epoch_records(broker) == [1]


def test_a_call_refused_in_its_state_replaces_the_producer(broker: Broker) -> None:
    """Whatever state librdkafka is in that the committer did not foresee, it is not
    stuck: the producer is made again (the id taken over) at the next try."""
    def conflict(_: FakeProducer) -> None:
        raise _error(E._CONFLICT, "Conflicting commit_transaction API call is already in "
                     "progress", retriable=True)

    sink = _sink()
    broker.script["begin_transaction"] = [conflict]
    with pytest.raises(SinkUnavailableError, match="made again"):
        sink.commit(1, [_part(1)])
    assert sink.commit(1, [_part(1)]) is CommitResult.COMMITTED
    assert len(broker.producers) == 2
    assert _epoch_records(broker) == [1]


# -- item 4: which fatal errors are fencing -----------------------------------------------


def _fatal(code: int) -> Step:
    def raise_it(_: FakeProducer) -> None:
        raise _error(code, "scripted fatal error", fatal=True)
    return raise_it


@pytest.mark.parametrize("code", [E._FENCED, E.PRODUCER_FENCED, E.INVALID_PRODUCER_EPOCH])
def test_a_fencing_code_is_fenced(broker: Broker, code: int) -> None:
    sink = _sink()
    broker.script["commit_transaction"] = [_fatal(code)]
    with pytest.raises(FencedError, match="another coordinator"):
        sink.commit(1, [_part(1)])


def test_a_fencing_code_after_the_transaction_timeout_is_the_broker_aborting_it(
        broker: Broker) -> None:
    sink = _sink(transaction_timeout=1)

    def late_fenced(_: FakeProducer) -> None:
        assert sink._committer is not None
        sink._committer._began -= 10  # the transaction began 10 s ago
        raise _error(E._FENCED, "fenced", fatal=True)

    broker.script["commit_transaction"] = [late_fenced]
    with pytest.raises(SinkUnavailableError, match="transaction_timeout"):
        sink.commit(1, [_part(1)])
    assert sink.commit(1, [_part(1)]) is CommitResult.COMMITTED
    assert len(broker.producers) == 2


@pytest.mark.parametrize(("code", "acl"), [
    (E.TRANSACTIONAL_ID_AUTHORIZATION_FAILED, "--transactional-id raysink.rt.main.orders.c"),
    (E.TOPIC_AUTHORIZATION_FAILED, "--topic"),
    (E.CLUSTER_AUTHORIZATION_FAILED, "IdempotentWrite"),
])
@pytest.mark.parametrize("method", ["commit_transaction", "init_transactions"])
def test_an_authorization_failure_names_the_acl_and_is_retried(
        broker: Broker, code: int, acl: str, method: str) -> None:
    """Not ``FencedError`` (which stops every sink of the runtime): the ACL to grant,
    as ``SinkUnavailableError``; once granted, the next try (a new producer) commits."""
    sink = _sink()
    broker.script[method] = [_fatal(code)]
    with pytest.raises(SinkUnavailableError, match="grant") as info:
        sink.commit(1, [_part(1)])
    assert acl in str(info.value)
    assert sink.commit(1, [_part(1)]) is CommitResult.COMMITTED
    assert _epoch_records(broker) == [1]


@pytest.mark.parametrize("code", [E.INVALID_TXN_STATE, E.INVALID_PRODUCER_ID_MAPPING,
                                  E.TRANSACTION_COORDINATOR_FENCED, E.UNSUPPORTED_VERSION])
def test_another_fatal_error_says_what_it_is(broker: Broker, code: int) -> None:
    sink = _sink()
    broker.script["commit_transaction"] = [_fatal(code)]
    with pytest.raises(SinkUnavailableError, match="no fencing") as info:
        sink.commit(1, [_part(1)])
    assert E(code).name() in str(info.value)
    assert sink.commit(1, [_part(1)]) is CommitResult.COMMITTED
    assert len(broker.producers) == 2


def _writer_error(code: int) -> str:
    writer = KafkaWriter(_sink(), 3)
    return str(writer._error("could not produce", _error(code, "scripted", fatal=True), 1))


@pytest.mark.parametrize("code", [E._FENCED, E.PRODUCER_FENCED, E.INVALID_PRODUCER_EPOCH])
def test_a_writer_fenced_says_so(code: int) -> None:
    assert "was fenced" in _writer_error(code)


@pytest.mark.parametrize("code", [E.INVALID_TXN_STATE, E.TRANSACTIONAL_ID_AUTHORIZATION_FAILED,
                                  E.TOPIC_AUTHORIZATION_FAILED])
def test_a_writer_fatal_error_that_is_no_fencing_says_what_it_is(code: int) -> None:
    text = _writer_error(code)
    assert "fenced" not in text and E(code).name() in text
    if "AUTHORIZATION" in E(code).name():
        assert "grant" in text
