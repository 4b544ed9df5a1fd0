"""What a librdkafka error means for the sink: fencing, a missing ACL, or neither.

librdkafka marks many errors *fatal* for a transactional producer, and only some of them
mean that another producer took the transactional id over. The fencing codes are
``_FENCED`` (librdkafka's own: the broker told it the producer epoch is stale),
``PRODUCER_FENCED`` and ``INVALID_PRODUCER_EPOCH`` (the broker's, before and after
KIP-588). The broker also fences a producer whose transaction outlived
``transaction.timeout.ms``: it aborts the transaction and bumps the epoch, and the
producer's next request gets one of the same codes; the caller tells the two apart by the
transaction's age. ``TRANSACTION_COORDINATOR_FENCED`` is between brokers (a stale
coordinator writing markers), ``INVALID_PRODUCER_ID_MAPPING`` a transactional id the broker
expired: neither is another producer, so neither is fencing.

An authorization failure is the brokers' ACLs refusing this client's principal: retrying
helps once an operator grants the ACL (no restart needed), so the caller raises
``SinkUnavailableError`` (retried with backoff, shown in ``status()``) naming the ACL,
not ``ConfigError`` (nothing in the sink's arguments is wrong, and the pipeline should
resume by itself once the grant is made).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from raysink.sinks.kafka._config import kafka_module

__all__ = ["FENCING", "error_of", "is_fencing", "is_unknown_topic", "missing_acl", "named"]

FENCING = ("_FENCED", "PRODUCER_FENCED", "INVALID_PRODUCER_EPOCH")


def error_of(exc: BaseException) -> Any:
    """The ``KafkaError`` a ``KafkaException`` carries (``None`` for any other error)."""
    error = exc.args[0] if exc.args else None
    return error if callable(getattr(error, "code", None)) else None


def _code(name: str) -> int | None:
    code = getattr(kafka_module().KafkaError, name, None)
    return code if isinstance(code, int) else None


def _is(error: Any, names: Sequence[str]) -> bool:
    return error is not None and error.code() in {_code(n) for n in names} - {None}


def is_fencing(error: Any) -> bool:
    """Whether ``error`` says another producer took the transactional id over (or the
    broker fenced a transaction that outlived its timeout)."""
    return _is(error, FENCING)


def is_unknown_topic(exc: BaseException) -> bool:
    """Whether ``exc``, or the client error it was raised from, says the topic (or its
    partition) does not exist: a deleted topic answers ``UNKNOWN_TOPIC_OR_PART``, one the
    client's metadata lacks ``_NOENT`` ("no leaders found")."""
    names = ("UNKNOWN_TOPIC_OR_PART", "_UNKNOWN_TOPIC", "_UNKNOWN_PARTITION", "_NOENT")
    seen: BaseException | None = exc
    while seen is not None:
        if _is(error_of(seen), names):
            return True
        seen = seen.__cause__
    return False


def named(error: Any) -> str:
    """``NAME: text`` of a ``KafkaError``."""
    try:
        return f"{error.name()}: {error.str()}"
    except Exception:  # not a KafkaError after all
        return str(error)


def missing_acl(error: Any, *, txn: str, topics: Sequence[str]) -> str | None:
    """The ACL to grant when ``error`` is an authorization failure; ``None`` otherwise."""
    if error is None:
        return None
    grant = "kafka-acls.sh --bootstrap-server ... --add --allow-principal User:<principal>"
    if _is(error, ("TRANSACTIONAL_ID_AUTHORIZATION_FAILED",)):
        return (f"the brokers refuse transactional id {txn!r} to this client's principal "
                f"({named(error)}): grant Write and Describe on it ({grant} --operation "
                f"Write --operation Describe --transactional-id {txn}; a prefixed ACL on "
                "the transactional_id_prefix covers every writer and committer of the "
                "sink)")
    if _is(error, ("TOPIC_AUTHORIZATION_FAILED",)):
        return (f"the brokers refuse topic {' or '.join(repr(t) for t in topics)} to this "
                f"client's principal ({named(error)}): grant Write, Read and Describe on "
                f"each ({grant} --operation Write --operation Read --operation Describe "
                f"--topic <topic>)")
    if _is(error, ("CLUSTER_AUTHORIZATION_FAILED",)):
        return (f"the brokers refuse a cluster operation to this client's principal "
                f"({named(error)}): grant IdempotentWrite on the cluster ({grant} "
                "--operation IdempotentWrite --cluster), which idempotent and "
                "transactional producers need on brokers before 2.8")
    return None
