"""Iceberg's partition transforms computed column-wise in Arrow.

pyiceberg's own ``pyarrow_transform`` needs the optional ``pyiceberg-core`` package for
every transform but identity, and its per-value ``transform`` is a Python call per row;
writers split every batch, so the transforms are computed here on whole columns (numpy
for integer arithmetic and the bucket hash of 8-byte values, ``mmh3``, a pyiceberg
dependency, for the hash of variable-length values).

Each transform returns the partition values in Iceberg's internal representation
(``day``: days since 1970-01-01, ``hour``: hours since the epoch, ``year``/``month``:
years/months since 1970, identity on a date: days, on a time or timestamp:
microseconds), as the Iceberg spec (Partition Transforms, Appendix B) defines them.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from decimal import Decimal

import mmh3
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from raysink.errors import ConfigError

__all__ = ["TRANSFORM", "apply_transform", "hash_values"]

TRANSFORM = re.compile(r"identity|year|month|day|hour|void|bucket\[([1-9]\d*)\]"
                       r"|truncate\[([1-9]\d*)\]")
"""The transforms a writer can compute, in Iceberg's own spelling."""

_MICROS_PER_DAY = 86_400_000_000
_MICROS_PER_HOUR = 3_600_000_000
_C1, _C2 = np.uint32(0xCC9E2D51), np.uint32(0x1B873593)


# --------------------------------------------------------------------------- helpers


def _storage(arr: pa.Array) -> pa.Array:
    """An extension array's storage (a UUID column: its 16 bytes)."""
    return arr.storage if isinstance(arr.type, pa.ExtensionType) else arr


