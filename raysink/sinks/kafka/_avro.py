"""Rows to Avro record values, a column at a time, with no Python step per row.

Each field of the schema (``_avroschema``) becomes one or more *parts*, each a binary
array holding every row's bytes for one part of the field: a union's branch index, a
length, the value. Varints are zigzag-encoded in numpy for the whole column (the byte
count of each value from comparisons, its 7-bit groups by shifts, the bytes kept by a
mask); fixed-width numbers are the column's little-endian bytes; strings and bytes are the
Arrow column itself, not copied; a default or the registry framing is one constant.

The parts are then joined row-wise by Arrow (``binary_join_element_wise``, as the JSON
encoder joins its texts): record ``i`` is part 1's row ``i``, then part 2's, and so on; a
null part (a null row of a nullable string) joins as nothing, its union branch having said
null. Rows go in slices of ``_SLICE`` so the varints' temporary matrices (8 bytes per
7-bit group) stay small.

The Arrow column types each Avro type takes: ``boolean`` a bool; ``int``/``long`` an
integer (in range); ``float``/``double`` a float or integer; ``string`` (and ``uuid``) a
string; ``bytes`` a binary, string or fixed-size binary; ``fixed`` a fixed-size binary of
its size (or a binary whose values all have it); ``enum`` a string or dictionary of
strings among its symbols; ``date`` a date; ``time-*`` a time; ``timestamp-*`` a timestamp
(cast to the unit; a value finer than it is refused, not truncated); ``decimal`` a decimal
of the schema's scale and at most its precision. Anything else is a
``SchemaMismatchError`` naming the field and what to cast it to, raised while the batch is
encoded, before a record of it is produced.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from raysink.errors import SchemaMismatchError
from raysink.sinks.kafka._avroschema import AvroField, AvroValues

__all__ = ["avro_values"]

_SLICE = 65_536
_SHIFTS = np.arange(10, dtype=np.uint64) * np.uint64(7)
_THRESHOLDS = np.uint64(1) << _SHIFTS[1:]
_WIDE = 2**31 - 2**20  # bytes of a slice's parts past which its records are large_binary


def avro_values(table: pa.Table | pa.RecordBatch, values: AvroValues) -> Any:
    """Each row of ``table`` as the Avro binary encoding of one record of ``values``'s
    schema (framed when it has a schema id): a binary array, in row order."""
    columns = {name: _whole(table.column(name)) for name in table.schema.names}
    for field in values.fields:
        if field.name not in columns and field.default is None and field.type.kind != "null":
            raise SchemaMismatchError(
                f"the Avro field {field.name!r} has no column in the batch and no default "
                f"(columns: {table.schema.names}); add the column or give the field a "
                "default in avro_schema", column=field.name)
    rows = table.num_rows
    slices = [_encode_rows(columns, values, start, min(_SLICE, rows - start))
              for start in range(0, rows, _SLICE)] or [pa.array([], pa.binary())]
    if any(pa.types.is_large_binary(s.type) for s in slices) or sum(
            s.nbytes for s in slices) >= _WIDE:
        slices = [s.cast(pa.large_binary()) for s in slices]
    return slices[0] if len(slices) == 1 else pa.concat_arrays(slices)


def _whole(column: Any) -> Any:
    if isinstance(column, pa.ChunkedArray):
        return column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
    return column


def _encode_rows(columns: dict[str, Any], values: AvroValues, start: int, rows: int) -> Any:
    """The records of rows ``start`` to ``start + rows``: their parts, joined."""
    parts: list[Any] = []  # binary arrays of ``rows`` values, or bytes for every row
    if values.prefix:
        parts.append(values.prefix)
    for field in values.fields:
        column = columns.get(field.name)
        if column is None:
            if field.default:
                parts.append(field.default)
            continue
        parts += _field_parts(field, column.slice(start, rows))
    return _join(parts, rows)


def _join(parts: list[Any], rows: int) -> Any:
    """Record ``i``: every part's row ``i`` (a null as nothing), one after another."""
    arrays = [p for p in parts if not isinstance(p, bytes)]
    if not arrays:
        return pa.array([b"".join(parts)] * rows, pa.binary())
    large = any(pa.types.is_large_binary(a.type) for a in arrays) or sum(
        a.nbytes for a in arrays) >= _WIDE
    kind = pa.large_binary() if large else pa.binary()
    typed = [pa.scalar(p, kind) if isinstance(p, bytes) else p.cast(kind) for p in parts]
    if len(typed) == 1:
        return pc.fill_null(typed[0], pa.scalar(b"", kind))
    return pc.binary_join_element_wise(*typed, pa.scalar(b"", kind),
                                       null_handling="replace",
                                       null_replacement=b"")


