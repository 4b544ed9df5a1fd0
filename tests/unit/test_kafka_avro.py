"""Avro record values built column-wise (``raysink/sinks/kafka/_avro.py``), byte for byte
against a reference encoder that follows the specification one row at a time
(``tests/support/avro.py``); the schema's checks and the errors a batch can meet."""

from __future__ import annotations

import datetime as dt
import decimal
import json
import pickle
from typing import Any

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from raysink.errors import ConfigError, SchemaMismatchError
from raysink.sinks.kafka import _avro
from raysink.sinks.kafka._avro import avro_values
from raysink.sinks.kafka._avroschema import parse
from raysink.sinks.kafka._encode import encode
from tests.support.avro import decode_record, encode_record

INT64 = (-2**63, 2**63 - 1)
EDGES = [0, -1, 1, -64, 63, 64, -65, 8191, 8192, -8193, 2**31 - 1, -2**31, *INT64]


def record(*fields: dict[str, Any]) -> dict[str, Any]:
    return {"type": "record", "name": "Row", "namespace": "t", "fields": list(fields)}


def ours(schema: dict[str, Any], table: pa.Table, schema_id: int | None = None) -> list[bytes]:
    return list(avro_values(table, parse(schema, schema_id)).to_pylist())


def reference(schema: dict[str, Any], table: pa.Table,
              schema_id: int | None = None) -> list[bytes]:
    return [encode_record(schema, row, schema_id) for row in table.to_pylist()]


def assert_same(schema: dict[str, Any], table: pa.Table, schema_id: int | None = None
                ) -> list[bytes]:
    got = ours(schema, table, schema_id)
    assert got == reference(schema, table, schema_id)
    return got


# -- every supported type ------------------------------------------------------------


def test_zigzag_edges_are_the_specifications_bytes() -> None:
    """0, -1, 1, -64, 63, 64 as the specification's table shows them; int64's ends take
    ten bytes."""
    table = pa.table({"n": pa.array(EDGES, pa.int64())})
    got = assert_same(record({"name": "n", "type": "long"}), table)
    assert got[:6] == [b"\x00", b"\x01", b"\x02", b"\x7f", b"\x7e", b"\x80\x01"]
    assert got[-2] == b"\xff" * 9 + b"\x01" and got[-1] == b"\xfe" + b"\xff" * 8 + b"\x01"


