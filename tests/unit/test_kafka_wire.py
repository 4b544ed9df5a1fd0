"""The Kafka wire encoding raysink speaks itself (``raysink.sinks.kafka._wire``): record
batches parsed back as written, with their producer, control and compression bits."""

from __future__ import annotations

import pytest

from raysink.sinks.kafka import _wire
from tests.support.kafka_hanging import crc32c, record_batch

pytestmark = pytest.mark.unit


def test_crc32c_known_value() -> None:
    assert crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value


def test_batches_parse_back_with_producer_and_records() -> None:
    raw = (record_batch(7, 0, 0, [(b"raysink:r:main", b'{"epoch":1}'), (None, b"x")])
           + record_batch(9, 2, 0, [(b"k", b"")]))
    first, second = _wire.parse_batches(raw)
    assert (first.producer_id, first.transactional, first.control) == (7, True, False)
    assert first.records == [(0, b"raysink:r:main", b'{"epoch":1}'), (1, None, b"x")]
    assert first.last_offset == 1
    assert second.producer_id == 9 and second.records == [(0, b"k", b"")]


def test_a_partial_batch_at_the_end_is_left_out() -> None:
    raw = record_batch(7, 0, 0, [(b"k", b"v")])
    assert _wire.parse_batches(raw + raw[:30]) == _wire.parse_batches(raw)


def test_compact_encodings_read_back() -> None:
    reader = _wire.Reader(_wire.compact_string("topic") + _wire.compact_string(None)
                          + _wire.compact_array([b"", b""]))
    assert reader.compact_string() == "topic"
    assert reader.compact_string() is None
    assert reader.array_length() == 2
