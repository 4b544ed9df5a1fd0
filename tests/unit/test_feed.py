"""The driver's cutting of local tables (no Ray) and option errors of the constructors."""

from __future__ import annotations

import pyarrow as pa
import pytest

from raysink._options import checked_options
from raysink.driver.routing import CHUNK_ROWS, MIN_PIECE_ROWS, _chunks, _place_table, around
from raysink.errors import ConfigError


def _table(rows: int) -> pa.Table:
    return pa.table({"id": pa.array(range(rows), pa.int64()),
                     "text": pa.array([f"row {i:06d}" for i in range(rows)], pa.string())})


@pytest.mark.parametrize(("rows", "limit", "pieces"), [
    (1_000, None, 1),                    # no limit, under CHUNK_ROWS: one piece
    (CHUNK_ROWS + 1, None, 2),           # the row cap alone
    (1_000, 10**9, 1),                   # a generous limit changes nothing
])
def test_chunks_cover_every_row_once(rows: int, limit: int | None, pieces: int) -> None:
    table = _table(rows)
    chunks = list(_chunks(table, limit))
    assert len(chunks) == pieces
    assert pa.concat_tables(chunks).equals(table)


@pytest.mark.parametrize("divisor", [2, 7, 100])
def test_chunks_stay_under_the_byte_limit(divisor: int) -> None:
    table = _table(10_000)
    limit = table.nbytes // divisor
    chunks = list(_chunks(table, limit))
    assert all(c.nbytes <= limit for c in chunks)
    assert pa.concat_tables(chunks).equals(table)


def test_a_row_over_the_limit_is_still_one_piece_per_row() -> None:
    table = _table(5)
    chunks = list(_chunks(table, 1))  # the writer refuses these; the driver never loops
    assert [c.num_rows for c in chunks] == [1] * 5


class _Example:
    def __init__(self, path: str, *, compression: str = "zstd", row_group_size: int = 1) -> None:
        self.path = path


_Example.__init__ = checked_options("Example", _Example.__init__)  # type: ignore[method-assign]


@pytest.mark.parametrize(("args", "kwargs", "fragment"), [
    (("p",), {"compresion": "x"}, "no option 'compresion' (did you mean 'compression'?)"),
    (("p",), {"zzz": 1}, "Example has no option 'zzz'; its options are: path, compression"),
    (("p", "q"), {}, "takes 1 positional argument(s) (path); pass the others by name"),
    ((), {}, "missing a required argument: 'path'"),
])
def test_constructor_errors_name_the_options(args: tuple[str, ...], kwargs: dict[str, object],
                                             fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        _Example(*args, **kwargs)  # type: ignore[arg-type]
    assert fragment in str(info.value)
    assert isinstance(info.value, ValueError)


def test_checked_constructor_still_constructs() -> None:
    assert _Example("p", compression="snappy").path == "p"


@pytest.mark.parametrize(("rows", "writers", "first", "expected"), [
    (100, 2, 0, [0]),                          # small: one piece, to the first writer
    (100, 2, 1, [1]),                          # ... which rotates between epochs
    (2 * MIN_PIECE_ROWS, 2, 0, [0, 1]),        # large enough: every writer gets a piece
    (2 * MIN_PIECE_ROWS, 2, 1, [1, 0]),
    (3 * MIN_PIECE_ROWS, 4, 0, [0, 1, 2]),     # not enough rows for four pieces
    (CHUNK_ROWS * 3, 2, 0, [0, 1, 0]),         # the row cap still applies
])
def test_unkeyed_tables_are_spread_over_writers(rows: int, writers: int, first: int,
                                                expected: list[int]) -> None:
    placed: list[tuple[int, object]] = []
    table = _table(rows)
    _place_table(table, placed, writers, None, [], first, lambda t: t, None)
    assert [w for w, _ in placed] == expected
    assert pa.concat_tables([t for _, t in placed]).equals(table)  # type: ignore[misc]


# writers avoided, items (writer index, piece) -> what each writer gets
AROUND_CASES = [
    # nothing to avoid: unchanged
    (set(), [(0, "a"), (1, "b"), (2, "c")], [(0, "a"), (1, "b"), (2, "c")]),
    # writer 1's items go to the others in turn; the others keep theirs
    ({1}, [(0, "a"), (1, "b"), (2, "c"), (1, "d"), (1, "e")],
     [(0, "a"), (0, "b"), (2, "c"), (2, "d"), (0, "e")]),
    # every writer avoided: unchanged (the driver waits for them instead)
    ({0, 1, 2}, [(0, "a"), (1, "b")], [(0, "a"), (1, "b")]),
]


@pytest.mark.parametrize(("avoid", "items", "expected"), AROUND_CASES)
def test_items_go_around_avoided_writers(avoid: set[int], items: list[tuple[int, str]],
                                         expected: list[tuple[int, str]]) -> None:
    assert list(around(items, frozenset(avoid), 3)) == expected