DEC = pa.decimal128(12, 3)
CASES = [
    # (avro type, arrow column): one per supported type and Arrow source
    ("boolean", pa.array([True, False, True])),
    ("int", pa.array([0, -1, 2**31 - 1, -2**31], pa.int32())),
    ("int", pa.array([0, 200, 255], pa.uint8())),
    ("long", pa.array(EDGES, pa.int64())),
    ("float", pa.array([0.0, -1.5, 3.25, float("inf")], pa.float32())),
    ("double", pa.array([0.1, -2.5e300, float("-inf"), 7.0])),
    ("double", pa.array([1, -2, 3], pa.int64())),
    ("string", pa.array(["", "a", "héllo wörld ✓", "日本語", "\x00\n\"\\"])),
    ("string", pa.array(["x", "", "yy"], pa.large_string())),
    ("string", pa.array(["b", "a", "b", "b"]).dictionary_encode()),
    ("bytes", pa.array([b"", b"\x00\xff", b"abc" * 50])),
    ("bytes", pa.array(["as", "text"])),
    ("bytes", pa.array([b"ab", b"cd"], pa.binary(2))),
    ({"type": "fixed", "name": "F", "size": 3}, pa.array([b"abc", b"\x00\x01\x02"], pa.binary(3))),
    ({"type": "fixed", "name": "F", "size": 2}, pa.array([b"ab", b"cd"])),
    ({"type": "enum", "name": "E", "symbols": ["A", "B", "C"]}, pa.array(["C", "A", "B"])),
    ({"type": "enum", "name": "E", "symbols": ["A", "B"]},
     pa.array(["B", "A", "B"]).dictionary_encode()),
    ({"type": "int", "logicalType": "date"},
     pa.array([dt.date(1970, 1, 1), dt.date(1969, 12, 31), dt.date(2026, 11, 29)])),
    ({"type": "int", "logicalType": "date"},
     pa.array([dt.date(2000, 1, 1), dt.date(1900, 3, 1)], pa.date64())),
    ({"type": "int", "logicalType": "time-millis"},
     pa.array([dt.time(0, 0), dt.time(23, 59, 59, 999000)], pa.time32("ms"))),
    ({"type": "long", "logicalType": "time-micros"},
     pa.array([dt.time(12, 0, 0, 1), dt.time(1, 2, 3)], pa.time64("us"))),
    ({"type": "long", "logicalType": "timestamp-millis"},
     pa.array([dt.datetime(2026, 11, 29, 8, 0, 0, 123000), dt.datetime(1960, 1, 1)],
              pa.timestamp("ms"))),
    ({"type": "long", "logicalType": "timestamp-micros"},
     pa.array([dt.datetime(2026, 11, 29, 8, 0, 0, 123456, tzinfo=dt.UTC),
               dt.datetime(1969, 12, 31, 23, 59, 59, 999999, tzinfo=dt.UTC)],
              pa.timestamp("us", "UTC"))),
    ({"type": "long", "logicalType": "timestamp-micros"},
     pa.array([dt.datetime(2001, 2, 3, 4, 5, 6)], pa.timestamp("s"))),
    ({"type": "long", "logicalType": "local-timestamp-millis"},
     pa.array([dt.datetime(2001, 2, 3, 4, 5, 6, 7000)], pa.timestamp("us"))),
    ({"type": "bytes", "logicalType": "decimal", "precision": 12, "scale": 3},
     pa.array([decimal.Decimal(x) for x in ("0", "-0.128", "0.127", "0.128", "-0.129",
                                            "-0.001", "999999999.999", "-999999999.999")],
              DEC)),
    ({"type": "fixed", "name": "D", "size": 6, "logicalType": "decimal", "precision": 12,
      "scale": 3},
     pa.array([decimal.Decimal(x) for x in ("0", "-0.001", "1.5", "-999999999.999")], DEC)),
    ({"type": "fixed", "name": "D", "size": 20, "logicalType": "decimal", "precision": 12,
      "scale": 3}, pa.array([decimal.Decimal("-1.5"), decimal.Decimal("2")], DEC)),
    ({"type": "string", "logicalType": "uuid"},
     pa.array(["4b1e4e1e-0c1d-4a1c-8b47-000000000001"])),
    ({"type": "string", "logicalType": "date"}, pa.array(["not a date: ignored"])),
]


@pytest.mark.parametrize(("avro", "column"), CASES, ids=lambda c: str(getattr(c, "type", c)))
def test_each_type_as_the_reference_encodes_it(avro: Any, column: pa.Array) -> None:
    table = pa.table({"v": column, "other": pa.array(range(len(column)))})
    assert_same(record({"name": "v", "type": avro}), table)


@pytest.mark.parametrize("first_null", [True, False])
@pytest.mark.parametrize(("avro", "column"), CASES, ids=lambda c: str(getattr(c, "type", c)))
def test_each_type_nullable_in_a_union(avro: Any, column: pa.Array, first_null: bool) -> None:
    """Every other row null, in ``["null", T]`` and ``[T, "null"]``: the branch index then
    the value, or nothing for null."""
    values = column.to_pylist()
    kind = column.type.value_type if pa.types.is_dictionary(column.type) else column.type
    holed = pa.array([None if i % 2 else v for i, v in enumerate(values * 2)], kind)
    union = ["null", avro] if first_null else [avro, "null"]
    assert_same(record({"name": "v", "type": union}), pa.table({"v": holed}))


def test_the_fields_in_the_schemas_order_from_columns_in_any() -> None:
    table = pa.table({"c": ["x", "y"], "extra": [1.0, 2.0], "a": [1, 2], "b": [True, False]})
    schema = record({"name": "a", "type": "long"}, {"name": "b", "type": "boolean"},
                    {"name": "c", "type": "string"})
    assert_same(schema, table)
    assert ours(schema, table)[0] == b"\x02\x01\x02x"