def _packed(data: Any, counts: Any = None) -> Any:
    """A binary array from a byte matrix: row ``i`` is ``data[i, :counts[i]]`` (the whole
    row when ``counts`` is ``None``)."""
    rows, width = data.shape
    if counts is None:
        offsets = np.arange(0, rows * width + 1, width, dtype=np.int64)
        flat = np.ascontiguousarray(data).reshape(-1)
    else:
        offsets = np.zeros(rows + 1, np.int64)
        np.cumsum(counts, out=offsets[1:])
        flat = data[np.arange(width) < counts[:, None]]
    if offsets[-1] < 2**31:
        return pa.Array.from_buffers(pa.binary(), rows, [None, pa.py_buffer(
            offsets.astype(np.int32)), pa.py_buffer(flat)])
    return pa.Array.from_buffers(pa.large_binary(), rows, [None, pa.py_buffer(offsets),
                                                            pa.py_buffer(flat)])


# -- numbers -------------------------------------------------------------------------


def varints(numbers: Any, present: Any = None) -> Any:
    """``numbers`` (integers) zigzag-encoded as Avro ``long`` varints, a binary array; a
    row outside ``present`` takes no bytes."""
    signed = numbers.astype(np.int64, copy=False)
    zz = ((signed << 1) ^ (signed >> 63)).view(np.uint64)
    top = int(zz.max()) if len(zz) else 0
    if top < 0x80:  # one byte each: lengths of short strings, enums, small numbers
        return _fixed_width(zz.astype(np.uint8).reshape(-1, 1), present)
    counts = 1 + np.searchsorted(_THRESHOLDS, zz, side="right")
    width = int(np.searchsorted(_THRESHOLDS, np.uint64(top), side="right")) + 1
    groups = (zz[:, None] >> _SHIFTS[:width]) & np.uint64(0x7F)
    more = np.arange(width) < (counts - 1)[:, None]
    data = (groups | (more.astype(np.uint64) << np.uint64(7))).astype(np.uint8)
    return _packed(data, counts if present is None else np.where(present, counts, 0))


def _fixed_width(data: Any, present: Any) -> Any:
    return _packed(data, None if present is None else np.where(present, data.shape[1], 0))


def _integers(field: AvroField, column: Any, present: Any) -> list[Any]:
    if not pa.types.is_integer(column.type):
        raise _mismatch(field, column, "an integer column")
    numbers = pc.fill_null(column, 0).to_numpy(zero_copy_only=False)
    low, high = (-2**31, 2**31 - 1) if field.type.kind == "int" else (-2**63, 2**63 - 1)
    if len(numbers) and (int(numbers.min()) < low or int(numbers.max()) > high):
        raise SchemaMismatchError(
            f"the Avro field {field.name!r} is an {field.type.kind}, and column "
            f"{field.name!r} holds values outside it ({int(numbers.min())} to "
            f"{int(numbers.max())}); use a long field or narrower values", column=field.name)
    return [varints(numbers, present)]


def _floats(field: AvroField, column: Any, present: Any) -> list[Any]:
    if not (pa.types.is_floating(column.type) or pa.types.is_integer(column.type)):
        raise _mismatch(field, column, "a float or integer column")
    dtype = "<f4" if field.type.kind == "float" else "<f8"
    numbers = pc.fill_null(column.cast(pa.float64()), 0.0).to_numpy(zero_copy_only=False)
    data = numbers.astype(dtype).view(np.uint8).reshape(len(numbers), -1)
    return [_fixed_width(data, present)]


def _booleans(field: AvroField, column: Any, present: Any) -> list[Any]:
    if not pa.types.is_boolean(column.type):
        raise _mismatch(field, column, "a bool column")
    flags = pc.fill_null(column, False).to_numpy(zero_copy_only=False)
    return [_fixed_width(flags.astype(np.uint8).reshape(-1, 1), present)]


