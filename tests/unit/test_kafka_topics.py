"""Whether a Kafka topic exists, as the sink's ``Topics`` tells it from the cluster's
metadata: a topic is gone only when a new client is told so too, and any other error of
the topic is Kafka unavailable (tried again), never a deleted topic.

A clean-clone run of ``tests/kafka/test_kafka_faults.py`` (the broker SIGKILLed while
epoch 2 was written) saw the coordinator take the progress marker for gone for two
minutes after the broker came back: every commit of the epoch failed with
``DataLossError`` and the sink stalled for good. The admin clients here answer from a
script, so each case is met on demand."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

confluent_kafka = pytest.importorskip("confluent_kafka")
pytest.importorskip("confluent_kafka.admin")

from raysink.errors import SinkUnavailableError  # noqa: E402
from raysink.sinks import KafkaSink  # noqa: E402
from raysink.sinks.kafka._progress import Topics  # noqa: E402

KafkaError = confluent_kafka.KafkaError
TOPIC = "orders"


def _answer(error: int | None, *, listed: bool = True) -> Any:
    """``list_topics``'s answer: the topic with ``error`` (``None``: none), or not listed."""
    topic = SimpleNamespace(error=None if error is None else KafkaError(error),
                            partitions={0: object()})
    return SimpleNamespace(topics={TOPIC: topic} if listed else {})


class _Admin:
    """An admin client answering ``list_topics`` from its own script."""

    def __init__(self, answers: Iterator[Any], made: list[_Admin]) -> None:
        self.answers, self.asked = answers, 0
        made.append(self)

    def list_topics(self, topic: str, timeout: float) -> Any:
        assert topic == TOPIC
        self.asked += 1
        return next(self.answers)


def _topics(monkeypatch: pytest.MonkeyPatch, *answers: Any) -> tuple[Topics, list[_Admin]]:
    """A ``Topics`` whose every new admin client gives the next of ``answers``."""
    made: list[_Admin] = []
    script = iter(answers)
    monkeypatch.setattr("confluent_kafka.admin.AdminClient",
                        lambda config: _Admin(script, made))
    return Topics(KafkaSink("127.0.0.1:9", TOPIC).settings), made


def test_a_listed_topic_exists_with_one_question(monkeypatch: pytest.MonkeyPatch) -> None:
    topics, made = _topics(monkeypatch, _answer(None))
    assert topics.exists(TOPIC)
    assert [admin.asked for admin in made] == [1]


def test_a_stale_client_saying_unknown_is_asked_again_with_a_new_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    topics, made = _topics(monkeypatch, _answer(KafkaError.UNKNOWN_TOPIC_OR_PART),
                           _answer(None))
    assert topics.exists(TOPIC)
    assert len(made) == 2


@pytest.mark.parametrize("listed", [True, False])
def test_a_topic_is_gone_when_a_new_client_says_so_too(
        monkeypatch: pytest.MonkeyPatch, listed: bool) -> None:
    unknown = _answer(KafkaError.UNKNOWN_TOPIC_OR_PART, listed=listed)
    topics, made = _topics(monkeypatch, unknown, unknown, unknown, unknown)
    assert not topics.exists(TOPIC)
    assert topics.describe(TOPIC) is None
    # each question asked the client at hand, then a new one
    assert [admin.asked for admin in made] == [1, 2, 1]


@pytest.mark.parametrize("error", [KafkaError.LEADER_NOT_AVAILABLE,
                                   KafkaError.NOT_LEADER_FOR_PARTITION])
def test_another_error_of_the_topic_is_kafka_unavailable_not_a_deleted_topic(
        monkeypatch: pytest.MonkeyPatch, error: int) -> None:
    topics, _ = _topics(monkeypatch, _answer(error), _answer(error))
    with pytest.raises(SinkUnavailableError, match="could not describe topic 'orders'"):
        topics.exists(TOPIC)
