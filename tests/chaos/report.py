"""The chaos report: totals over trials, written as JSON and a small Markdown table."""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tests.chaos.harness import TrialResult

__all__ = ["percentile", "summarise", "write_report"]


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (``q`` in 0..100); ``None`` for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return round(ordered[rank - 1], 3)


def _group(results: Sequence[TrialResult], key: str) -> dict[str, dict[str, Any]]:
    groups: dict[str, list[TrialResult]] = {}
    for result in results:
        value = result.spec.get(key)
        groups.setdefault(str(value) if value is not None else "-", []).append(result)
    return {name: _totals(items) for name, items in sorted(groups.items())}


def _totals(results: Sequence[TrialResult]) -> dict[str, Any]:
    checks = [c for r in results for c in r.checks]
    recovery = [r.recovery_seconds for r in results if r.recovery_seconds is not None]
    return {
        "trials": len(results),
        "fired": sum(1 for r in results if r.fired),
        "failed": sum(1 for r in results if not r.ok),
        "rows_checked": sum(c.rows_seen for c in checks),
        "rows_expected": sum(c.rows_expected for c in checks),
        "rows_lost": sum(c.lost for c in checks),
        "rows_duplicated": sum(c.duplicated for c in checks),
        "rows_from_aborted_attempts": sum(c.aborted for c in checks),
        "rows_uncommitted": sum(c.uncommitted for c in checks),
        "order_problems": sum(1 for c in checks if any("order" in p for p in c.problems)),
        "recovery_p50_s": percentile(recovery, 50),
        "recovery_p99_s": percentile(recovery, 99),
        "seconds": round(sum(r.seconds for r in results), 1),
    }


def _pairs(results: Sequence[TrialResult]) -> dict[str, dict[str, Any]]:
    groups: dict[str, list[TrialResult]] = {}
    for result in results:
        key = f"{result.spec.get('fault')} / {result.spec.get('via')}"
        groups.setdefault(key, []).append(result)
    return {name: _totals(items) for name, items in sorted(groups.items())}


def summarise(results: Sequence[TrialResult], *, seed: int, trials: int) -> dict[str, Any]:
    errors: Counter[str] = Counter(e for r in results for e in r.errors)
    return {
        "seed": seed,
        "trials_planned": trials,
        "totals": _totals(results),
        "by_fault": _group(results, "fault"),
        "by_point": _group(results, "point"),
        "by_sink": _group(results, "sink"),
        "by_way_in": _group(results, "via"),
        "by_fault_and_way_in": _pairs(results),
        "driver_errors": dict(sorted(errors.items())),
        "failures": [{"name": r.spec["name"], "failure": r.failure,
                      "problems": [p for c in r.checks for p in c.problems]}
                     for r in results if not r.ok],
        "trials": [r.as_dict() for r in results],
    }


def _row(name: str, t: dict[str, Any]) -> str:
    cells = [name, t["trials"], t["fired"], t["failed"], t["rows_checked"], t["rows_lost"],
             t["rows_duplicated"], t["rows_from_aborted_attempts"], t["order_problems"],
             t["recovery_p50_s"], t["recovery_p99_s"]]
    return "| " + " | ".join("-" if c is None else str(c) for c in cells) + " |"


def markdown(summary: dict[str, Any]) -> str:
    header = ("| | trials | fired | failed | rows checked | lost | duplicated | "
              "from aborted | order | recovery p50 s | recovery p99 s |\n"
              "|---|---|---|---|---|---|---|---|---|---|---|")
    lines = [f"# Chaos run, seed {summary['seed']}", "", header,
             _row("**all**", summary["totals"])]
    for section in ("by_fault", "by_way_in", "by_fault_and_way_in", "by_point", "by_sink"):
        lines += ["", f"## {section.replace('_', ' ')}", "", header]
        lines += [_row(name, totals) for name, totals in summary[section].items()]
    lines += ["", f"Errors the driver saw (then recovered from): {summary['driver_errors']}"]
    return "\n".join(lines) + "\n"


def write_report(summary: dict[str, Any], directory: Path) -> tuple[Path, Path]:
    directory.mkdir(parents=True, exist_ok=True)
    stem = f"chaos-seed{summary['seed']}-{summary['totals']['trials']}"
    json_path = directory / f"{stem}.json"
    md_path = directory / f"{stem}.md"
    json_path.write_text(json.dumps(summary, indent=2, default=str))
    md_path.write_text(markdown(summary))
    return json_path, md_path