# -- strings and bytes -----------------------------------------------------------------


def _binary(column: Any) -> Any:
    """A string or binary column as binary (the same buffers)."""
    kind = column.type
    if pa.types.is_string(kind):
        return column.cast(pa.binary())
    if pa.types.is_large_string(kind):
        return column.cast(pa.large_binary())
    return column


def _lengths(column: Any) -> Any:
    return pc.fill_null(pc.binary_length(column), 0).to_numpy(zero_copy_only=False)


def _strings(field: AvroField, column: Any, present: Any) -> list[Any]:
    kind = column.type
    text = (pa.types.is_string(kind) or pa.types.is_large_string(kind))
    binary = pa.types.is_binary(kind) or pa.types.is_large_binary(kind)
    if field.type.kind == "bytes" and pa.types.is_fixed_size_binary(kind):
        column, binary = column.cast(pa.binary()), True
    if not (text or (binary and field.type.kind == "bytes")):
        want = "a string column" if field.type.kind == "string" else "a binary column"
        raise _mismatch(field, column, want)
    return [varints(_lengths(column), present), _binary(column)]


def _fixed(field: AvroField, column: Any, present: Any) -> list[Any]:
    size = field.type.size
    kind = column.type
    if pa.types.is_fixed_size_binary(kind) and kind.byte_width == size:
        return [column.cast(pa.binary())]
    if not (pa.types.is_binary(kind) or pa.types.is_large_binary(kind)):
        raise _mismatch(field, column, f"a fixed_size_binary({size}) column")
    lengths = _lengths(column)
    wrong = (lengths != size) if present is None else (present & (lengths != size))
    if wrong.any():
        raise SchemaMismatchError(
            f"the Avro field {field.name!r} is a fixed of {size} bytes; column "
            f"{field.name!r} has a value of {int(lengths[wrong][0])} bytes",
            column=field.name)
    return [column]


def _enum(field: AvroField, column: Any, present: Any) -> list[Any]:
    kind = column.type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise _mismatch(field, column, "a string (or dictionary of strings) column")
    index = pc.index_in(column, value_set=pa.array(field.type.symbols, kind))
    unknown = pc.and_(pc.is_valid(column), pc.is_null(index))
    if pc.any(unknown).as_py():
        strays = pc.unique(column.filter(unknown)).to_pylist()[:5]
        raise SchemaMismatchError(
            f"the Avro field {field.name!r} is an enum of {list(field.type.symbols)}; "
            f"column {field.name!r} holds {strays} besides", column=field.name)
    return [varints(pc.fill_null(index, 0).to_numpy(zero_copy_only=False), present)]


# -- logical types -----------------------------------------------------------------------

_UNITS = {"date": None, "time-millis": "ms", "time-micros": "us", "timestamp-millis": "ms",
          "timestamp-micros": "us", "local-timestamp-millis": "ms",
          "local-timestamp-micros": "us"}


def _temporal(field: AvroField, column: Any, present: Any) -> list[Any]:
    """Dates as days, times and timestamps as milli- or microseconds: the column cast to
    the unit (``safe``: a finer value is refused, not cut), then its integers."""
    logical = str(field.type.logical)
    unit = _UNITS[logical]
    kind = column.type
    if logical == "date":
        ok, target, number = pa.types.is_date(kind), pa.date32(), pa.int32()
    elif logical.startswith("time-"):
        ok = pa.types.is_time(kind)
        target = pa.time32(unit) if unit == "ms" else pa.time64(unit)
        number = pa.int32() if unit == "ms" else pa.int64()
    else:
        ok, number = pa.types.is_timestamp(kind), pa.int64()
        target = pa.timestamp(unit, getattr(kind, "tz", None))
    if not ok:
        raise _mismatch(field, column, f"a {str(target).split('[')[0]} column")
    try:
        cast = column.cast(target)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
        raise SchemaMismatchError(
            f"the Avro field {field.name!r} is {logical}, and column {field.name!r} "
            f"({kind}) does not fit it: {exc}; round or cast the column to {target} first",
            column=field.name) from None
    numbers = pc.fill_null(cast.view(number), 0).to_numpy(zero_copy_only=False)
    return [varints(numbers, present)]


