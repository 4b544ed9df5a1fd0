"""Where the test cluster looks for a transactional id's coordinator
(``tests/support/kafka_cluster.py``): Kafka places an id on ``__transaction_state``
partition ``Utils.abs(id.hashCode()) % partitions``, with Java's ``String.hashCode``."""

from __future__ import annotations

from tests.support.kafka_cluster import java_string_hash, transaction_partition


def test_java_string_hash_matches_java() -> None:
    # values of String.hashCode as a JVM computes them
    assert java_string_hash("") == 0
    assert java_string_hash("hello") == 99162322
    assert java_string_hash("Aa") == java_string_hash("BB") == 2112
    assert java_string_hash("raysink.abc.main.c") < 0  # overflows to a negative int
    assert java_string_hash("polygenelubricants") == -(2**31)
    assert java_string_hash("\U0001f600") == 55357 * 31 + 56832  # two UTF-16 units


def test_transaction_partition_uses_kafkas_abs() -> None:
    assert transaction_partition("polygenelubricants", 6) == 0  # Utils.abs(MIN_VALUE) is 0
    value = java_string_hash("raysink.abc.main.c")
    assert transaction_partition("raysink.abc.main.c", 6) == abs(value) % 6
    # seen on a 6-partition cluster: the coordinator's log named __transaction_state-1
    assert transaction_partition("raysink.abc.main.c", 6) == 1
