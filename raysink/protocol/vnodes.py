"""Virtual nodes: stable key hashing, vnode bitmaps, their assignment to writers, coverage.

A row's vnode is ``stable_hash(key columns) % VNODE_COUNT``. The hash is computed here
with numpy over the Arrow buffers, never with Python's ``hash()``: the same key values give
the same vnode in every process, run and machine. It depends on the values and on the kind
of Arrow type (all integer widths, signed or not, hash alike; so do ``string``/``binary``
and their large and view variants; temporal types hash their stored integer, so a key's
type must stay the same across epochs for routing to stay the same).

Each writer of a sink owns a ``Bitmap`` of vnodes. ``assign`` splits the vnodes evenly and
contiguously; ``split_by_writer`` routes a batch's rows to their owners, keeping row order.
The coordinator commits an epoch of a sink only when the writers' commit requests cover
every vnode exactly once: ``CoverageTracker`` checks that (after RisingWave's
``AligningRequests``) and raises ``VnodeOverlapError`` naming the vnodes claimed twice.
"""

from __future__ import annotations

import itertools
import string
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc

from raysink.errors import ConfigError, VnodeOverlapError

__all__ = [
    "MAX_WRITERS",
    "VNODE_COUNT",
    "Bitmap",
    "CoverageTracker",
    "VnodeOverlapError",
    "assign",
    "key_hash",
    "split_by_writer",
    "vnodes_of",
    "writer_of_vnode",
]

R = TypeVar("R")

VNODE_COUNT = 256

MAX_WRITERS = 4096
"""Writers per sink; above ``VNODE_COUNT`` only unkeyed data reaches them all."""

U64 = npt.NDArray[np.uint64]

_M64 = (1 << 64) - 1
_P = 0x9E3779B97F4A7C15  # odd: invertible modulo 2**64
_P_INV = pow(_P, -1, 1 << 64)
_NULL_HASH = np.uint64(0x6A09E667F3BCC909)
_ROW_SEED = np.uint64(0xBB67AE8584CAA73B)
_INT_SALT = np.uint64(0x3C6EF372FE94F82B)
_LEN_SALT = np.uint64(0xA54FF53A5F1D36F1)
_CHUNK_BYTES = 1 << 20


# --- hashing ---------------------------------------------------------------------------


def _splitmix64(x: int) -> int:
    """One splitmix64 step on a Python int (used once, to build the byte table)."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


_BYTE_TABLE: U64 = np.array([_splitmix64(i) for i in range(256)], dtype=np.uint64)


def _fmix64(h: U64) -> U64:
    """MurmurHash3's 64-bit finaliser, vectorised (uint64 arithmetic wraps)."""
    h = h ^ (h >> np.uint64(33))
    h = h * np.uint64(0xFF51AFD7ED558CCD)
    h = h ^ (h >> np.uint64(33))
    h = h * np.uint64(0xC4CEB9FE1A85EC53)
    return h ^ (h >> np.uint64(33))


class _Powers:
    """Powers of ``_P`` and of its inverse modulo 2**64, grown on demand."""

    def __init__(self) -> None:
        self.up: U64 = np.empty(0, dtype=np.uint64)
        self.down: U64 = np.empty(0, dtype=np.uint64)

    def get(self, n: int) -> tuple[U64, U64]:
        if n > len(self.up):
            size = max(n, 2 * len(self.up), _CHUNK_BYTES)
            self.up = self._table(_P, size)
            self.down = self._table(_P_INV, size)
        return self.up[:n], self.down[:n]

    @staticmethod
    def _table(base: int, size: int) -> U64:
        table = np.full(size, base, dtype=np.uint64)
        table[0] = 1
        return np.cumprod(table, dtype=np.uint64)


_POWERS = _Powers()


def _hash_bytes(offsets: npt.NDArray[np.int64], data: npt.NDArray[np.uint8]) -> U64:
    """Hash each ``data[offsets[i]:offsets[i + 1]]``: a polynomial over a byte table,
    position independent, then finalised with its length. Chunked to bound memory."""
    n = len(offsets) - 1
    out = np.empty(n, dtype=np.uint64)
    lo = 0
    while lo < n:
        hi = int(np.searchsorted(offsets, offsets[lo] + _CHUNK_BYTES, side="right")) - 1
        hi = min(max(hi, lo + 1), n)
        out[lo:hi] = _hash_bytes_chunk(offsets[lo : hi + 1], data)
        lo = hi
    return out