def _decimal(field: AvroField, column: Any, present: Any) -> list[Any]:
    """The unscaled integer in big-endian two's complement: as few bytes as hold it (after
    a length) for ``bytes``, sign-extended to the size for ``fixed``."""
    avro, kind = field.type, column.type
    if not (pa.types.is_decimal(kind) and kind.scale == avro.scale
            and kind.precision <= avro.precision):
        raise _mismatch(field, column, f"a decimal128({avro.precision}, {avro.scale}) "
                                       "column (the schema's scale, at most its precision)")
    width = kind.byte_width
    raw = np.frombuffer(column.buffers()[1], np.uint8, count=(column.offset + len(column))
                        * width)[column.offset * width:]
    big = raw.reshape(len(column), width)[:, ::-1]  # little- to big-endian
    if present is not None:
        big = np.where(present[:, None], big, 0).astype(np.uint8)
    negative = big[:, :1] >= 0x80
    fill = np.where(negative, 0xFF, 0).astype(np.uint8)
    # a leading byte is redundant when it is all sign and the next byte's top bit too
    redundant = (big[:, :-1] == fill) & ((big[:, 1:] >= 0x80) == negative)
    skip = np.cumprod(redundant, axis=1).sum(axis=1)
    needed = width - skip
    if avro.kind == "fixed":
        if (needed > avro.size).any():
            raise SchemaMismatchError(
                f"the Avro field {field.name!r} is a decimal in a fixed of {avro.size} "
                f"bytes; column {field.name!r} holds a value that needs "
                f"{int(needed.max())}", column=field.name)
        if avro.size <= width:
            body = np.ascontiguousarray(big[:, width - avro.size:])
        else:
            body = np.hstack([np.repeat(fill, avro.size - width, axis=1), big])
        return [_fixed_width(body, present)]
    columns = np.minimum(np.arange(width) + skip[:, None], width - 1)
    body = np.take_along_axis(big, columns, axis=1)
    counts = needed if present is None else np.where(present, needed, 0)
    return [varints(needed, present), _packed(body, counts)]


# -- a field -------------------------------------------------------------------------

_BY_KIND = {"boolean": _booleans, "int": _integers, "long": _integers, "float": _floats,
            "double": _floats, "string": _strings, "bytes": _strings, "fixed": _fixed,
            "enum": _enum}


def _field_parts(field: AvroField, column: Any) -> list[Any]:
    """A field's parts for ``column``: the union branch (nullable fields), then the
    value (nothing for a null row)."""
    if pa.types.is_dictionary(column.type):
        column = column.dictionary_decode()
    if field.type.kind == "null":
        if column.null_count != len(column):
            raise _mismatch(field, column, "a column of nulls only")
        return []
    nulls = column.null_count
    if nulls and not field.nullable:
        raise SchemaMismatchError(
            f"the Avro field {field.name!r} is not nullable, and column {field.name!r} "
            f"holds {nulls} nulls; make its type the union [\"null\", ...] or fill the "
            "nulls", column=field.name)
    present = column.is_valid().to_numpy(zero_copy_only=False) if nulls else None
    parts: list[Any] = []
    if field.nullable:  # the branch index: 0 or 1, one byte as a varint (0x00, 0x02)
        branch = np.full(len(column), 2 * (1 - field.null_branch), np.uint8)
        if present is not None:
            branch[~present] = 2 * field.null_branch
        parts.append(_packed(branch.reshape(-1, 1)))
    logical = field.type.logical
    if logical == "decimal":
        return parts + _decimal(field, column, present)
    if logical in _UNITS:
        return parts + _temporal(field, column, present)
    return parts + _BY_KIND[field.type.kind](field, column, present)


def _mismatch(field: AvroField, column: Any, want: str) -> SchemaMismatchError:
    avro = field.type
    name = avro.logical or avro.kind
    return SchemaMismatchError(
        f"the Avro field {field.name!r} ({name}) cannot be encoded from column "
        f"{field.name!r} of type {column.type}: it needs {want}; cast the column, or "
        "change the field's type in avro_schema", column=field.name)
