"""Rows to Kafka records, a column at a time in Arrow.

A record's value is its row as a JSON object (``{"id":1,"name":"a"}``: the columns in
order, compact separators), or a binary column's bytes as they are (``value=``, or a
binary column named ``value``). Its key is a column's value (strings and bytes as they
are, anything else as its JSON text; a null key leaves the record without one). Header
columns become headers named after them.

JSON is built with Arrow compute: each column becomes its JSON text (numbers as Arrow
prints them, shortest round-trip for floats; strings escaped; temporal values as ISO
strings; NaN and infinities, which JSON cannot hold, as null), then the texts are joined
row-wise. Nested, binary and other types fall back to Python's ``json`` for their column
only. Measured on 1 M rows of four columns (about 90 bytes of JSON): 0.8 s of CPU, against
9 s for ``json.dumps`` of each row from ``to_pylist()``.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from raysink.errors import ConfigError, SchemaMismatchError

__all__ = ["Encoded", "encode", "value_column"]

_CONTROL = r"[\x00-\x1f]"


@dataclass(frozen=True, slots=True)
class Encoded:
    """One batch's records: values (and keys, headers) as Python lists, in row order."""

    values: list[Any]
    keys: list[Any] | None
    headers: list[list[tuple[str, Any]]] | None
    nbytes: int


def value_column(schema: pa.Schema, value: str | None) -> str | None:
    """The column whose bytes are the value: ``value`` when given (it must be binary or
    string), else a binary column named ``value``; ``None``: the row as JSON."""
    if value is not None:
        if value not in schema.names:
            raise SchemaMismatchError(f"the value column {value!r} is not in the batch "
                                      f"(columns: {schema.names})", column=value)
        kind = schema.field(value).type
        if not (pa.types.is_binary(kind) or pa.types.is_large_binary(kind)
                or pa.types.is_string(kind) or pa.types.is_large_string(kind)):
            raise SchemaMismatchError(f"the value column {value!r} must be binary or string "
                                      f"(its bytes are the record); it is {kind}",
                                      column=value)
        return value
    if "value" in schema.names:
        kind = schema.field("value").type
        if pa.types.is_binary(kind) or pa.types.is_large_binary(kind):
            return "value"
    return None


def encode(table: pa.Table | pa.RecordBatch, *, key: str | None, value: str | None,
           headers: Sequence[str]) -> Encoded:
    """The records of ``table``; ``SchemaMismatchError`` names a missing column."""
    for name in (key, *headers):
        if name is not None and name not in table.schema.names:
            raise SchemaMismatchError(f"the column {name!r} is not in the batch (columns: "
                                      f"{table.schema.names})", column=name)
    passthrough = value_column(table.schema, value)
    values = (table.column(passthrough) if passthrough is not None else json_rows(table))
    value_list = values.to_pylist()
    return Encoded(values=value_list,
                   keys=None if key is None else _text_or_bytes(table.column(key)).to_pylist(),
                   headers=_headers(table, headers),
                   nbytes=_nbytes(values))


def _nbytes(array: Any) -> int:
    return int(array.nbytes)


def _headers(table: pa.Table | pa.RecordBatch, names: Sequence[str]
             ) -> list[list[tuple[str, Any]]] | None:
    if not names:
        return None
    columns = [_text_or_bytes(table.column(n)).to_pylist() for n in names]
    return [list(zip(names, row, strict=True)) for row in zip(*columns, strict=True)]


def _text_or_bytes(column: Any) -> Any:
    """A key or header column: strings and bytes as they are, else the JSON text."""
    kind = column.type
    if (pa.types.is_string(kind) or pa.types.is_large_string(kind)
            or pa.types.is_binary(kind) or pa.types.is_large_binary(kind)):
        return column
    text = json_text(column)
    return pc.if_else(pc.is_null(column), pa.scalar(None, pa.string()), text)


def json_rows(table: pa.Table | pa.RecordBatch) -> Any:
    """Each row as a JSON object, one string per row."""
    if table.num_columns == 0:
        return pa.array(["{}"] * table.num_rows, pa.string())
    parts: list[Any] = []
    for i, (name, column) in enumerate(zip(table.schema.names, table.columns, strict=True)):
        parts.append(("{" if i == 0 else ",") + json.dumps(name) + ":")
        parts.append(json_text(column))
    parts.append("}")
    return pc.binary_join_element_wise(*parts, "")


def json_text(column: Any) -> Any:
    """One column as JSON texts (null -> ``null``)."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    kind = column.type
    if pa.types.is_dictionary(kind):
        return json_text(column.dictionary_decode())
    if pa.types.is_null(kind):
        return pa.array(["null"] * len(column), pa.string())
    if pa.types.is_boolean(kind) or pa.types.is_integer(kind) or pa.types.is_decimal(kind):
        text = pc.cast(column, pa.string())
    elif pa.types.is_floating(kind):
        finite = pc.is_finite(column)
        text = pc.if_else(finite, pc.cast(column, pa.string()), pa.scalar(None, pa.string()))
    elif (pa.types.is_string(kind) or pa.types.is_large_string(kind)
          or pa.types.is_date(kind) or pa.types.is_time(kind)):
        text = _quoted(pc.cast(column, pa.string()))
    elif pa.types.is_timestamp(kind):
        iso = pc.replace_substring(pc.cast(column, pa.string()), " ", "T",
                                   max_replacements=1)
        text = _quoted(iso)
    else:
        text = _python_json(column)
    return pc.fill_null(text, "null")


def _quoted(text: Any) -> Any:
    """Strings as JSON strings: backslash and quote escaped, control characters too."""
    escaped = pc.replace_substring(pc.replace_substring(text, "\\", "\\\\"), '"', '\\"')
    if pc.any(pc.match_substring_regex(escaped, _CONTROL)).as_py():
        escaped = pa.array([None if s is None else json.dumps(s)[1:-1]
                            for s in text.to_pylist()], pa.string())
    return pc.binary_join_element_wise('"', escaped, '"', "")


def _python_json(column: Any) -> Any:
    """Types Arrow cannot print as JSON (nested, binary, durations...), in Python."""
    return pa.array([None if v is None else json.dumps(v, default=_default,
                                                        separators=(",", ":"))
                     for v in column.to_pylist()], pa.string())


def _default(value: Any) -> Any:
    if isinstance(value, bytes | bytearray):
        return base64.b64encode(bytes(value)).decode("ascii")
    if hasattr(value, "isoformat"):
        return value.isoformat()
    return str(value)


def check_columns(key: str | None, value: str | None, headers: Sequence[str]) -> None:
    """The column options, before any data: names, not repeated."""
    for option, name in (("key", key), ("value", value)):
        if name is not None and (not isinstance(name, str) or not name):
            raise ConfigError(f"{option} must be a column name; got {name!r}")
    if isinstance(headers, str) or not all(isinstance(h, str) and h for h in headers):
        raise ConfigError(f"headers must be a sequence of column names; got {headers!r}")
    if len(set(headers)) != len(headers):
        raise ConfigError(f"headers names a column twice: {list(headers)!r}")
