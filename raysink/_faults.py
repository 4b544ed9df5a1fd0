"""Named fault points for crash tests.

Production code calls ``hit(point, runtime=...)`` at each protocol point. Nothing happens
unless a test armed that point for that runtime with ``raysink.testing.arm_fault``: the arm
is a small JSON file under ``RAYSINK_FAULT_DIR`` (default ``<tmp>/raysink-faults``), so it
reaches actor processes on this machine without any Ray plumbing. An armed point fires at
most ``times`` times, then disarms itself.

Actions: ``kill`` (SIGKILL of the current process, a real crash), ``raise``
(``InjectedFault``), ``sleep`` (stall for ``seconds``).

The protocol points, in the order one epoch passes them::

    writer.during_write          a write call applied some batches of the epoch
    writer.after_pre_commit      the writer staged its data, before its commit request
    coordinator.after_open       OPEN recorded
    coordinator.after_pending    PENDING recorded, before any sink commit
    writer.after_ack             the writer got the ack (epoch PENDING), before it returns
    coordinator.mid_commit       between sinks: some sinks committed, others not
    sink.mid_commit              inside a sink's commit: data moved, marker not yet written
    coordinator.after_commit     every sink committed, COMMITTED not yet recorded
"""

from __future__ import annotations

import json
import os
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = ["POINTS", "InjectedFault", "fault_dir", "hit"]

POINTS = (
    "writer.during_write",
    "writer.after_pre_commit",
    "coordinator.after_open",
    "coordinator.after_pending",
    "writer.after_ack",
    "coordinator.mid_commit",
    "sink.mid_commit",
    "coordinator.after_commit",
)


class InjectedFault(RuntimeError):
    """Raised at an armed fault point whose action is ``raise``."""


def fault_dir() -> Path:
    return Path(os.environ.get("RAYSINK_FAULT_DIR", Path(tempfile.gettempdir()) / "raysink-faults"))


def _arm_path(runtime: str, point: str) -> Path:
    return fault_dir() / f"{runtime}--{point}.json"


def hit(point: str, *, runtime: str, **context: Any) -> None:
    """Fire the fault armed at ``point`` for ``runtime``, if any (cheap when none is)."""
    path = _arm_path(runtime, point)
    if not path.exists():
        return
    try:
        spec = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    if not _matches(spec.get("when", {}), context):
        return
    if not _consume(path, spec):
        return
    action = spec.get("action", "kill")
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "sleep":
        time.sleep(float(spec.get("seconds", 1.0)))
    else:
        raise InjectedFault(f"injected fault at {point} for runtime {runtime!r}")


def _matches(when: dict[str, Any], context: dict[str, Any]) -> bool:
    return all(context.get(key) == value for key, value in when.items())


def _consume(path: Path, spec: dict[str, Any]) -> bool:
    """Take one firing; ``False`` when another process took the last one first."""
    times = int(spec.get("times", 1))
    claim = path.with_suffix(f".{os.getpid()}.{time.monotonic_ns()}")
    try:
        os.rename(path, claim)
    except OSError:
        return False
    if times > 1:
        spec["times"] = times - 1
        claim.write_text(json.dumps(spec))
        os.rename(claim, path)
    else:
        fired = path.with_suffix(".fired")
        os.rename(claim, fired)
    return True
