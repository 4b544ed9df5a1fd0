"""What each test layer cost: its seconds against its budget, and its runtime starts.

Every pytest process keeps a ``LayerBook`` from the test reports it sees (with pytest-xdist,
the controller sees every worker's reports). A layer run in one process costs the sum of
its tests' durations; a layer spread over parallel workers costs the wall-clock time from
its first test's start to its last test's end, since its tests overlap.

The suite runner (``scripts/run_tests.py``, what ``make test`` runs) runs the layers in
phases, each phase one pytest process, and prints the table of all of them from the books
the phases wrote (``RAYSINK_TEST_LAYERS`` names the file a process writes its book to).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["BUDGETS", "LAYERS", "MARGIN", "LayerBook", "LayerCost", "layer_of", "table"]

LAYERS = ("unit", "integration", "kafka", "spark", "chaos", "cluster")
# Seconds each layer may take in the default run; the table flags a layer over budget.
BUDGETS = {"unit": 60.0, "integration": 780.0, "kafka": 480.0, "spark": 480.0,
           "chaos": 180.0, "cluster": 300.0}
# A layer should stay this far under its budget: the margin a loaded machine eats.
MARGIN = 0.15


def layer_of(keywords: Iterable[str]) -> str:
    """The layer a test belongs to, from its keywords (its markers among them)."""
    names = set(keywords)
    return next((layer for layer in LAYERS if layer in names), "other")


@dataclass
class LayerCost:
    """One layer's tests as one pytest process saw them."""

    seconds: float = 0.0  # the sum of its tests' setup, call and teardown durations
    first: float = math.inf  # when its first test started (epoch seconds)
    last: float = 0.0  # when its last test ended
    starts: int = 0  # runtimes started by its tests
    parallel: bool = False  # its tests ran on parallel workers

    def add(self, duration: float, start: float, stop: float, starts: int) -> None:
        self.seconds += duration
        self.first = min(self.first, start)
        self.last = max(self.last, stop)
        self.starts += starts

    def merged(self, other: LayerCost) -> LayerCost:
        """This layer's cost with another process's of the same layer (a layer's tests
        spread over phases): their seconds and starts added, the span of both."""
        return LayerCost(seconds=self.seconds + other.seconds,
                         first=min(self.first, other.first), last=max(self.last, other.last),
                         starts=self.starts + other.starts,
                         parallel=self.parallel or other.parallel)

    @property
    def cost(self) -> float:
        """The seconds the layer took: the sum of its tests, or the wall clock over them
        when they ran in parallel."""
        if self.parallel and self.last >= self.first:
            return self.last - self.first
        return self.seconds


@dataclass
class LayerBook:
    """The layers one pytest process saw, and each test's seconds and runtime starts."""

    parallel: bool = False
    layers: dict[str, LayerCost] = field(default_factory=dict)
    tests: dict[str, dict[str, Any]] = field(default_factory=dict)

    def record(self, nodeid: str, keywords: Iterable[str], duration: float, start: float,
               stop: float, starts: int) -> None:
        """One report (a test's setup, call or teardown)."""
        layer = layer_of(keywords)
        cost = self.layers.setdefault(layer, LayerCost(parallel=self.parallel))
        cost.add(duration, start, stop, starts)
        test = self.tests.setdefault(nodeid, {"layer": layer, "seconds": 0.0,
                                              "runtime_starts": 0})
        test["seconds"] = round(test["seconds"] + duration, 3)
        test["runtime_starts"] += starts

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        layers = {name: {**asdict(cost),
                         "first": cost.first if math.isfinite(cost.first) else None}
                  for name, cost in self.layers.items()}
        path.write_text(json.dumps({"parallel": self.parallel, "layers": layers},
                                   indent=1, sort_keys=True) + "\n")

    @staticmethod
    def load(path: Path) -> dict[str, LayerCost]:
        """The layers a phase's process wrote (``save``)."""
        saved = json.loads(path.read_text())["layers"]
        return {name: LayerCost(seconds=float(v["seconds"]),
                                first=math.inf if v["first"] is None else float(v["first"]),
                                last=float(v["last"]), starts=int(v["starts"]),
                                parallel=bool(v["parallel"]))
                for name, v in saved.items()}


def table(layers: Mapping[str, LayerCost]) -> list[str]:
    """One line per layer: seconds of budget, share, runtime starts, and a flag when over
    budget or within the margin of it."""
    lines = []
    for layer in LAYERS:
        cost = layers.get(layer, LayerCost())
        spent, budget = cost.cost, BUDGETS[layer]
        flag = ("  OVER BUDGET" if spent > budget else
                f"  within {MARGIN:.0%} of budget" if spent > budget * (1 - MARGIN) else "")
        how = ", parallel" if cost.parallel else ""
        lines.append(f"{layer:<12} {spent:7.1f} s of {budget:5.0f} s "
                     f"({spent / budget:4.0%}), {cost.starts:4d} runtime starts{how}{flag}")
    return lines
