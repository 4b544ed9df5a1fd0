"""``last_per_key``: the chunk a PostgreSQL upsert sends, sorted by key with the last row
of each key, compared with a plain Python model (no server needed)."""

from __future__ import annotations

import math
import random
from typing import Any

import pyarrow as pa
import pytest

from raysink.sinks.postgres._prepared import last_per_key


def _model(rows: list[dict[str, Any]], key: list[str]) -> dict[tuple[Any, ...], dict[str, Any]]:
    """The last row of every key, keys compared as PostgreSQL does (NaN equals NaN)."""
    def norm(value: Any) -> Any:
        return "NaN" if isinstance(value, float) and math.isnan(value) else value

    last: dict[tuple[Any, ...], dict[str, Any]] = {}
    for row in rows:
        last[tuple(norm(row[k]) for k in key)] = row
    return last


def _check(table: pa.Table, key: list[str], types: dict[str, str]) -> pa.Table:
    got = last_per_key(table, key, types)
    expected = _model(table.to_pylist(), key)
    assert got.schema.equals(table.schema)
    assert got.num_rows == len(expected)
    got_rows = got.to_pylist()
    for row in got_rows:
        ident = tuple("NaN" if isinstance(row[k], float) and math.isnan(row[k]) else row[k]
                      for k in key)
        assert expected[ident] == row or _same_nan_row(expected[ident], row)
    return got


def _same_nan_row(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all((x == y) or (isinstance(x, float) and isinstance(y, float)
                            and math.isnan(x) and math.isnan(y)) for x, y in
               zip(a.values(), b.values(), strict=True))


@pytest.mark.parametrize("seed", range(5))
def test_random_int_keys_keep_the_last_row_sorted(seed: int) -> None:
    rng = random.Random(seed)
    ids = [rng.randrange(50) for _ in range(400)]
    table = pa.table({"id": pa.array(ids, pa.int64()), "v": [f"r{i}" for i in range(400)]})
    got = _check(table, ["id"], {"id": "bigint", "v": "text"})
    keys = got.column("id").to_pylist()
    assert keys == sorted(set(ids))  # sorted, one row each


def test_composite_keys_and_strings() -> None:
    rng = random.Random(3)
    rows = 300
    table = pa.table({
        "tenant": pa.array([rng.choice(["a", "b", "ä", ""]) for _ in range(rows)]),
        "n": pa.array([rng.randrange(5) for _ in range(rows)], pa.int32()),
        "v": pa.array(range(rows), pa.int64()),
    })
    got = _check(table, ["tenant", "n"], {"tenant": "text", "n": "integer", "v": "bigint"})
    assert got.num_rows <= 20


def test_float_keys_compare_as_postgres_does() -> None:
    # NaN equals NaN and -0.0 equals 0.0 for PostgreSQL: one row each
    table = pa.table({"k": pa.array([float("nan"), 1.5, -0.0, float("nan"), 0.0, 1.5]),
                      "v": pa.array([0, 1, 2, 3, 4, 5])})
    got = last_per_key(table, ["k"], {"k": "double precision", "v": "bigint"})
    assert got.num_rows == 3
    values = dict(zip(["zero", "one-and-half", "nan"], got.column("v").to_pylist(),
                      strict=True))
    assert values == {"zero": 4, "one-and-half": 5, "nan": 3}


def test_binary_and_nested_keys_compare_by_what_postgres_receives() -> None:
    table = pa.table({
        "b": pa.array([b"\x00", b"\x01", b"\x00"], pa.binary()),
        "s": pa.array([{"x": 1}, {"x": 2}, {"x": 1}]),
        "v": pa.array([1, 2, 3]),
    })
    got = last_per_key(table, ["b", "s"], {"b": "bytea", "s": "jsonb", "v": "bigint"})
    assert sorted(got.column("v").to_pylist()) == [2, 3]


def test_dictionary_keys_and_tiny_tables() -> None:
    keys = pa.array(["x", "y", "x"]).dictionary_encode()
    table = pa.table({"k": keys, "v": pa.array([1, 2, 3])})
    got = last_per_key(table, ["k"], {"k": "text", "v": "bigint"})
    assert got.column("v").to_pylist() == [3, 2]
    one = table.slice(0, 1)
    assert last_per_key(one, ["k"], {"k": "text", "v": "bigint"}).equals(one)
    empty = table.slice(0, 0)
    assert last_per_key(empty, ["k"], {"k": "text", "v": "bigint"}).num_rows == 0