def _hash_bytes_chunk(offsets: npt.NDArray[np.int64], data: npt.NDArray[np.uint8]) -> U64:
    base = int(offsets[0])
    seg = data[base : int(offsets[-1])]
    up, down = _POWERS.get(len(seg) + 1)
    sums = np.zeros(len(seg) + 1, dtype=np.uint64)
    np.cumsum(_BYTE_TABLE[seg] * up[: len(seg)], out=sums[1:])
    starts, ends = offsets[:-1] - base, offsets[1:] - base
    poly = (sums[ends] - sums[starts]) * down[starts]
    lengths = (ends - starts).astype(np.uint64)
    return _fmix64(poly ^ (lengths * _LEN_SALT))


def _hash_ints(values: U64) -> U64:
    return _fmix64(values ^ _INT_SALT)


def _binary_parts(arr: pa.Array) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.uint8]]:
    """Offsets (sliced to ``arr``) and data bytes of a (large) string or binary array."""
    wide = pa.types.is_large_string(arr.type) or pa.types.is_large_binary(arr.type)
    _, offsets_buf, data_buf = arr.buffers()
    raw = np.frombuffer(offsets_buf, dtype=np.int64 if wide else np.int32)
    offsets = raw[arr.offset : arr.offset + len(arr) + 1].astype(np.int64)
    if data_buf is None:
        return offsets, np.empty(0, dtype=np.uint8)
    return offsets, np.frombuffer(data_buf, dtype=np.uint8)


def _fixed_bytes_parts(arr: pa.Array) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.uint8]]:
    """Offsets and data bytes of a fixed-size binary or decimal array."""
    width = arr.type.byte_width
    data = np.frombuffer(arr.buffers()[1], dtype=np.uint8)
    offsets = (np.arange(len(arr) + 1, dtype=np.int64) + arr.offset) * width
    return offsets, data


def _ints(arr: pa.Array) -> U64:
    """Integer values as uint64 bit patterns (signed values sign-extended)."""
    values = np.asarray(pc.fill_null(arr, 0).to_numpy())
    if pa.types.is_unsigned_integer(arr.type):
        return values.astype(np.uint64)
    return values.astype(np.int64).view(np.uint64)


def _floats(arr: pa.Array) -> U64:
    """Float values as canonical float64 bits (-0.0 as 0.0, one NaN)."""
    values = np.asarray(pc.fill_null(arr, 0.0).to_numpy(), dtype=np.float64)
    values = np.where(values == 0.0, 0.0, values)
    values = np.where(np.isnan(values), np.nan, values)
    return values.view(np.uint64)


def _views_as_large_binary(arr: pa.Array) -> pa.Array:
    """A string or binary view array as large binary, so equal values hash alike whatever
    their layout. pyarrow 17 (raysink's oldest) cannot cast from view types at all: there
    the values go through Python (slower, alike); later releases cast."""
    try:
        return pc.cast(arr, pa.large_binary())
    except pa.ArrowNotImplementedError:
        plain = pa.large_string() if pa.types.is_string_view(arr.type) else pa.large_binary()
        return pc.cast(pa.array(arr.to_pylist(), plain), pa.large_binary())


def _value_hash(arr: pa.Array) -> U64:
    """Per-row hash of one non-chunked column, ignoring validity."""
    t = arr.type
    if pa.types.is_dictionary(t):
        return _dictionary_hash(arr)
    if pa.types.is_boolean(t) or pa.types.is_integer(t):
        source = pc.cast(arr, pa.int8()) if pa.types.is_boolean(t) else arr
        return _hash_ints(_ints(source))
    if pa.types.is_temporal(t):
        return _hash_ints(_ints(arr.view(pa.int64() if t.bit_width == 64 else pa.int32())))
    if pa.types.is_floating(t):
        return _hash_ints(_floats(arr))
    if pa.types.is_string_view(t) or pa.types.is_binary_view(t):
        return _value_hash(_views_as_large_binary(arr))
    if (
        pa.types.is_string(t)
        or pa.types.is_binary(t)
        or pa.types.is_large_string(t)
        or (pa.types.is_large_binary(t))
    ):
        return _hash_bytes(*_binary_parts(arr))
    if pa.types.is_fixed_size_binary(t) or pa.types.is_decimal(t):
        return _hash_bytes(*_fixed_bytes_parts(arr))
    if pa.types.is_null(t):
        return np.full(len(arr), _NULL_HASH, dtype=np.uint64)
    raise ConfigError(
        f"a routing key column cannot be of type {t}: use integers, strings, binary, "
        "booleans, decimals, floats or dates/times"
    )


