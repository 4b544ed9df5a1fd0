"""Stable key hashing, vnode bitmaps, assignment, routing and coverage."""

from __future__ import annotations

import datetime as dt
import os
import pickle
import subprocess
import sys
from decimal import Decimal
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from raysink.errors import ConfigError
from raysink.protocol.vnodes import (
    VNODE_COUNT,
    Bitmap,
    CoverageTracker,
    VnodeOverlapError,
    assign,
    key_hash,
    split_by_writer,
    vnodes_of,
    writer_of_vnode,
)

GOLDEN = pa.table(
    {
        "id": pa.array([0, 1, -1, 2**62, 42], pa.int64()),
        "name": ["", "a", "hello", "ünïcode", "x" * 100],
    }
)
REPO = Path(__file__).resolve().parents[2]


def one(column: pa.Array) -> list[int]:
    """Vnodes of a one-column batch keyed by that column."""
    return list(vnodes_of(pa.record_batch({"k": column}), ["k"]).tolist())


# --- stability -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "expected"),
    [
        (["id"], [242, 140, 168, 233, 228]),  # integers
        (["name"], [131, 220, 152, 121, 153]),  # strings, empty and multi-byte included
        (["id", "name"], [141, 140, 205, 1, 175]),  # a two-column key
    ],
)
def test_golden_vnodes_never_change(key: list[str], expected: list[int]) -> None:
    # Changing these re-routes every key of every existing runtime: never do it silently.
    assert vnodes_of(GOLDEN, key).tolist() == expected
    assert vnodes_of(GOLDEN, key).dtype == np.uint16


def test_golden_hash_never_changes() -> None:
    assert [hex(h) for h in key_hash(GOLDEN, ["id", "name"]).tolist()] == [
        "0x6bfa5a90c693968d",
        "0x2847ab116278828c",
        "0xb7f45cabd1413ccd",
        "0x5c4934e9e439de01",
        "0x105f5c9a928ea8af",
    ]


def test_same_vnodes_in_another_process_with_another_hash_seed() -> None:
    code = (
        "import pyarrow as pa\n"
        "from raysink.protocol.vnodes import vnodes_of\n"
        "t = pa.table({'id': [0, 1, -1, 2**62, 42], "
        "'name': ['', 'a', 'hello', 'ünïcode', 'x' * 100]})\n"
        "print(vnodes_of(t, ['id', 'name']).tolist())\n"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == str(vnodes_of(GOLDEN, ["id", "name"]).tolist())


# --- types -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("left", "right"),
    [
        (pa.array([1, -2, 300], pa.int64()), pa.array([1, -2, 300], pa.int16())),  # widths
        (pa.array([1, 2, 300], pa.int32()), pa.array([1, 2, 300], pa.uint64())),  # signedness
        (pa.array(["a", "bc", ""]), pa.array(["a", "bc", ""], pa.large_string())),  # large
        (pa.array(["a", "bc", ""]), pa.array(["a", "bc", ""], pa.string_view())),  # views
        (pa.array(["a", "bc"]), pa.array([b"a", b"bc"], pa.binary())),  # str ~ its utf-8
        (pa.array([b"a", b""], pa.large_binary()), pa.array([b"a", b""], pa.binary_view())),
        (
            pa.array(["x", "y", "x", None]).dictionary_encode(),
            pa.array(["x", "y", "x", None]),
        ),  # dictionary-encoded hashes like plain
        (pa.array([0.0, 1.5, float("nan")]), pa.array([-0.0, 1.5, -float("nan")])),  # -0, NaN
        (pa.array([1.5], pa.float32()), pa.array([1.5], pa.float64())),  # float widths
        (pa.array([True, False]), pa.array([1, 0], pa.int8())),  # bools as 0/1
    ],
)
def test_equal_values_hash_alike_across_types(left: pa.Array, right: pa.Array) -> None:
    assert one(left) == one(right)