def test_schema_registry_framing() -> None:
    """Magic byte 0, the id as 4 big-endian bytes, then the body."""
    table = pa.table({"n": [1, -1]})
    got = assert_same(record({"name": "n", "type": "long"}), table, schema_id=0x01020304)
    assert got == [b"\x00\x01\x02\x03\x04\x02", b"\x00\x01\x02\x03\x04\x01"]


def test_a_missing_column_takes_its_fields_default() -> None:
    schema = record({"name": "id", "type": "long"},
                    {"name": "n", "type": "int", "default": -3},
                    {"name": "s", "type": ["null", "string"], "default": None},
                    {"name": "t", "type": ["string", "null"], "default": "dé"},
                    {"name": "b", "type": "bytes", "default": "\u00ff\u0000"},
                    {"name": "e", "type": {"type": "enum", "name": "E", "symbols": ["P", "Q"]},
                     "default": "Q"},
                    {"name": "f", "type": "double", "default": 1.5},
                    {"name": "z", "type": "null"})
    assert_same(schema, pa.table({"id": [1, 2, 3]}))


def test_an_empty_batch_and_one_field_of_nothing_but_nulls() -> None:
    schema = record({"name": "s", "type": ["null", "string"]})
    assert ours(schema, pa.table({"s": pa.array([], pa.string())})) == []
    assert_same(schema, pa.table({"s": pa.array([None, None], pa.string())}))


def test_sliced_chunked_and_many_slices(monkeypatch: pytest.MonkeyPatch) -> None:
    """Arrays with an offset (a slice of a batch), columns in chunks, and records laid in
    slices of rows (``_SLICE`` made small) come out as one array in row order."""
    monkeypatch.setattr(_avro, "_SLICE", 7)
    rows = 100
    base = pa.table({
        "s": pa.array([None if i % 5 == 0 else "x" * (i % 9) for i in range(rows)]),
        "d": pa.array([decimal.Decimal(i - 50).scaleb(-3) for i in range(rows)], DEC),
        "f": pa.array([bytes([i % 256]) * 2 for i in range(rows)], pa.binary(2)),
        "n": pa.array([i * 99_991 - 3_000_000 for i in range(rows)]),
    })
    schema = record({"name": "s", "type": ["null", "string"]},
                    {"name": "d", "type": {"type": "bytes", "logicalType": "decimal",
                                           "precision": 12, "scale": 3}},
                    {"name": "f", "type": {"type": "fixed", "name": "F", "size": 2}},
                    {"name": "n", "type": "long"})
    assert_same(schema, base.slice(13, 61))
    chunked = pa.concat_tables([base.slice(0, 30), base.slice(30)])
    assert chunked.column("s").num_chunks == 2
    assert_same(schema, chunked)


# -- random tables against the reference ---------------------------------------------

_TEXT = st.text(st.characters(exclude_categories=("Cs",)), max_size=12)
_FIELDS: list[tuple[Any, pa.DataType, st.SearchStrategy[Any]]] = [
    ("boolean", pa.bool_(), st.booleans()),
    ("int", pa.int32(), st.integers(-2**31, 2**31 - 1)),
    ("long", pa.int64(), st.integers(*INT64)),
    ("float", pa.float32(), st.floats(width=32, allow_nan=False)),
    ("double", pa.float64(), st.floats(allow_nan=False)),
    ("string", pa.string(), _TEXT),
    ("bytes", pa.binary(), st.binary(max_size=20)),
    ({"type": "fixed", "name": "F4", "size": 4}, pa.binary(4), st.binary(min_size=4, max_size=4)),
    ({"type": "enum", "name": "Co", "symbols": ["RED", "GREEN", "BLUE"]}, pa.string(),
     st.sampled_from(["RED", "GREEN", "BLUE"])),
    ({"type": "int", "logicalType": "date"}, pa.date32(),
     st.dates(dt.date(1800, 1, 1), dt.date(2200, 1, 1))),
    ({"type": "long", "logicalType": "timestamp-micros"}, pa.timestamp("us"),
     st.datetimes(dt.datetime(1900, 1, 1), dt.datetime(2100, 1, 1))),
    ({"type": "bytes", "logicalType": "decimal", "precision": 18, "scale": 4},
     pa.decimal128(18, 4),
     st.integers(-10**18 + 1, 10**18 - 1).map(lambda n: decimal.Decimal(n).scaleb(-4))),
]


