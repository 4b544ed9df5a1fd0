"""KafkaSink's options and its row encoding, without a broker."""

from __future__ import annotations

import datetime
import json
import math
import sys
from typing import Any

import pyarrow as pa
import pytest

from raysink.errors import ConfigError, SchemaMismatchError
from raysink.sinks import KafkaSink
from raysink.sinks.kafka._encode import encode


def _sink(**options: Any) -> KafkaSink:
    return KafkaSink("127.0.0.1:9", "orders", **options)


@pytest.mark.parametrize("setting", [
    {"transactional.id": "mine"},  # raysink derives one per writer slot
    {"enable.idempotence": False},  # transactions need the idempotent producer
    {"acks": 1},  # durable only once every in-sync replica has it
    {"request.required.acks": "0"},
    {"max.in.flight.requests.per.connection": 10},  # order needs at most 5
    {"retries": 0},  # the idempotent producer must retry
    {"isolation.level": "read_uncommitted"},  # a consumer setting
    {"allow.auto.create.topics": True},  # the sink creates its topics itself
    {"bootstrap.servers": "elsewhere:9092"},  # the first argument says where
    {"transaction.timeout.ms": 1000},  # transaction_timeout= says it
    {"on_delivery": print},  # raysink installs its own callbacks
])
def test_producer_settings_exactly_once_needs_are_refused(setting: dict[str, Any]) -> None:
    name = next(iter(setting))
    with pytest.raises(ConfigError, match=name.replace(".", r"\.")):
        _sink(producer_config=setting)


def test_producer_settings_that_agree_pass_through() -> None:
    sink = _sink(producer_config={"acks": "all", "linger.ms": 20, "compression.type": "lz4",
                                  "enable.idempotence": True, "max.in.flight": 5})
    config = sink.settings.producer_config("raysink.rt.main.w0")
    assert config["linger.ms"] == "20" and config["compression.type"] == "lz4"
    assert config["transactional.id"] == "raysink.rt.main.w0"
    assert config["transaction.timeout.ms"] == 900_000


@pytest.mark.parametrize(("options", "match"), [
    ({"client_config": {"group.id": "x"}}, "group.id"),  # the sink sets it per client
    ({"progress_topic": "orders"}, "progress_topic must differ"),
    ({"topic_config": {"cleanup.policy": "compact"}}, "cleanup.policy"),
    ({"partitions": 0}, "partitions"),
    ({"replication_factor": -1}, "replication_factor"),
    ({"transaction_timeout": 0}, "transaction_timeout"),
    ({"transaction_timeout": 7200}, "transaction_timeout"),
    ({"early_start_records": 0}, "early_start_records"),
    ({"early_start_records": 2.5}, "early_start_records"),
    ({"early_start_records": True}, "early_start_records"),
    ({"early_start_records": "100"}, "early_start_records"),
    ({"transactional_id_prefix": "a b"}, "transactional_id_prefix"),
    ({"key": ""}, "key"),
    ({"headers": "trace"}, "headers"),
    ({"headers": ["a", "a"]}, "twice"),
    ({"topci": "x"}, "topci"),  # a misspelt option names the ones there are
])
def test_refused_options(options: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        _sink(**options)


def test_the_early_start_is_off_unless_set() -> None:
    """Measured slower on two cores (docs/kafka.md, "Measured, and why it is off")."""
    assert _sink().early_start_records is None
    assert _sink(early_start_records=50_000).early_start_records == 50_000


def test_bad_topic_name_is_refused() -> None:
    with pytest.raises(ConfigError, match="topic name"):
        KafkaSink("127.0.0.1:9", "no spaces please")


def test_missing_client_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "confluent_kafka", None)
    with pytest.raises(ConfigError, match=r"raysink\[kafka\]"):
        _sink()


def test_rows_become_json_values_keys_and_headers() -> None:
    table = pa.table({
        "id": pa.array([1, None, 3], pa.int64()),
        "text": ['q"uote\\slash', "new\nline\x01", None],
        "x": [1.5, math.nan, 1e20],
        "ok": [True, False, None],
        "at": pa.array([datetime.datetime(2024, 1, 2, 3, 4, 5, 6)] * 3),
        "tags": [["a"], None, []],
        "raw": [b"\x00", None, b"z"],
    })
    encoded = encode(table, key="id", value=None, headers=["text"])
    rows = [json.loads(v) for v in encoded.values]
    assert rows[0] == {"id": 1, "text": 'q"uote\\slash', "x": 1.5, "ok": True,
                       "at": "2024-01-02T03:04:05.000006", "tags": ["a"], "raw": "AA=="}
    assert rows[1]["text"] == "new\nline\x01" and rows[1]["x"] is None  # NaN: no JSON
    assert rows[2]["x"] == 1e20 and rows[2]["tags"] == []
    assert encoded.keys == ["1", None, "3"]
    assert encoded.headers is not None and encoded.headers[1] == [("text", "new\nline\x01")]


def test_a_binary_value_column_passes_through() -> None:
    table = pa.table({"k": ["a", "b"], "value": pa.array([b"\x01", b"\x02"])})
    assert encode(table, key="k", value=None, headers=()).values == [b"\x01", b"\x02"]
    with pytest.raises(SchemaMismatchError, match="must be binary or string"):
        encode(pa.table({"n": [1]}), key=None, value="n", headers=())
    with pytest.raises(SchemaMismatchError, match="not in the batch"):
        encode(table, key="missing", value=None, headers=())
