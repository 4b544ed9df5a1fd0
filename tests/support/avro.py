"""A slow reference Avro codec for the tests: one record at a time, in plain Python, from
the specification's binary encoding (not from raysink's encoder), reading the schema
dict itself. ``encode_record`` writes a row (a dict of Python values, as Arrow's
``to_pylist`` gives them); ``decode_record`` reads one back.

Binary encoding, as the specification gives it: ``int``/``long`` zigzag then base-128
varint, low groups first; ``float``/``double`` IEEE 754 little-endian; ``bytes``/``string``
a long length then the bytes (UTF-8); ``boolean`` one byte; ``null`` nothing; ``enum`` the
symbol's index as an int; ``fixed`` its bytes; a union the branch index as a long, then
the value; a record its fields in order. Logical types: ``date`` days since 1970-01-01,
``time-*`` and ``timestamp-*`` milli- or microseconds, ``decimal`` the unscaled integer in
big-endian two's complement (as few bytes as hold it for ``bytes``, sign-extended for
``fixed``).
"""

from __future__ import annotations

import datetime as dt
import decimal
import struct
from typing import Any

EPOCH = dt.datetime(1970, 1, 1)
EPOCH_UTC = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
_UNIT = {"time-millis": 1_000, "time-micros": 1, "timestamp-millis": 1_000,
         "timestamp-micros": 1, "local-timestamp-millis": 1_000,
         "local-timestamp-micros": 1}
_ON = {"date": ("int",), "time-millis": ("int",), "time-micros": ("long",),
       "timestamp-millis": ("long",), "timestamp-micros": ("long",),
       "local-timestamp-millis": ("long",), "local-timestamp-micros": ("long",),
       "decimal": ("bytes", "fixed"), "uuid": ("string",)}


def _logical(schema: dict[str, Any]) -> str | None:
    """The logical type where valid on its type (the specification: else ignored)."""
    logical = schema.get("logicalType")
    return logical if schema["type"] in _ON.get(logical, ()) else None


def long_bytes(value: int) -> bytes:
    number = (value << 1) if value >= 0 else ((-value) << 1) - 1
    out = b""
    while True:
        low = number & 0x7F
        number >>= 7
        if number:
            out += bytes([low | 0x80])
        else:
            return out + bytes([low])


def _micros(value: Any) -> int:
    if isinstance(value, dt.datetime):
        start = EPOCH_UTC if value.tzinfo is not None else EPOCH
        delta = value - start
        return (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds
    if isinstance(value, dt.time):
        return ((value.hour * 60 + value.minute) * 60 + value.second) * 1_000_000 \
            + value.microsecond
    raise TypeError(value)


def _unscaled(value: decimal.Decimal, scale: int) -> int:
    return int(value.scaleb(scale).to_integral_exact())


def _twos(number: int, size: int | None) -> bytes:
    if size is None:
        size = ((~number if number < 0 else number).bit_length() + 8) // 8
    return number.to_bytes(size, "big", signed=True)


def encode_value(schema: Any, value: Any, named: dict[str, Any]) -> bytes:
    if isinstance(schema, list):
        for index, branch in enumerate(schema):
            if (branch == "null") == (value is None):
                return long_bytes(index) + encode_value(branch, value, named)
        raise ValueError(f"no branch of {schema} for {value!r}")
    if isinstance(schema, str) and schema in named:
        schema = named[schema]
    if isinstance(schema, dict):
        kind = schema["type"]
        if "name" in schema:
            named[schema["name"]] = schema
        logical = _logical(schema)
        if logical == "date":
            return long_bytes((value - dt.date(1970, 1, 1)).days)
        if logical in _UNIT:
            micros = _micros(value)
            assert micros % _UNIT[logical] == 0
            return long_bytes(micros // _UNIT[logical])
        if logical == "decimal":
            body = _twos(_unscaled(value, schema.get("scale", 0)),
                         schema["size"] if kind == "fixed" else None)
            return body if kind == "fixed" else long_bytes(len(body)) + body
        if kind == "enum":
            return long_bytes(schema["symbols"].index(value))
        if kind == "fixed":
            assert len(value) == schema["size"]
            return bytes(value)
        return encode_value(kind, value, named)
    if schema == "null":
        return b""
    if schema == "boolean":
        return b"\x01" if value else b"\x00"
    if schema in ("int", "long"):
        return long_bytes(int(value))
    if schema == "float":
        return struct.pack("<f", value)
    if schema == "double":
        return struct.pack("<d", value)
    data = value.encode("utf-8") if isinstance(value, str) else bytes(value)
    return long_bytes(len(data)) + data


def encode_record(schema: dict[str, Any], row: dict[str, Any],
                  schema_id: int | None = None) -> bytes:
    """One record; a field missing from ``row`` takes its default."""
    named: dict[str, Any] = {}
    out = b"" if schema_id is None else b"\x00" + struct.pack(">I", schema_id)
    for field in schema["fields"]:
        value = row[field["name"]] if field["name"] in row else _from_default(field)
        out += encode_value(field["type"], value, named)
    return out


def _from_default(field: dict[str, Any]) -> Any:
    value = field.get("default")
    kind = field["type"]
    if isinstance(kind, list):
        kind = kind[0]
    if kind == "bytes" or (isinstance(kind, dict) and kind["type"] in ("bytes", "fixed")):
        return value.encode("latin-1")
    return value


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data, self.at = data, 0

    def take(self, count: int) -> bytes:
        chunk = self.data[self.at:self.at + count]
        assert len(chunk) == count, "record ends early"
        self.at += count
        return chunk

    def long(self) -> int:
        shift = number = 0
        while True:
            byte = self.take(1)[0]
            number |= (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                return (number >> 1) ^ -(number & 1)


def decode_value(schema: Any, reader: _Reader, named: dict[str, Any]) -> Any:
    if isinstance(schema, list):
        return decode_value(schema[reader.long()], reader, named)
    if isinstance(schema, str) and schema in named:
        schema = named[schema]
    if isinstance(schema, dict):
        kind = schema["type"]
        if "name" in schema:
            named[schema["name"]] = schema
        logical = _logical(schema)
        if logical == "date":
            return dt.date(1970, 1, 1) + dt.timedelta(days=reader.long())
        if logical in _UNIT:
            return reader.long() * _UNIT[logical]  # microseconds
        if logical == "decimal":
            size = schema["size"] if kind == "fixed" else reader.long()
            number = int.from_bytes(reader.take(size), "big", signed=True)
            return decimal.Decimal(number).scaleb(-schema.get("scale", 0))
        if kind == "enum":
            return schema["symbols"][reader.long()]
        if kind == "fixed":
            return reader.take(schema["size"])
        return decode_value(kind, reader, named)
    if schema == "null":
        return None
    if schema == "boolean":
        return reader.take(1) == b"\x01"
    if schema in ("int", "long"):
        return reader.long()
    if schema == "float":
        return struct.unpack("<f", reader.take(4))[0]
    if schema == "double":
        return struct.unpack("<d", reader.take(8))[0]
    data = reader.take(reader.long())
    return data.decode("utf-8") if schema == "string" else data


def decode_record(schema: dict[str, Any], data: bytes,
                  schema_id: int | None = None) -> dict[str, Any]:
    """One record back (the whole of ``data``, framing checked when ``schema_id``)."""
    if schema_id is not None:
        assert data[:5] == b"\x00" + struct.pack(">I", schema_id), data[:5]
        data = data[5:]
    reader, named = _Reader(data), {}
    row = {f["name"]: decode_value(f["type"], reader, named) for f in schema["fields"]}
    assert reader.at == len(data), "bytes left after the record"
    return row