@pytest.mark.parametrize(
    "column",
    [
        pa.array([True, False, None]),  # booleans with a null
        pa.array([dt.date(2024, 1, 1), None, dt.date(1970, 1, 1)], pa.date32()),  # date32
        pa.array([dt.datetime(2024, 1, 1)], pa.date64()),  # date64
        pa.array([dt.datetime(2024, 1, 1, 12), None], pa.timestamp("us", tz="UTC")),  # ts
        pa.array([dt.time(12, 30)], pa.time32("s")),  # time of day
        pa.array([dt.timedelta(seconds=3)], pa.duration("ns")),  # durations
        pa.array([Decimal("1.23"), Decimal("-9.99"), None], pa.decimal128(10, 2)),  # decimal
        pa.array([Decimal("1.23")], pa.decimal256(40, 2)),  # wide decimal
        pa.array([b"abcd", None], pa.binary(4)),  # fixed-size binary
        pa.array([None, None], pa.null()),  # an all-null column
        pa.array(["a", None, "b"]),  # a null string
        pa.array([1, None, 3], pa.int64()),  # a null integer
        pa.array([], pa.string()),  # no rows at all
    ],
)
def test_supported_types_hash_without_crashing(column: pa.Array) -> None:
    vnodes = one(column)
    assert len(vnodes) == len(column) and all(0 <= v < VNODE_COUNT for v in vnodes)
    assert vnodes == one(column)


def test_nulls_hash_to_one_fixed_value_per_type() -> None:
    assert len(set(one(pa.array([None, None, None], pa.int64())))) == 1
    strings = one(pa.array([None, "x", None]))
    assert strings[0] == strings[2]


def test_decimals_hash_by_value_not_precision() -> None:
    value = [Decimal("12.50")]
    assert one(pa.array(value, pa.decimal128(10, 2))) == one(pa.array(value, pa.decimal128(20, 2)))


@pytest.mark.parametrize(
    ("data", "key"),
    [
        (pa.table({"a": [[1], [2]]}), ["a"]),  # lists cannot be keys
        (pa.table({"a": [{"x": 1}]}), ["a"]),  # nor structs
        (pa.table({"a": [1]}), ["b"]),  # missing column
        (pa.table({"a": [1]}), []),  # empty key
        (pa.table({"a": [1]}), "a"),  # a bare string is not a list of names
    ],
)
def test_bad_keys_are_config_errors(data: pa.Table, key: Any) -> None:
    with pytest.raises(ConfigError):
        vnodes_of(data, key)


texts = st.lists(st.text(max_size=12), min_size=1, max_size=60)


@given(values=texts, data=st.data())
def test_slices_and_chunks_hash_like_the_whole(values: list[str], data: st.DataObject) -> None:
    arr = pa.array(values)
    whole = one(arr)
    start = data.draw(st.integers(0, len(values)))
    stop = data.draw(st.integers(start, len(values)))
    assert one(arr.slice(start, stop - start)) == whole[start:stop]
    chunked = pa.table({"k": pa.chunked_array([arr.slice(0, start), arr.slice(start)])})
    assert vnodes_of(chunked, ["k"]).tolist() == whole


@given(values=st.lists(st.integers(-(2**63), 2**63 - 1), min_size=1, max_size=50))
def test_row_hash_depends_only_on_its_own_values(values: list[int]) -> None:
    whole = one(pa.array(values, pa.int64()))
    assert [one(pa.array([v], pa.int64()))[0] for v in values] == whole


def test_strings_longer_than_a_hashing_chunk() -> None:
    big = ["a" * 700_000, "b" * 1_500_000, "", "c"]
    whole = one(pa.array(big))
    assert [one(pa.array([s]))[0] for s in big] == whole


def test_column_order_of_a_key_matters() -> None:
    t = pa.table({"a": list(range(200)), "b": list(range(200, 400))})
    assert vnodes_of(t, ["a", "b"]).tolist() != vnodes_of(t, ["b", "a"]).tolist()


def test_vnodes_spread_evenly() -> None:
    counts = np.bincount(one(pa.array(np.arange(256_000))), minlength=VNODE_COUNT)
    assert counts.min() > 800 and counts.max() < 1200  # expected 1000 each


# --- bitmaps ---------------------------------------------------------------------------

vnode_sets = st.sets(st.integers(0, VNODE_COUNT - 1))