def _dictionary_hash(arr: pa.DictionaryArray) -> U64:
    """Hash the dictionary once, then look each row's index up."""
    values = _column_hash(arr.dictionary)
    indices = np.asarray(pc.fill_null(arr.indices, 0).to_numpy(), dtype=np.int64)
    if len(values) == 0:
        return np.full(len(arr), _NULL_HASH, dtype=np.uint64)
    return np.take(values, indices)


def _column_hash(arr: pa.Array) -> U64:
    """Per-row hash of one non-chunked column; null rows get a fixed hash."""
    if isinstance(arr.type, pa.ExtensionType):
        arr = arr.storage
    hashed = _value_hash(arr)
    if arr.null_count and not pa.types.is_null(arr.type):
        valid = arr.is_valid().to_numpy(zero_copy_only=False)
        hashed = np.where(valid, hashed, _NULL_HASH)
    return hashed


def _chunked_hash(column: pa.Array | pa.ChunkedArray) -> U64:
    if isinstance(column, pa.ChunkedArray):
        parts = [_column_hash(chunk) for chunk in column.chunks]
        return np.concatenate(parts) if parts else np.empty(0, dtype=np.uint64)
    return _column_hash(column)


def _check_key(data: pa.RecordBatch | pa.Table, key: Sequence[str]) -> list[str]:
    if isinstance(key, str) or not key or not all(isinstance(k, str) for k in key):
        raise ConfigError(f"a routing key is a non-empty list of column names, got {key!r}")
    missing = [k for k in key if k not in data.schema.names]
    if missing:
        raise ConfigError(
            f"routing key columns {missing!r} are not in the data (columns: {data.schema.names!r})"
        )
    return list(key)


def key_hash(data: pa.RecordBatch | pa.Table, key: Sequence[str]) -> U64:
    """The stable 64-bit hash of each row's ``key`` columns (in this order)."""
    rows = np.full(data.num_rows, _ROW_SEED, dtype=np.uint64)
    for name in _check_key(data, key):
        rows = _fmix64(rows * np.uint64(_P) ^ _chunked_hash(data.column(name)))
    return rows


def vnodes_of(data: pa.RecordBatch | pa.Table, key: Sequence[str]) -> npt.NDArray[np.uint16]:
    """Each row's vnode, ``key_hash(data, key) % VNODE_COUNT``, as a uint16 array.

    Stable across processes and runs. Null key values hash to a fixed value (upstream
    rejects them; hashing does not fail). Raises ``ConfigError`` for a missing column or
    an unsupported column type (lists, structs, maps, unions).
    """
    return (key_hash(data, key) % np.uint64(VNODE_COUNT)).astype(np.uint16)


# --- bitmaps ---------------------------------------------------------------------------


def _ranges(vnodes: Iterable[int]) -> str:
    """``[0, 1, 2, 7]`` as ``"0-2, 7"``."""
    spans: list[list[int]] = []
    for v in vnodes:
        if spans and spans[-1][1] == v - 1:
            spans[-1][1] = v
        else:
            spans.append([v, v])
    return ", ".join(f"{a}-{b}" if a != b else f"{a}" for a, b in spans)


