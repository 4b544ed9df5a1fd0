"""The integration layer's module order (``tests.support.schedule``): the costliest module
first, so two parallel workers do not end the layer on one long module."""

from __future__ import annotations

from pathlib import Path

from tests.support.schedule import costliest_first, load_costs, module_of, module_seconds, reorder

COSTS = {"test_a.py": 10.0, "test_b.py": 90.0, "test_c.py": 40.0}


def _ids(modules: str) -> list[str]:
    """Two tests per module letter: ``"ab"`` gives a's two tests, then b's."""
    return [f"tests/integration/test_{m}.py::test_{i}" for m in modules for i in (1, 2)]


def test_modules_go_costliest_first_and_keep_their_tests_order() -> None:
    ordered = costliest_first(_ids("abc"), module_of, COSTS)
    assert ordered == _ids("bca")


def test_a_module_of_unknown_cost_counts_as_the_median_and_ties_keep_their_order() -> None:
    # d is unknown: it costs the median, 40, as c does; of the two, the one collected
    # first goes first
    assert costliest_first(_ids("acd"), module_of, COSTS) == _ids("cda")
    assert costliest_first(_ids("adc"), module_of, COSTS) == _ids("dca")
    assert costliest_first(_ids("ab"), module_of, {}) == _ids("ab")


def test_only_the_chosen_positions_move() -> None:
    items = ["tests/unit/test_u.py::x", *_ids("ab"), "tests/kafka/test_k.py::y"]
    reorder(items, range(1, 5), module_of, COSTS)
    assert items == ["tests/unit/test_u.py::x", *_ids("ba"), "tests/kafka/test_k.py::y"]


def test_a_run_sums_to_seconds_per_module_of_the_layer(tmp_path: Path) -> None:
    tests = {"tests/integration/test_a.py::t1": {"layer": "integration", "seconds": 1.25},
             "tests/integration/test_a.py::t2[x]": {"layer": "integration", "seconds": 2.0},
             "tests/unit/test_u.py::t": {"layer": "unit", "seconds": 5.0}}
    assert module_seconds(tests, "integration") == {"test_a.py": 3.2}
    stored = tmp_path / "module-seconds.json"
    stored.write_text('{"test_a.py": 3.2, "note": "x"}')
    assert load_costs(stored) == {"test_a.py": 3.2}
    assert load_costs(tmp_path / "missing.json") == {}