@given(vnode_sets)
def test_bitmap_from_vnodes_round_trips(vnodes: set[int]) -> None:
    bitmap = Bitmap.from_vnodes(vnodes)
    assert bitmap.vnodes() == sorted(vnodes) == list(bitmap)
    assert bitmap.count() == len(vnodes)
    assert Bitmap.from_hex(bitmap.to_hex()) == bitmap
    assert len(bitmap.to_hex()) == 64
    assert Bitmap.from_vnodes(np.array(sorted(vnodes), dtype=np.uint16)) == bitmap
    assert pickle.loads(pickle.dumps(bitmap)) == bitmap
    assert bitmap.to_numpy().sum() == len(vnodes)


@given(vnode_sets, vnode_sets)
def test_bitmap_set_algebra(a: set[int], b: set[int]) -> None:
    x, y = Bitmap.from_vnodes(a), Bitmap.from_vnodes(b)
    assert (x | y).vnodes() == sorted(a | b)
    assert (x & y).vnodes() == sorted(a & b)
    assert (~x).vnodes() == sorted(set(range(VNODE_COUNT)) - a)
    assert x.overlaps(y) == bool(a & b)


def test_bitmap_constants_and_membership() -> None:
    assert Bitmap.all().is_full and Bitmap.all().count() == VNODE_COUNT
    assert Bitmap.none().is_empty and Bitmap.none().count() == 0
    assert Bitmap.all().to_hex() == "f" * 64 and Bitmap.none().to_hex() == "0" * 64
    bitmap = Bitmap.from_vnodes([0, 1, 2, 7, 255])
    assert 7 in bitmap and 8 not in bitmap and 256 not in bitmap and "7" not in bitmap
    assert repr(bitmap) == "Bitmap(0-2, 7, 255)"
    assert hash(bitmap) == hash(Bitmap.from_vnodes([255, 7, 2, 1, 0, 0]))


@pytest.mark.parametrize(
    "make",
    [
        lambda: Bitmap(-1),  # negative bits
        lambda: Bitmap(1 << 256),  # bit 256 does not exist
        lambda: Bitmap.from_vnodes([256]),  # vnode out of range
        lambda: Bitmap.from_vnodes([-1]),  # negative vnode
        lambda: Bitmap.from_vnodes([1.5]),  # type: ignore[list-item]  # not an int
        lambda: Bitmap.from_hex("g" * 64),  # not hex
        lambda: Bitmap.from_hex("1" * 65),  # too long
        lambda: Bitmap.from_hex(""),  # empty
    ],
)
def test_bad_bitmaps_are_config_errors(make: Any) -> None:
    with pytest.raises(ConfigError):
        make()


# --- assignment and routing ------------------------------------------------------------


@pytest.mark.parametrize(
    ("writers", "sizes"),
    [
        (1, [256]),  # one writer owns everything
        (2, [128, 128]),  # even halves
        (3, [85, 85, 86]),  # uneven: sizes differ by at most one
        (256, [1] * 256),  # one vnode each
    ],
)
def test_assign_splits_evenly_and_contiguously(writers: int, sizes: list[int]) -> None:
    bitmaps = assign(writers)
    assert [b.count() for b in bitmaps] == sizes
    flat = [v for b in bitmaps for v in b.vnodes()]
    assert flat == list(range(VNODE_COUNT))  # contiguous, ordered, no overlap, covering


@given(st.integers(1, VNODE_COUNT))
def test_assign_always_covers_without_overlap(writers: int) -> None:
    bitmaps = assign(writers)
    owners = writer_of_vnode(bitmaps)
    assert sorted(set(owners.tolist())) == list(range(writers))
    assert max(b.count() for b in bitmaps) - min(b.count() for b in bitmaps) <= 1


@pytest.mark.parametrize("writers", [0, 4097, -1, True, 2.0])  # out of range or not an int
def test_assign_rejects_bad_counts(writers: Any) -> None:
    with pytest.raises(ConfigError):
        assign(writers)


def test_assign_beyond_the_vnodes_leaves_some_writers_empty() -> None:
    """1,000 writers: the first 256 ranges hold one vnode each in turn, the others none;
    together they still cover every vnode once."""
    bitmaps = assign(1000)
    assert sum(b.count() for b in bitmaps) == 256
    assert {b.count() for b in bitmaps} == {0, 1}
    assert set(writer_of_vnode(bitmaps).tolist()) == {i for i, b in enumerate(bitmaps)
                                                       if b.count()}


