"""Rows to Avro record values, a column at a time, with no Python step per row.

Each field of the schema (``_avroschema``) becomes one or more *pieces*, each holding
every row's bytes for one part of the field: a union's branch index, a length, the value.
A piece is either a matrix (one row of up to ``w`` bytes per record, of which the first
``counts[i]`` are taken: varints, fixed-width numbers) or spans of a buffer (strings and
bytes, straight from the Arrow buffer). Varints are zigzag-encoded in numpy for the whole
column: the byte count of each value from comparisons, its 7-bit groups by shifts.

The pieces are then laid row-wise into one buffer: every record's length is the sum of its
pieces' counts, its start their cumulative sum, and each piece is written at a cursor per
record with one vectorized scatter, after which the cursors move by its counts. The
result is an Arrow binary array over that buffer: what the JSON encoder's row-wise join
is to its texts. Rows go in slices of ``_SLICE`` so the index arrays (8 bytes per byte
written) stay small.

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

from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from raysink.errors import SchemaMismatchError
from raysink.sinks.kafka._avroschema import AvroField, AvroValues

__all__ = ["avro_values"]

_SLICE = 32_768
_SHIFTS = np.arange(10, dtype=np.uint64) * np.uint64(7)
_THRESHOLDS = np.uint64(1) << _SHIFTS[1:]


@dataclass(frozen=True, slots=True)
class _Matrix:
    """Row ``i`` contributes ``data[i, :counts[i]]`` (all ``w`` bytes when ``None``)."""

    data: Any  # uint8 (rows, w)
    counts: Any = None  # int64 (rows,) or None


@dataclass(frozen=True, slots=True)
class _Spans:
    """Row ``i`` contributes ``data[starts[i]:starts[i] + lengths[i]]``; ``contiguous``:
    the rows' spans follow each other in ``data`` from ``starts[0]``."""

    data: Any  # uint8
    starts: Any  # int64 (rows,)
    lengths: Any  # int64 (rows,)
    contiguous: bool


_Piece = _Matrix | _Spans


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
    if sum(s.nbytes for s in slices) >= 2**31 - 2**20:
        slices = [s.cast(pa.large_binary()) for s in slices]
    return slices[0] if len(slices) == 1 else pa.concat_arrays(slices)


def _whole(column: Any) -> Any:
    if isinstance(column, pa.ChunkedArray):
        return column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
    return column


def _encode_rows(columns: dict[str, Any], values: AvroValues, start: int, rows: int) -> Any:
    pieces: list[_Piece] = []
    if values.prefix:
        pieces.append(_constant(values.prefix, rows))
    for field in values.fields:
        column = columns.get(field.name)
        if column is None:
            if field.default:
                pieces.append(_constant(field.default, rows))
            continue
        pieces += _field_pieces(field, column.slice(start, rows))
    return _assemble(pieces, rows)


def _constant(data: bytes, rows: int) -> _Matrix:
    return _Matrix(np.tile(np.frombuffer(data, np.uint8), (rows, 1)))


# -- laying pieces row-wise ------------------------------------------------------------


def _counts(piece: _Piece, rows: int) -> Any:
    if isinstance(piece, _Spans):
        return piece.lengths
    if piece.counts is None:
        return np.full(rows, piece.data.shape[1], np.int64)
    return piece.counts