@dataclass(frozen=True, slots=True)
class Bitmap:
    """An immutable set of vnodes, bit ``v`` of ``bits`` for vnode ``v`` (0 .. 255).

    Hashable, picklable; ``to_hex``/``from_hex`` give a fixed 64-character JSON form.
    """

    bits: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.bits, bool) or not isinstance(self.bits, int):
            raise ConfigError(f"Bitmap bits must be an int, got {self.bits!r}")
        if not 0 <= self.bits < 1 << VNODE_COUNT:
            raise ConfigError(f"Bitmap bits must be in [0, 2**{VNODE_COUNT}), got {self.bits}")

    @classmethod
    def from_vnodes(cls, vnodes: Iterable[int] | npt.NDArray[np.integer[Any]]) -> Bitmap:
        """The bitmap of ``vnodes`` (any iterable or integer array; repeats are fine)."""
        values = np.asarray(list(vnodes) if not isinstance(vnodes, np.ndarray) else vnodes)
        if values.size and (
            values.dtype.kind not in "iu" or values.min() < 0 or values.max() >= VNODE_COUNT
        ):
            raise ConfigError(f"vnodes must be ints in [0, {VNODE_COUNT}), got {vnodes!r}")
        mask = np.zeros(VNODE_COUNT, dtype=bool)
        mask[values.astype(np.int64)] = True
        return cls._from_mask(mask)

    @classmethod
    def _from_mask(cls, mask: npt.NDArray[np.bool_]) -> Bitmap:
        packed = np.packbits(mask, bitorder="little").tobytes()
        return cls(int.from_bytes(packed, "little"))

    @classmethod
    def all(cls) -> Bitmap:
        """Every vnode."""
        return cls((1 << VNODE_COUNT) - 1)

    @classmethod
    def none(cls) -> Bitmap:
        """No vnode."""
        return cls(0)

    @classmethod
    def from_hex(cls, text: str) -> Bitmap:
        """Parse :meth:`to_hex` output; raises ``ConfigError`` on anything else."""
        if (
            not isinstance(text, str)
            or not text
            or len(text) > VNODE_COUNT // 4
            or any(c not in string.hexdigits for c in text)
        ):
            raise ConfigError(f"a vnode bitmap is up to 64 hex digits, got {text!r}")
        return cls(int(text, 16))

    def to_hex(self) -> str:
        """64 lowercase hex digits, most significant (vnode 255) first."""
        return f"{self.bits:0{VNODE_COUNT // 4}x}"

    def to_numpy(self) -> npt.NDArray[np.bool_]:
        """A 256-long bool mask, ``mask[v]`` for vnode ``v``."""
        raw = np.frombuffer(self.bits.to_bytes(VNODE_COUNT // 8, "little"), dtype=np.uint8)
        return np.unpackbits(raw, bitorder="little").astype(bool)

    def vnodes(self) -> list[int]:
        """The vnodes in the set, ascending."""
        return [int(v) for v in np.flatnonzero(self.to_numpy())]

    def count(self) -> int:
        """How many vnodes are in the set."""
        return self.bits.bit_count()

    @property
    def is_full(self) -> bool:
        """Whether every vnode is in the set."""
        return self.bits == (1 << VNODE_COUNT) - 1

    @property
    def is_empty(self) -> bool:
        """Whether no vnode is in the set."""
        return self.bits == 0

    def overlaps(self, other: Bitmap) -> bool:
        """Whether the two sets share a vnode."""
        return bool(self.bits & other.bits)

    def __or__(self, other: Bitmap) -> Bitmap:
        return Bitmap(self.bits | other.bits)

    def __and__(self, other: Bitmap) -> Bitmap:
        return Bitmap(self.bits & other.bits)

    def __invert__(self) -> Bitmap:
        return Bitmap(~self.bits & ((1 << VNODE_COUNT) - 1))

    def __contains__(self, vnode: object) -> bool:
        return isinstance(vnode, int) and 0 <= vnode < VNODE_COUNT and bool(self.bits >> vnode & 1)

    def __iter__(self) -> Iterator[int]:
        return iter(self.vnodes())

    def __repr__(self) -> str:
        return f"Bitmap({_ranges(self.vnodes())})"


def assign(num_writers: int) -> list[Bitmap]:
    """Split the vnodes into ``num_writers`` contiguous, disjoint, covering ranges whose
    sizes differ by at most one (writer ``i`` gets ``[i*256//n, (i+1)*256//n)``). With more
    writers than vnodes some ranges are empty: keyed data reaches at most 256 writers,
    unkeyed data all of them."""
    if (
        isinstance(num_writers, bool)
        or not isinstance(num_writers, int)
        or not (1 <= num_writers <= MAX_WRITERS)
    ):
        raise ConfigError(f"writers must be an int in [1, {MAX_WRITERS}], got {num_writers!r}")
    bounds = [i * VNODE_COUNT // num_writers for i in range(num_writers + 1)]
    return [Bitmap.from_vnodes(range(lo, hi)) for lo, hi in itertools.pairwise(bounds)]


def writer_of_vnode(bitmaps: Sequence[Bitmap]) -> npt.NDArray[np.int32]:
    """A 256-long array giving, for each vnode, the index of the bitmap that owns it.

    Raises ``VnodeOverlapError`` if two bitmaps share a vnode and ``ConfigError`` if some
    vnode has no owner.
    """
    tracker: CoverageTracker[None] = CoverageTracker()
    owners = np.full(VNODE_COUNT, -1, dtype=np.int32)
    for writer_id, bitmap in enumerate(bitmaps):
        tracker.add(writer_id, bitmap, None)
        owners[bitmap.to_numpy()] = writer_id
    if not tracker.aligned:
        raise ConfigError(
            f"vnodes {_ranges(tracker.missing.vnodes())} have no writer: the bitmaps must "
            "cover all 256 vnodes"
        )
    return owners


def split_by_writer(
    data: pa.RecordBatch | pa.Table, key: Sequence[str], bitmaps: Sequence[Bitmap]
) -> list[pa.RecordBatch | None]:
    """Route ``data``'s rows to the writers owning their vnodes: one batch per bitmap
    (``None`` when a writer gets no row), rows in their original order."""
    owners = writer_of_vnode(bitmaps)[vnodes_of(data, key)]
    order = np.argsort(owners, kind="stable")
    counts = np.bincount(owners, minlength=len(bitmaps))
    batch = _as_batch(data).take(pa.array(order, type=pa.int64()))
    out: list[pa.RecordBatch | None] = []
    start = 0
    for count in counts.tolist():
        out.append(batch.slice(start, count) if count else None)
        start += count
    return out


def _as_batch(data: pa.RecordBatch | pa.Table) -> pa.RecordBatch:
    if isinstance(data, pa.RecordBatch):
        return data
    columns = [column.combine_chunks() for column in data.columns]
    return pa.RecordBatch.from_arrays(columns, schema=data.schema)


# --- coverage --------------------------------------------------------------------------


class CoverageTracker(Generic[R]):
    """Collects one request per writer until their vnode bitmaps cover all vnodes.

    ``add`` refuses a writer seen before and a bitmap overlapping those already added
    (``VnodeOverlapError`` naming the shared vnodes and their owners); nothing is recorded
    on refusal. ``aligned`` is True once every vnode is covered and, when ``expected`` is
    given, that many writers reported (writers with an empty bitmap count too).
    """

    def __init__(self, expected: int | None = None) -> None:
        self._expected = expected
        self._covered = Bitmap.none()
        self._bitmaps: dict[int, Bitmap] = {}
        self._requests: list[R] = []

    def add(self, writer_id: int, bitmap: Bitmap, request: R) -> None:
        """Record ``request`` from ``writer_id`` owning ``bitmap``."""
        if writer_id in self._bitmaps:
            raise ConfigError(f"writer {writer_id} already sent its request for this round")
        shared = self._covered & bitmap
        if not shared.is_empty:
            raise self._overlap(writer_id, shared)
        self._covered |= bitmap
        self._bitmaps[writer_id] = bitmap
        self._requests.append(request)

    def _overlap(self, writer_id: int, shared: Bitmap) -> VnodeOverlapError:
        owners = sorted(w for w, b in self._bitmaps.items() if b.overlaps(shared))
        return VnodeOverlapError(
            f"duplicate vnodes {_ranges(shared.vnodes())}: writer {writer_id} claims vnodes "
            f"already covered by writers {owners}; each vnode must have exactly one writer",
            vnodes=tuple(shared.vnodes()),
            writer_id=writer_id,
        )

    @property
    def aligned(self) -> bool:
        """Whether the bitmaps added so far cover every vnode (and every expected writer
        reported)."""
        return self._covered.is_full and (
            self._expected is None or len(self._bitmaps) >= self._expected)

    @property
    def covered(self) -> Bitmap:
        """The union of the bitmaps added so far."""
        return self._covered

    @property
    def missing(self) -> Bitmap:
        """The vnodes no bitmap covers yet."""
        return ~self._covered

    @property
    def requests(self) -> list[R]:
        """The requests, in the order they were added."""
        return list(self._requests)

    def items(self) -> list[tuple[int, R]]:
        """``(writer_id, request)`` pairs, in the order they were added."""
        return list(zip(self._bitmaps, self._requests, strict=True))

    def __contains__(self, writer_id: object) -> bool:
        return writer_id in self._bitmaps