def test_writer_of_vnode_refuses_gaps_and_overlaps() -> None:
    with pytest.raises(ConfigError, match="no writer"):
        writer_of_vnode([Bitmap.from_vnodes(range(200))])
    with pytest.raises(VnodeOverlapError):
        writer_of_vnode([Bitmap.from_vnodes(range(200)), Bitmap.from_vnodes(range(100, 256))])


@settings(deadline=None)
@given(
    ids=st.lists(st.integers(-1000, 1000), max_size=200),
    writers=st.integers(1, 8),
    as_table=st.booleans(),
)
def test_split_by_writer_routes_every_row_once_in_order(
    ids: list[int], writers: int, as_table: bool
) -> None:
    batch = pa.record_batch({"id": pa.array(ids, pa.int64()), "row": list(range(len(ids)))})
    data = pa.Table.from_batches([batch]) if as_table else batch
    bitmaps = assign(writers)
    parts = split_by_writer(data, ["id"], bitmaps)
    assert len(parts) == writers
    seen: list[int] = []
    for part, bitmap in zip(parts, bitmaps, strict=True):
        if part is None:
            continue
        assert part.num_rows > 0 and part.schema == batch.schema
        rows = part.column("row").to_pylist()
        assert rows == sorted(rows)  # order kept within a writer
        assert all(int(v) in bitmap for v in vnodes_of(part, ["id"]))
        seen += rows
    assert sorted(seen) == list(range(len(ids)))


def test_split_gives_none_to_writers_without_rows() -> None:
    batch = pa.record_batch({"id": pa.array([5, 5, 5], pa.int64())})
    parts = split_by_writer(batch, ["id"], assign(4))
    assert sum(p is not None for p in parts) == 1


# --- coverage --------------------------------------------------------------------------


def test_coverage_aligns_when_every_vnode_is_covered() -> None:
    tracker: CoverageTracker[str] = CoverageTracker()
    halves = assign(2)
    tracker.add(1, halves[1], "m1")
    assert not tracker.aligned and tracker.missing == halves[0]
    tracker.add(0, halves[0], "m0")
    assert tracker.aligned and tracker.covered.is_full
    assert tracker.requests == ["m1", "m0"] and [w for w, _ in tracker.items()] == [1, 0]
    assert tracker.items() == [(1, "m1"), (0, "m0")]
    assert 0 in tracker and 2 not in tracker


def test_coverage_overlap_names_the_duplicate_vnodes() -> None:
    tracker: CoverageTracker[str] = CoverageTracker()
    tracker.add(0, Bitmap.from_vnodes(range(0, 10)), "a")
    with pytest.raises(VnodeOverlapError) as info:
        tracker.add(1, Bitmap.from_vnodes([5, 6, 7, 20]), "b")
    error = info.value
    assert isinstance(error, ValueError) and isinstance(error, ConfigError)
    assert error.vnodes == (5, 6, 7) and error.writer_id == 1
    assert "5-7" in str(error) and "[0]" in str(error)
    assert tracker.requests == ["a"] and tracker.covered.count() == 10  # nothing recorded
    clone = pickle.loads(pickle.dumps(error))
    assert (clone.vnodes, clone.writer_id, str(clone)) == (error.vnodes, 1, str(error))


def test_coverage_refuses_a_writer_twice() -> None:
    tracker: CoverageTracker[None] = CoverageTracker()
    tracker.add(0, Bitmap.from_vnodes([1]), None)
    with pytest.raises(ConfigError, match="writer 0"):
        tracker.add(0, Bitmap.from_vnodes([2]), None)


@given(
    owner=st.lists(st.integers(0, 5), min_size=VNODE_COUNT, max_size=VNODE_COUNT),
    order=st.permutations(range(6)),
)
def test_coverage_of_any_partition(owner: list[int], order: list[int]) -> None:
    # A random partition of the vnodes among up to 6 writers, added in random order:
    # aligned exactly after the last non-empty part.
    parts = {w: Bitmap.from_vnodes([v for v, o in enumerate(owner) if o == w]) for w in order}
    tracker: CoverageTracker[int] = CoverageTracker()
    non_empty = [w for w in order if not parts[w].is_empty]
    for i, w in enumerate(non_empty):
        assert not tracker.aligned
        tracker.add(w, parts[w], w)
        assert tracker.aligned == (i == len(non_empty) - 1)
    assert [w for w, _ in tracker.items()] == non_empty
