"""Arming the named fault points of ``raysink._faults`` for one runtime, and asking
whether they fired."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from raysink._faults import ALL_POINTS, _arm_path, enabled
from raysink.errors import (
    ConfigError,
)
from raysink.sinks._files import write_durably

FaultAction = Literal["kill", "raise", "sleep"]


def arm_fault(
    runtime: str,
    point: str,
    *,
    action: FaultAction = "kill",
    times: int = 1,
    when: Mapping[str, Any] | None = None,
    seconds: float = 1.0,
) -> Path:
    """Arm ``point`` for ``runtime``: the next ``times`` hits whose context matches ``when``
    (e.g. ``{"sink": "main", "epoch": 3}``) run ``action``. Re-arming replaces the arm and
    clears ``fired``. Returns the arm file.

    Only a process started with ``RAYSINK_FAULT_DIR`` set (the test fixtures set it before
    Ray starts) can arm points, and only actors started with it fire them: elsewhere this
    is a ``ConfigError``."""
    if point not in ALL_POINTS:
        raise ConfigError(f"unknown fault point {point!r}; one of {ALL_POINTS}")
    if action not in ("kill", "raise", "sleep"):
        raise ConfigError(f"fault action must be 'kill', 'raise' or 'sleep', got {action!r}")
    if times < 1:
        raise ConfigError(f"times must be >= 1, got {times!r}")
    path = _arm_path(runtime, point)
    path.with_suffix(".fired").unlink(missing_ok=True)
    spec = {"action": action, "times": times, "when": dict(when or {}),
            "seconds": seconds, "armed_times": times}
    write_durably(path, json.dumps(spec).encode())
    return path


def disarm_faults(runtime: str) -> None:
    """Remove every arm and ``fired`` record of ``runtime``. Idempotent; a no-op where
    fault injection is off."""
    if not enabled():
        return
    for point in ALL_POINTS:
        path = _arm_path(runtime, point)
        path.unlink(missing_ok=True)
        path.with_suffix(".fired").unlink(missing_ok=True)


def fired_context(runtime: str, point: str) -> dict[str, Any] | None:
    """The context ``point`` last fired in for ``runtime`` (e.g. ``{"executor": ...}``),
    once an arm fired its last time; ``None`` before."""
    if not enabled():
        return None
    try:
        spec = json.loads(_arm_path(runtime, point).with_suffix(".fired").read_text())
    except (OSError, ValueError):
        return None
    context = spec.get("fired_with")
    return dict(context) if isinstance(context, dict) else None


def fired(runtime: str, point: str) -> bool:
    """Whether ``point`` fired at least once for ``runtime`` since it was armed."""
    if not enabled():
        return False
    path = _arm_path(runtime, point)
    if path.with_suffix(".fired").exists():
        return True
    try:
        spec = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return int(spec.get("times", 1)) < int(spec.get("armed_times", spec.get("times", 1)))