@st.composite
def tables(draw: st.DrawFn) -> tuple[dict[str, Any], pa.Table]:
    rows = draw(st.integers(0, 40))
    chosen = draw(st.lists(st.integers(0, len(_FIELDS) - 1), min_size=1, max_size=8))
    fields, columns = [], {}
    for i, which in enumerate(chosen):
        avro, kind, values = _FIELDS[which]
        if isinstance(avro, dict) and "name" in avro:
            avro = {**avro, "name": f"{avro['name']}{i}"}
        nullable = draw(st.sampled_from([None, "first", "last"]))
        cells = draw(st.lists(values | st.none() if nullable else values,
                              min_size=rows, max_size=rows))
        fields.append({"name": f"f{i}", "type": avro if nullable is None else
                       (["null", avro] if nullable == "first" else [avro, "null"])})
        columns[f"f{i}"] = pa.array(cells, kind)
    return record(*fields), pa.table(columns)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tables(), st.sampled_from([None, 0, 2**31 - 1]))
def test_random_tables_byte_for_byte(case: tuple[dict[str, Any], pa.Table],
                                     schema_id: int | None) -> None:
    schema, table = case
    got = assert_same(schema, table, schema_id)
    for row, value in zip(table.to_pylist(), got, strict=True):
        back = decode_record(schema, value, schema_id)
        assert set(back) == set(row)


# -- through the sink's options ------------------------------------------------------


def test_kafka_sink_takes_value_format_avro() -> None:
    from raysink.sinks import KafkaSink

    schema = record({"name": "id", "type": "long"}, {"name": "name", "type": "string"})
    sink = KafkaSink("localhost:1", "t", key="name", value_format="avro",
                     avro_schema=json.dumps(schema), schema_id=5)
    sink = pickle.loads(pickle.dumps(sink))
    table = pa.table({"id": [1, 2], "name": ["a", "b"]})
    encoded = encode(table, key=sink.key_column, value=sink.value_source,
                     headers=sink.headers)
    assert encoded.values == reference(schema, table, 5)
    assert encoded.keys == ["a", "b"]
    assert pa.types.is_binary(encoded.value_array.type)


@pytest.mark.parametrize(("options", "said"), [
    # value_format unknown
    ({"value_format": "protobuf"}, "value_format must be"),
    # avro without a schema
    ({"value_format": "avro"}, "needs avro_schema"),
    # a schema without avro
    ({"avro_schema": record({"name": "a", "type": "long"})}, "go with value_format='avro'"),
    # a pass-through column and avro at once
    ({"value_format": "avro", "value": "v", "avro_schema": record({"name": "a",
                                                                    "type": "long"})},
     "give one of them"),
])
def test_kafka_sink_refuses_contradicting_value_options(options: dict[str, Any],
                                                        said: str) -> None:
    from raysink.sinks import KafkaSink

    with pytest.raises(ConfigError, match=said):
        KafkaSink("localhost:1", "t", **options)


