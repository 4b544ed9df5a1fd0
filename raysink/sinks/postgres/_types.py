"""PostgreSQL's side of the types: ``psycopg`` imported lazily, Arrow types as
PostgreSQL stores them (``arrow_to_postgres_type``; ``pg_type`` as ``format_type`` names
them; ``as_arrow`` back), the widenings PostgreSQL applies (``rules``), which existing
column accepts which values (``compatible``), and Arrow data as CSV for ``COPY``.

The bottom of the package: it imports no other module of it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Hashable
from typing import Any

import pyarrow as pa

from raysink import _schema
from raysink.errors import ConfigError, SchemaMismatchError
from raysink.protocol.requirements import check_extra

__all__ = ["INSTALL", "arrow_to_postgres_type", "as_arrow", "compatible", "csv_bytes",
           "encode_column", "pg_type", "psycopg_module", "rules", "sql_module"]

INSTALL = "PostgresSink needs psycopg 3: pip install 'raysink[postgres]'"


def psycopg_module() -> Any:
    """Import psycopg lazily; a missing install is a ``ConfigError`` saying what to run."""
    try:
        import psycopg
    except ImportError as exc:
        raise ConfigError(INSTALL) from exc
    check_extra("postgres")
    return psycopg


def sql_module() -> Any:
    """``psycopg.sql`` (psycopg imported lazily)."""
    psycopg_module()
    from psycopg import sql

    return sql


# format_type's names for what arrow_to_postgres_type calls otherwise
_FORMAT_NAMES = {"timestamp": "timestamp without time zone",
                 "timestamptz": "timestamp with time zone",
                 "time": "time without time zone"}
_TO_ARROW: dict[str, pa.DataType] = {
    "smallint": pa.int16(), "integer": pa.int32(), "bigint": pa.int64(),
    "real": pa.float32(), "double precision": pa.float64(), "boolean": pa.bool_(),
    "text": pa.string(), "bytea": pa.binary(), "date": pa.date32(),
    "timestamp without time zone": pa.timestamp("us"),
    "timestamp with time zone": pa.timestamp("us", tz="UTC"),
}
_NUMERIC = re.compile(r"numeric\((\d+),(\d+)\)")
_WIDER = {("smallint", "integer"), ("smallint", "bigint"), ("integer", "bigint"),
          ("real", "double precision")}


# --------------------------------------------------------------------------- Arrow to PG


def arrow_to_postgres_type(name: str, dtype: pa.DataType) -> str:
    """The PostgreSQL column type storing Arrow ``dtype``; ``SchemaMismatchError`` if none."""
    t = pa.types
    if t.is_dictionary(dtype):
        return arrow_to_postgres_type(name, dtype.value_type)
    simple: list[tuple[Callable[[Any], bool], str]] = [
        (t.is_boolean, "boolean"),
        (t.is_int8, "smallint"), (t.is_int16, "smallint"), (t.is_int32, "integer"),
        (t.is_int64, "bigint"), (t.is_uint8, "smallint"), (t.is_uint16, "integer"),
        (t.is_uint32, "bigint"), (t.is_uint64, "numeric(20,0)"),
        (t.is_float16, "real"), (t.is_float32, "real"), (t.is_float64, "double precision"),
        (t.is_string, "text"), (t.is_large_string, "text"),
        (t.is_binary, "bytea"), (t.is_large_binary, "bytea"), (t.is_fixed_size_binary, "bytea"),
        (t.is_date, "date"), (t.is_time, "time"),
        (t.is_list, "jsonb"), (t.is_large_list, "jsonb"), (t.is_fixed_size_list, "jsonb"),
        (t.is_struct, "jsonb"), (t.is_map, "jsonb"),
    ]
    for test, pg_type in simple:
        if test(dtype):
            return pg_type
    if t.is_decimal(dtype):
        return f"numeric({dtype.precision},{dtype.scale})"
    if t.is_timestamp(dtype):
        return "timestamptz" if dtype.tz is not None else "timestamp"
    if str(dtype) in ("string_view", "binary_view"):
        return "text" if str(dtype) == "string_view" else "bytea"
    raise SchemaMismatchError(
        f"column {name!r} has Arrow type {dtype}, which PostgresSink cannot store; "
        "cast it (e.g. to string or int64) before writing"
    )


def _json_default(value: Any) -> Any:
    if isinstance(value, bytes):
        return "\\x" + value.hex()
    return str(value)


def encode_column(col: pa.Array | pa.ChunkedArray, pg_type: str) -> pa.Array:
    """One Arrow column in a form pyarrow's CSV writer renders as PostgreSQL input."""
    if pa.types.is_dictionary(col.type):
        col = col.cast(col.type.value_type)
    if pg_type == "bytea":
        return pa.array(["\\x" + v.hex() if v is not None else None for v in col.to_pylist()])
    if pg_type == "jsonb":
        return pa.array([
            json.dumps(v, default=_json_default) if v is not None else None
            for v in col.to_pylist()
        ])
    if pa.types.is_float16(col.type):
        return col.cast(pa.float32())
    return col