def _ints(arr: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """``arr``'s values as int64 (nulls as 0) and its null mask."""
    mask = np.asarray(arr.is_null().to_numpy(zero_copy_only=False), dtype=bool)
    values = np.asarray(arr.cast(pa.int64()).fill_null(0).to_numpy(zero_copy_only=False),
                        dtype=np.int64)
    return values, mask


def _int_array(values: np.ndarray, mask: np.ndarray, dtype: pa.DataType) -> pa.Array:
    return pa.array(values, type=pa.int64(), mask=mask).cast(dtype)


def _micros(arr: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """A timestamp or time column as microseconds (a zoned timestamp's are UTC's;
    nanoseconds floored)."""
    if pa.types.is_time(arr.type):
        unit = "ns" if arr.type.unit == "ns" else "us"
        values, mask = _ints(arr.cast(pa.time64(unit)).cast(pa.int64()))
    else:
        unit = arr.type.unit
        values, mask = _ints(arr.cast(pa.int64()))
    if unit == "ns":
        return np.floor_divide(values, 1_000), mask
    return values * {"s": 1_000_000, "ms": 1_000, "us": 1}[unit], mask


def _days(arr: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """A date or timestamp column as days since 1970-01-01."""
    if pa.types.is_date(arr.type):
        return _ints(arr.cast(pa.date32()).cast(pa.int32()))
    if pa.types.is_timestamp(arr.type):
        micros, mask = _micros(arr)
        return np.floor_divide(micros, _MICROS_PER_DAY), mask
    raise _refused("day", arr.type)


def _refused(transform: str, dtype: pa.DataType) -> ConfigError:
    return ConfigError(f"the Iceberg partition transform {transform!r} does not apply to a "
                       f"column of type {dtype}; choose another transform or column")


# --------------------------------------------------------------------------- transforms


def _identity(arr: pa.Array) -> pa.Array:
    if pa.types.is_date(arr.type):
        return arr.cast(pa.date32()).cast(pa.int32())
    if pa.types.is_timestamp(arr.type) or pa.types.is_time(arr.type):
        values, mask = _micros(arr)
        return _int_array(values, mask, pa.int64())
    if pa.types.is_decimal(arr.type):
        return arr.cast(pa.string())
    if pa.types.is_large_string(arr.type):
        return arr.cast(pa.string())
    if pa.types.is_nested(arr.type):
        raise _refused("identity", arr.type)
    return arr


def _year(arr: pa.Array) -> pa.Array:
    if not (pa.types.is_date(arr.type) or pa.types.is_timestamp(arr.type)):
        raise _refused("year", arr.type)
    days, mask = _days(arr)
    dates = _int_array(days, mask, pa.int32()).cast(pa.date32())
    return pc.subtract(pc.year(dates), 1970).cast(pa.int32())


def _month(arr: pa.Array) -> pa.Array:
    if not (pa.types.is_date(arr.type) or pa.types.is_timestamp(arr.type)):
        raise _refused("month", arr.type)
    days, mask = _days(arr)
    dates = _int_array(days, mask, pa.int32()).cast(pa.date32())
    years = pc.subtract(pc.year(dates), 1970)
    return pc.add(pc.multiply(years, 12), pc.subtract(pc.month(dates), 1)).cast(pa.int32())


def _day(arr: pa.Array) -> pa.Array:
    days, mask = _days(arr)
    return _int_array(days, mask, pa.int32())


def _hour(arr: pa.Array) -> pa.Array:
    if not pa.types.is_timestamp(arr.type):
        raise _refused("hour", arr.type)
    micros, mask = _micros(arr)
    return _int_array(np.floor_divide(micros, _MICROS_PER_HOUR), mask, pa.int32())


def _void(arr: pa.Array) -> pa.Array:
    return pa.nulls(len(arr), pa.int32())


def _bucket(n: int) -> Callable[[pa.Array], pa.Array]:
    def bucket(arr: pa.Array) -> pa.Array:
        hashes = hash_values(arr)
        values, mask = _ints(hashes)
        return _int_array(np.remainder(values & 0x7FFFFFFF, n), mask, pa.int32())
    return bucket


def _truncate(width: int) -> Callable[[pa.Array], pa.Array]:
    def truncate(arr: pa.Array) -> pa.Array:
        arr = _storage(arr)
        dtype = arr.type
        if pa.types.is_integer(dtype) and pa.types.is_signed_integer(dtype):
            values, mask = _ints(arr)
            return _int_array(values - np.remainder(values, width), mask, dtype)
        if pa.types.is_string(dtype) or pa.types.is_large_string(dtype):
            return pc.utf8_slice_codeunits(arr, 0, width).cast(pa.string())
        if pa.types.is_binary(dtype) or pa.types.is_large_binary(dtype):
            return pc.binary_slice(arr, 0, width).cast(pa.binary())
        if pa.types.is_decimal(dtype):
            return pa.array([None if v is None else str(_truncate_decimal(v, width))
                             for v in arr.to_pylist()], pa.string())
        raise _refused(f"truncate[{width}]", dtype)
    return truncate


def _truncate_decimal(value: Decimal, width: int) -> Decimal:
    """``value`` less its unscaled value's (floor) remainder by ``width``."""
    exponent = value.as_tuple().exponent
    assert isinstance(exponent, int)
    unscaled = int(value.scaleb(-exponent))
    return Decimal(unscaled - unscaled % width).scaleb(exponent)


_FIXED: dict[str, Callable[[pa.Array], pa.Array]] = {
    "identity": _identity, "year": _year, "month": _month, "day": _day, "hour": _hour,
    "void": _void}


def apply_transform(transform: str, arr: pa.Array | pa.ChunkedArray) -> pa.Array:
    """The partition values of ``arr`` under ``transform`` (Iceberg's spelling), in
    Iceberg's internal representation, decimals as strings. A transform that does not
    apply to the column's type is a ``ConfigError``."""
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    match = TRANSFORM.fullmatch(transform)
    if match is None:
        raise ConfigError(f"unknown Iceberg partition transform {transform!r}: use identity, "
                          "year, month, day, hour, bucket[N] or truncate[W]")
    if match.group(1):
        return _bucket(int(match.group(1)))(arr)
    if match.group(2):
        return _truncate(int(match.group(2)))(arr)
    return _FIXED[transform](_storage(arr) if transform == "identity" else arr)


# --------------------------------------------------------------------------- bucket hash


def _rotl(x: np.ndarray, r: int) -> np.ndarray:
    return (x << np.uint32(r)) | (x >> np.uint32(32 - r))


def _murmur3_longs(values: np.ndarray) -> np.ndarray:
    """murmur3_32 (x86, seed 0) of each value's 8 little-endian bytes, as uint32."""
    bits = values.astype(np.int64).view(np.uint64)
    h = np.zeros(len(bits), dtype=np.uint32)
    for block in ((bits & np.uint64(0xFFFFFFFF)).astype(np.uint32),
                  (bits >> np.uint64(32)).astype(np.uint32)):
        k = _rotl(block * _C1, 15) * _C2
        h = _rotl(h ^ k, 13) * np.uint32(5) + np.uint32(0xE6546B64)
    h ^= np.uint32(8)
    h ^= h >> np.uint32(16)
    h *= np.uint32(0x85EBCA6B)
    h ^= h >> np.uint32(13)
    h *= np.uint32(0xC2B2AE35)
    h ^= h >> np.uint32(16)
    return h


def _decimal_bytes(value: Decimal) -> bytes:
    """The unscaled value's minimal big-endian two's-complement bytes."""
    exponent = value.as_tuple().exponent
    assert isinstance(exponent, int)
    unscaled = int(value.scaleb(-exponent))
    size = (unscaled if unscaled >= 0 else ~unscaled).bit_length() // 8 + 1
    return unscaled.to_bytes(size, "big", signed=True)


def _hash_bytes(items: list[bytes | None]) -> pa.Array:
    return pa.array([None if b is None else mmh3.hash(b, 0, True) for b in items], pa.int32())


def hash_values(arr: pa.Array) -> pa.Array:
    """Iceberg's 32-bit bucket hash of each value (signed, nulls stay null): murmur3_32
    x86 with seed 0 over the spec's byte form (int, long, date, time, timestamp: the
    value as 8 little-endian bytes of a long, in days or microseconds; string: UTF-8;
    binary, fixed, UUID: the bytes; decimal: the unscaled value's minimal big-endian
    two's complement)."""
    arr = _storage(arr)
    dtype = arr.type
    if pa.types.is_integer(dtype) or pa.types.is_date(dtype):
        values, mask = _ints(arr.cast(pa.date32()).cast(pa.int32())
                             if pa.types.is_date(dtype) else arr)
    elif pa.types.is_timestamp(dtype) or pa.types.is_time(dtype):
        values, mask = _micros(arr)
    elif pa.types.is_string(dtype) or pa.types.is_large_string(dtype):
        return _hash_bytes([None if s is None else s.encode() for s in arr.to_pylist()])
    elif (pa.types.is_binary(dtype) or pa.types.is_large_binary(dtype)
          or pa.types.is_fixed_size_binary(dtype)):
        return _hash_bytes(arr.to_pylist())
    elif pa.types.is_decimal(dtype):
        return _hash_bytes([None if d is None else _decimal_bytes(d) for d in arr.to_pylist()])
    else:
        raise ConfigError(f"the Iceberg bucket transform does not apply to a column of type "
                          f"{dtype}; bucket an integer, date, time, timestamp, string, binary, "
                          "UUID or decimal column")
    hashed = _murmur3_longs(values).view(np.int32)
    return pa.array(hashed, type=pa.int32(), mask=mask)