def _assemble(pieces: list[_Piece], rows: int) -> Any:
    """The records: each row's pieces one after another, as one binary array."""
    sizes = [_counts(p, rows) for p in pieces]
    lengths = np.sum(sizes, axis=0, dtype=np.int64) if sizes else np.zeros(rows, np.int64)
    offsets = np.zeros(rows + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    out = np.empty(int(offsets[-1]), np.uint8)
    cursor = offsets[:-1].copy()
    for piece, size in zip(pieces, sizes, strict=True):
        if isinstance(piece, _Spans):
            _scatter_spans(out, cursor, piece)
        else:
            _scatter_matrix(out, cursor, piece)
        cursor += size
    wide = offsets[-1] >= 2**31
    kind = pa.large_binary() if wide else pa.binary()
    bounds = offsets if wide else offsets.astype(np.int32)
    return pa.Array.from_buffers(kind, rows, [None, pa.py_buffer(bounds), pa.py_buffer(out)])


def _scatter_matrix(out: Any, cursor: Any, piece: _Matrix) -> None:
    width = piece.data.shape[1]
    where = cursor[:, None] + np.arange(width)
    if piece.counts is None:
        out[where.ravel()] = piece.data.ravel()
    else:
        taken = np.arange(width) < piece.counts[:, None]
        out[where[taken]] = piece.data[taken]


def _scatter_spans(out: Any, cursor: Any, piece: _Spans) -> None:
    lengths = piece.lengths
    total = int(lengths.sum())
    if not total:
        return
    first = np.cumsum(lengths) - lengths  # each row's start among the bytes taken
    step = np.arange(total, dtype=np.int64)
    if piece.contiguous:
        begin = int(piece.starts[0])
        out[np.repeat(cursor - first, lengths) + step] = piece.data[begin:begin + total]
        return
    within = step - np.repeat(first, lengths)
    out[np.repeat(cursor, lengths) + within] = piece.data[np.repeat(piece.starts, lengths)
                                                          + within]


# -- numbers -------------------------------------------------------------------------


def varints(numbers: Any, present: Any = None) -> _Matrix:
    """``numbers`` (int64) zigzag-encoded as Avro ``long`` varints; a row outside
    ``present`` takes no bytes."""
    signed = numbers.astype(np.int64, copy=False)
    zz = ((signed << 1) ^ (signed >> 63)).view(np.uint64)
    counts = 1 + (zz[:, None] >= _THRESHOLDS).sum(axis=1, dtype=np.int64)
    width = int(counts.max()) if len(counts) else 1
    groups = (zz[:, None] >> _SHIFTS[:width]) & np.uint64(0x7F)
    more = np.arange(width) < (counts - 1)[:, None]
    data = (groups | (more.astype(np.uint64) << np.uint64(7))).astype(np.uint8)
    if present is not None:
        counts = np.where(present, counts, 0)
    elif width == 1:
        counts = None
    return _Matrix(data, counts)


def _fixed_width(data: Any, present: Any) -> _Matrix:
    counts = None if present is None else np.where(present, data.shape[1], 0)
    return _Matrix(data, counts)


def _integers(field: AvroField, column: Any, present: Any) -> list[_Piece]:
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


def _floats(field: AvroField, column: Any, present: Any) -> list[_Piece]:
    if not (pa.types.is_floating(column.type) or pa.types.is_integer(column.type)):
        raise _mismatch(field, column, "a float or integer column")
    dtype = "<f4" if field.type.kind == "float" else "<f8"
    numbers = pc.fill_null(column.cast(pa.float64()), 0.0).to_numpy(zero_copy_only=False)
    data = numbers.astype(dtype).view(np.uint8).reshape(len(numbers), -1)
    return [_fixed_width(data, present)]


def _booleans(field: AvroField, column: Any, present: Any) -> list[_Piece]:
    if not pa.types.is_boolean(column.type):
        raise _mismatch(field, column, "a bool column")
    flags = pc.fill_null(column, False).to_numpy(zero_copy_only=False)
    return [_fixed_width(flags.astype(np.uint8).reshape(-1, 1), present)]


# -- strings and bytes -----------------------------------------------------------------


def _spans(column: Any, present: Any) -> _Spans:
    """A string or binary column's values where they lie in its data buffer."""
    _, offsets, data = column.buffers()
    width = np.int64 if (pa.types.is_large_string(column.type)
                         or pa.types.is_large_binary(column.type)) else np.int32
    rows = len(column)
    bounds = np.frombuffer(offsets, dtype=width, count=rows + 1,
                           offset=column.offset * np.dtype(width).itemsize).astype(np.int64)
    raw = np.frombuffer(data, np.uint8) if data is not None else np.zeros(0, np.uint8)
    lengths = np.diff(bounds)
    contiguous = present is None
    if present is not None:
        lengths = np.where(present, lengths, 0)
    return _Spans(raw, bounds[:-1], lengths, contiguous)


def _strings(field: AvroField, column: Any, present: Any) -> list[_Piece]:
    kind = column.type
    text = (pa.types.is_string(kind) or pa.types.is_large_string(kind))
    binary = pa.types.is_binary(kind) or pa.types.is_large_binary(kind)
    if field.type.kind == "bytes" and pa.types.is_fixed_size_binary(kind):
        column, binary = column.cast(pa.binary()), True
    if not (text or (binary and field.type.kind == "bytes")):
        want = "a string column" if field.type.kind == "string" else "a binary column"
        raise _mismatch(field, column, want)
    spans = _spans(column, present)
    return [varints(spans.lengths, present), spans]


def _fixed(field: AvroField, column: Any, present: Any) -> list[_Piece]:
    size = field.type.size
    kind = column.type
    if pa.types.is_fixed_size_binary(kind) and kind.byte_width == size:
        raw = np.frombuffer(column.buffers()[1], np.uint8, count=(column.offset + len(column))
                            * size)[column.offset * size:]
        return [_fixed_width(raw.reshape(len(column), size), present)]
    if not (pa.types.is_binary(kind) or pa.types.is_large_binary(kind)):
        raise _mismatch(field, column, f"a fixed_size_binary({size}) column")
    spans = _spans(column, present)
    wrong = spans.lengths != (size if present is None else np.where(present, size, 0))
    if wrong.any():
        raise SchemaMismatchError(
            f"the Avro field {field.name!r} is a fixed of {size} bytes; column "
            f"{field.name!r} has a value of {int(spans.lengths[wrong][0])} bytes",
            column=field.name)
    return [spans]


def _enum(field: AvroField, column: Any, present: Any) -> list[_Piece]:
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


def _temporal(field: AvroField, column: Any, present: Any) -> list[_Piece]:
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


def _decimal(field: AvroField, column: Any, present: Any) -> list[_Piece]:
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
    return [varints(needed, present), _Matrix(body, counts)]


# -- a field -------------------------------------------------------------------------

_BY_KIND = {"boolean": _booleans, "int": _integers, "long": _integers, "float": _floats,
            "double": _floats, "string": _strings, "bytes": _strings, "fixed": _fixed,
            "enum": _enum}


def _field_pieces(field: AvroField, column: Any) -> list[_Piece]:
    """A field's pieces for ``column``: the union branch (nullable fields), then the
    value (none for a null row)."""
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
    pieces: list[_Piece] = []
    if field.nullable:
        branch = np.full(len(column), 1 - field.null_branch, np.int64)
        if present is not None:
            branch[~present] = field.null_branch
        pieces.append(varints(branch))
    logical = field.type.logical
    if logical == "decimal":
        return pieces + _decimal(field, column, present)
    if logical in _UNITS:
        return pieces + _temporal(field, column, present)
    return pieces + _BY_KIND[field.type.kind](field, column, present)


def _mismatch(field: AvroField, column: Any, want: str) -> SchemaMismatchError:
    avro = field.type
    name = avro.logical or avro.kind
    return SchemaMismatchError(
        f"the Avro field {field.name!r} ({name}) cannot be encoded from column "
        f"{field.name!r} of type {column.type}: it needs {want}; cast the column, or "
        "change the field's type in avro_schema", column=field.name)