def csv_bytes(batch: pa.RecordBatch | pa.Table, types: dict[str, str],
              prefix: dict[str, Any]) -> bytes:
    """``batch`` as CSV for ``COPY … (FORMAT csv)``: nulls unquoted empty, strings quoted."""
    import io

    import pyarrow.csv as pcsv

    arrays = dict(prefix)
    for name in batch.schema.names:
        arrays[name] = encode_column(batch.column(name), types[name])
    table = pa.table(arrays)
    buf = io.BytesIO()
    pcsv.write_csv(table, buf, write_options=pcsv.WriteOptions(include_header=False))
    return buf.getvalue()


# --------------------------------------------------------------------------- widening


def pg_type(field: pa.Field) -> str:
    """The column type storing ``field``, as ``format_type`` names it."""
    name = arrow_to_postgres_type(field.name, field.type)
    return _FORMAT_NAMES.get(name, name)


def _key(field: pa.Field) -> Hashable:
    return pg_type(field)


def _widens(old: pa.DataType, new: pa.DataType) -> bool:
    a, b = pg_type(pa.field("c", old)), pg_type(pa.field("c", new))
    if (a, b) in _WIDER:
        return True
    ma, mb = _NUMERIC.fullmatch(a), _NUMERIC.fullmatch(b)
    return bool(ma and mb and ma.group(2) == mb.group(2) and int(mb.group(1)) > int(ma.group(1)))


def rules(table: str) -> _schema.Rules:
    """PostgreSQL's: its column types; integer, float and numeric precision widening."""
    return _schema.Rules(target=f"the table {table}", key=_key, widen=_widens,
                         refuses_widening="PostgreSQL widens only smallint to integer to "
                                          "bigint, real to double precision and a numeric's "
                                          "precision")


def as_arrow(pg: str) -> pa.DataType | None:
    if pg in _TO_ARROW:
        return _TO_ARROW[pg]
    numeric = _NUMERIC.fullmatch(pg)
    if numeric and int(numeric.group(1)) <= 38:
        return pa.decimal128(int(numeric.group(1)), int(numeric.group(2)))
    return None


_FAMILIES = {
    "smallint": "int", "integer": "int", "bigint": "int",
    "real": "float", "double precision": "float",
    "timestamp": "timestamp without time zone", "timestamptz": "timestamp with time zone",
    "time": "time without time zone", "json": "jsonb",
}


def compatible(existing: str, wanted: str) -> bool:
    """Whether a column of type ``existing`` accepts values written as ``wanted``."""
    def base(pg_type: str) -> str:
        root = pg_type.split("(")[0].strip()
        return _FAMILIES.get(root, root)
    if base(wanted) == "int" and base(existing) in ("int", "numeric"):
        return True
    if base(wanted) == "float" and base(existing) in ("float", "numeric"):
        return True
    if base(wanted) == "numeric" and base(existing) in ("numeric", "float"):
        return True
    if base(wanted) == "text" and base(existing) in ("text", "character varying", "character"):
        return True
    return base(existing) == base(wanted)