@pytest.mark.parametrize(("schema", "said"), [
    # not JSON
    ("{not json", "not valid JSON"),
    # not a record
    ({"type": "enum", "name": "E", "symbols": ["A"]}, "must be an Avro record schema"),
    # no fields
    (record(), "must list its fields"),
    # nested types: refused, naming the field and the way out
    (record({"name": "xs", "type": {"type": "array", "items": "long"}}),
     r"field 'xs' .* 'array'.*value="),
    (record({"name": "m", "type": {"type": "map", "values": "long"}}), r"field 'm' .*'map'"),
    (record({"name": "r", "type": record({"name": "a", "type": "long"})}),
     r"field 'r' .*'record'"),
    (record({"name": "u", "type": ["null", "long", "string"]}), r"field 'u' .* union"),
    # an unknown named type
    (record({"name": "x", "type": "Nope"}), "'Nope'"),
    # a field twice, a field without a name
    (record({"name": "a", "type": "long"}, {"name": "a", "type": "int"}), "twice"),
    (record({"type": "long"}), "needs a name"),
    # a default that does not fit
    (record({"name": "a", "type": "int", "default": "x"}), r"field 'a' .*default"),
    (record({"name": "a", "type": ["null", "int"], "default": 3}), r"field 'a' .*default"),
    (record({"name": "e", "type": {"type": "enum", "name": "E", "symbols": ["A", "A"]}}),
     "distinct symbols"),
])
def test_schemas_refused_at_construction(schema: Any, said: str) -> None:
    with pytest.raises(ConfigError, match=said):
        parse(schema)


@pytest.mark.parametrize("schema_id", [-1, 2**31, True, "7"])
def test_a_schema_id_out_of_range_is_refused(schema_id: Any) -> None:
    with pytest.raises(ConfigError, match="schema_id"):
        parse(record({"name": "a", "type": "long"}), schema_id)


@pytest.mark.parametrize(("avro", "column", "said"), [
    # no column and no default
    ("long", None, "no column in the batch and no default"),
    # a type that cannot be encoded as the field
    ("long", pa.array(["1"]), "needs an integer column"),
    ("string", pa.array([1]), "needs a string column"),
    ("boolean", pa.array([1]), "needs a bool column"),
    ({"type": "long", "logicalType": "timestamp-millis"}, pa.array([1]), "timestamp"),
    # nulls in a field that is not a union with null
    ("long", pa.array([1, None]), r"not nullable.*1 nulls"),
    # out of an int's range
    ("int", pa.array([2**31]), "outside it"),
    # an enum value not among the symbols
    ({"type": "enum", "name": "E", "symbols": ["A"]}, pa.array(["A", "B"]), r"\['B'\]"),
    # a fixed of the wrong size
    ({"type": "fixed", "name": "F", "size": 2}, pa.array([b"abc"]), "3 bytes"),
    ({"type": "fixed", "name": "F", "size": 2}, pa.array([b"abc"], pa.binary(3)),
     "fixed_size_binary"),
    # finer than the unit: refused, not cut
    ({"type": "long", "logicalType": "timestamp-micros"},
     pa.array([1_500], pa.timestamp("ns")), "round or cast"),
    # a decimal of another scale or more digits
    ({"type": "bytes", "logicalType": "decimal", "precision": 5, "scale": 2},
     pa.array([decimal.Decimal("1.5")], pa.decimal128(5, 1)), r"decimal128\(5, 2\)"),
    ({"type": "bytes", "logicalType": "decimal", "precision": 3, "scale": 0},
     pa.array([decimal.Decimal(1)], pa.decimal128(4, 0)), "at most its precision"),
])
def test_batches_refused_naming_the_field(avro: Any, column: pa.Array | None,
                                          said: str) -> None:
    table = pa.table({"other": [0] * (1 if column is None else len(column))})
    if column is not None:
        table = table.append_column("v", column)
    with pytest.raises(SchemaMismatchError, match=said) as info:
        avro_values(table, parse(record({"name": "v", "type": avro})))
    assert info.value.column == "v"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tables())
def test_random_tables_as_fastavro_writes_them(case: tuple[dict[str, Any], pa.Table]) -> None:
    """A second oracle: fastavro (in the dev extra, so ``make test`` runs it; the compat
    venv has no fastavro and skips it)."""
    fastavro = pytest.importorskip("fastavro")
    import io

    schema, table = case
    parsed = fastavro.parse_schema(json.loads(json.dumps(schema)))
    want = []
    for row in table.to_pylist():
        buffer = io.BytesIO()
        fastavro.schemaless_writer(buffer, parsed, row)
        want.append(buffer.getvalue())
    assert ours(schema, table) == want
