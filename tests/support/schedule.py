"""The order a phase's parallel workers take the integration layer's modules in.

pytest-xdist's ``--dist loadfile`` hands a whole module to a worker at a time, in the order
of the collected tests (with ``--no-loadscope-reorder``; by default it puts the modules
with the most tests first, which here puts the quick ones first and leaves a long module
for the end, where one worker runs it while the other core sits idle). So the runner
collects the costliest modules first: the longest-processing-time-first rule, which ends
a run of two workers within a third of the optimum at worst.

A module's cost is in ``MODULE_SECONDS`` (``tests/integration/module-seconds.json``). As
first committed it holds the CPU seconds each module took run alone on the 2-core
machine (its pytest, Ray and PostgreSQL included, read from a cgroup's ``cpuacct``): the
layer is CPU-bound on two workers, so CPU time is what a module costs them.
``scripts/run_tests.py`` writes the seconds each module's tests took in a run to
``bench/out/module-seconds.json``, in the same form: copy it over when modules were added
or changed much. A module the file does not know costs the median of those it knows, so
it neither jumps the queue nor waits to the end. Without the file the runner leaves the
order to pytest-xdist.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TypeVar

__all__ = ["MODULE_SECONDS", "costliest_first", "load_costs", "module_of", "module_seconds",
           "reorder"]

MODULE_SECONDS = Path(__file__).resolve().parents[1] / "integration" / "module-seconds.json"

T = TypeVar("T")


def module_of(nodeid: str) -> str:
    """The module file of a test id: ``tests/integration/test_x.py::test_y[a]`` gives
    ``test_x.py``."""
    return nodeid.split("::", 1)[0].rsplit("/", 1)[-1]


def module_seconds(tests: Mapping[str, Mapping[str, object]], layer: str) -> dict[str, float]:
    """Seconds per module of ``layer`` from a run's per-test record (``test-times.json``:
    test id to its ``layer`` and ``seconds``)."""
    totals: dict[str, float] = {}
    for nodeid, test in tests.items():
        seconds = test.get("seconds")
        if test.get("layer") == layer and isinstance(seconds, int | float):
            module = module_of(nodeid)
            totals[module] = round(totals.get(module, 0.0) + float(seconds), 1)
    return dict(sorted(totals.items()))


def load_costs(path: Path = MODULE_SECONDS) -> dict[str, float]:
    """The stored costs, or none when the file is missing or unreadable."""
    try:
        loaded = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return {str(k): float(v) for k, v in loaded.items() if isinstance(v, int | float)}


def costliest_first(items: Sequence[T], module: Callable[[T], str],
                    costs: Mapping[str, float]) -> list[T]:
    """``items`` grouped by module, the costliest module first; a module's items keep
    their order, and modules of equal cost keep theirs (a stable sort)."""
    known = [c for c in costs.values() if c > 0]
    default = statistics.median(known) if known else 0.0
    order: dict[str, int] = {}
    for item in items:
        order.setdefault(module(item), len(order))
    ranked = sorted(order, key=lambda m: (-costs.get(m, default), order[m]))
    rank = {m: i for i, m in enumerate(ranked)}
    return sorted(items, key=lambda item: rank[module(item)])


def reorder(items: list[T], chosen: Iterable[int], module: Callable[[T], str],
            costs: Mapping[str, float]) -> None:
    """Reorder, in place, the items at the positions ``chosen`` (costliest module first);
    every other item keeps its position."""
    positions = sorted(chosen)
    for position, item in zip(positions, costliest_first([items[p] for p in positions],
                                                          module, costs), strict=True):
        items[position] = item
