"""The suite's cost per layer (``tests.support.layers``): a layer run in one process costs
the sum of its tests, a layer spread over parallel workers the wall clock over them."""

from __future__ import annotations

from pathlib import Path

from tests.support.layers import BUDGETS, LayerBook, table


def _book(parallel: bool) -> LayerBook:
    book = LayerBook(parallel=parallel)
    # two workers: two tests of 10 s each that overlap for 5 s, one runtime start each
    book.record("a::one", ["integration", "a"], 10.0, 100.0, 110.0, 1)
    book.record("b::two", ["integration", "b"], 10.0, 105.0, 115.0, 1)
    book.record("u::three", ["unit"], 0.5, 90.0, 90.5, 0)
    return book


def test_one_process_costs_the_sum_of_its_tests() -> None:
    layers = _book(parallel=False).layers
    assert layers["integration"].cost == 20.0 and layers["integration"].starts == 2
    assert layers["unit"].cost == 0.5


def test_parallel_workers_cost_the_wall_clock_over_the_layer() -> None:
    assert _book(parallel=True).layers["integration"].cost == 15.0


def test_a_book_saved_and_loaded_gives_the_same_table(tmp_path: Path) -> None:
    book = _book(parallel=True)
    book.save(tmp_path / "layers.json")
    loaded = LayerBook.load(tmp_path / "layers.json")
    assert table(loaded) == table(book.layers)
    assert loaded["integration"].parallel and loaded["integration"].cost == 15.0


def test_the_table_flags_a_layer_over_or_near_its_budget() -> None:
    book = LayerBook()
    book.record("x::slow", ["chaos"], BUDGETS["chaos"] + 1, 0.0, 1.0, 0)
    book.record("y::near", ["kafka"], BUDGETS["kafka"] * 0.9, 0.0, 1.0, 0)
    lines = {line.split()[0]: line for line in table(book.layers)}
    assert lines["chaos"].endswith("OVER BUDGET")
    assert lines["kafka"].endswith("within 15% of budget")
    assert not lines["unit"].endswith("budget") and "   0 runtime starts" in lines["unit"]
    assert list(lines) == ["unit", "integration", "kafka", "spark", "chaos", "cluster"]

