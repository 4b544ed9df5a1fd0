"""Named fault points for crash tests, off unless the process opted in.

Production code calls ``hit(point, runtime=...)`` at each protocol point. The hooks are
armed only in a process started with the environment variable ``RAYSINK_FAULT_DIR`` set to
a directory: it is read once, when this module is imported (in an actor: when the actor
starts), and only the test fixtures set it (``tests/conftest.py`` points it at a private
temporary directory before Ray starts, so every actor inherits it). Without it ``hit``
returns at once and no file is ever looked at, so an arm file planted by anyone who can
write to a temporary directory does nothing.

With the opt-in, a test arms a point for one runtime with ``raysink.testing.arm_fault``:
the arm is a small JSON file in that directory, so it reaches actor processes on this
machine without any Ray plumbing. An armed point fires at most ``times`` times, then
disarms itself.

Actions: ``kill`` (SIGKILL of the current process, a real crash), ``raise``
(``InjectedFault``), ``sleep`` (stall for ``seconds``).

The protocol points, in the order one epoch passes them::

    writer.during_write          a write call applied some batches of the epoch
    writer.after_pre_commit      the writer staged its data, before its commit request
    coordinator.after_open       the epoch is open: its OPEN recorded before the data is
                                 sent, or (the next epoch: its open travels with its
                                 decision) the writers' requests taken, nothing recorded
    coordinator.after_pending    PENDING recorded, before any sink commit
    coordinator.mid_commit       one sink's commit recorded, another sink's not yet (sinks
                                 commit on their own: it fires for the first to record)
    sink.mid_commit              inside a sink's commit: data moved, marker not yet written
    coordinator.after_commit     every sink committed, COMMITTED not yet recorded
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

__all__ = ["ALL_POINTS", "APPLY_POINTS", "ENV_VAR", "FEED_POINTS", "HANDOFF_POINTS",
           "LIFECYCLE_POINTS", "MAINTENANCE_POINTS", "METASTORE_POINTS", "POINTS",
           "SINK_POINTS", "InjectedFault", "enabled", "fault_dir", "hit"]

ENV_VAR = "RAYSINK_FAULT_DIR"
_DIR: Path | None = Path(os.environ[ENV_VAR]) if os.environ.get(ENV_VAR) else None

POINTS = (
    "writer.during_write",
    "writer.after_pre_commit",
    "coordinator.after_open",
    "coordinator.after_pending",
    "coordinator.mid_commit",
    "sink.mid_commit",
    "coordinator.after_commit",
)

HANDOFF_POINTS = (
    "spark.mid_pull",
)
"""Points of the Spark handoff, apart from the protocol's (the chaos plan draws from
``POINTS``): ``spark.mid_pull``, a consumer chose the executor to pull a partition from
and has not asked it yet (context ``executor``, ``rdd``, ``partition``)."""

LIFECYCLE_POINTS = (
    "writer.start",
)
"""Points of an actor's life, outside any epoch: ``writer.start``, a writer's process is
starting it (its constructor, before anything; context ``writer``, ``sink``). A ``sleep``
there holds a writer that Ray restarts, or the runtime replaces, in its (re)start."""


APPLY_POINTS = (
    "writer.before_apply",
    "writer.before_pre_commit",
)
"""Points of a writer's apply and seal, apart from the protocol's (context ``epoch``,
``attempt``, ``writer``, ``sink``): ``writer.before_apply``, a writer took a run of the
current attempt's messages from its mailbox and has not applied them to its sink writer;
``writer.before_pre_commit``, a seal found the attempt's data aligned and applied and has
not pre-committed it. A ``sleep`` at either holds the writer there while the attempt is
given up (``cancel``) or replaced meanwhile."""


FEED_POINTS = (
    "feed.before_close",
)
"""Points of a producer's feed: ``feed.before_close``, a feed is closing, every write of
it sent and acknowledged, none of its barriers sent yet (context ``epoch``, ``feed``)."""


SINK_POINTS = (
    "kafka.before_finish",
)
"""Points inside one sink's commit, apart from the protocol's: ``kafka.before_finish``, a
``KafkaSink`` commit began (its committer claimed the epoch) and has not asked any writer
to commit the transaction it holds (context ``sink``, ``epoch``). Unlike
``coordinator.after_pending``, whose ``sleep`` lets the commit run meanwhile, a ``sleep``
here holds the epoch decided and uncommitted."""


METASTORE_POINTS = (
    "metastore.recover",
)
"""Points where the meta store fails on demand: ``metastore.recover``, a coordinator
(re)started and claimed its generation, and its recovery is about to read the meta store
(no context). Its ``raise`` is a ``MetaStoreError``, as a store failing over raises; a
``sleep`` holds the coordinator unrecovered."""


MAINTENANCE_POINTS = (
    "maintenance.mid_compaction",
    "maintenance.mid_expiry",
    "maintenance.mid_cleanup",
)
"""Points inside a sink's maintenance pass (``Sink.maintain``, in the coordinator; context
``sink``). Delta: ``maintenance.mid_compaction``, compacted files written (and named in
the pass's journal), their commit not made; ``maintenance.mid_expiry``, the data files no
retained version needs are deleted, the log entries naming them not yet;
``maintenance.mid_cleanup``, the oldest expired log entry is deleted, the others not yet.
Iceberg: ``maintenance.mid_compaction``, compacted files written, their replace commit not
made; ``maintenance.mid_expiry``, snapshots expired, none of the files only they needed
deleted yet; ``maintenance.mid_cleanup``, some of those files deleted, not all. The next
pass finishes what a crash there left."""


ALL_POINTS = (POINTS + HANDOFF_POINTS + SINK_POINTS + LIFECYCLE_POINTS + FEED_POINTS
              + APPLY_POINTS + METASTORE_POINTS + MAINTENANCE_POINTS)
"""Every point a fault can be armed at."""


class InjectedFault(RuntimeError):
    """Raised at an armed fault point whose action is ``raise``."""


def enabled() -> bool:
    """Whether this process opted in to fault injection (``RAYSINK_FAULT_DIR`` was set)."""
    return _DIR is not None


def fault_dir() -> Path:
    """The directory arms live in; ``ConfigError`` when fault injection is off here."""
    if _DIR is None:
        from raysink.errors import ConfigError

        raise ConfigError(f"fault injection is off in this process: set {ENV_VAR} to a "
                          "private directory before raysink is imported and Ray starts "
                          "(the test fixtures do)")
    return _DIR


def _arm_path(runtime: str, point: str) -> Path:
    return fault_dir() / f"{runtime}--{point}.json"


def hit(point: str, *, runtime: str, **context: Any) -> None:
    """Fire the fault armed at ``point`` for ``runtime``, if any. Without the opt-in this
    returns at once (no file is looked at)."""
    if _DIR is None:
        return
    path = _DIR / f"{runtime}--{point}.json"
    if not path.exists():
        return
    try:
        spec = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    if not _matches(spec.get("when", {}), context):
        return
    if not _consume(path, spec, context):
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


def _consume(path: Path, spec: dict[str, Any], context: dict[str, Any]) -> bool:
    """Take one firing; ``False`` when another process took the last one first. The last
    firing leaves the ``.fired`` record, with the context it fired in (``fired_with``)."""
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
        claim.write_text(json.dumps({**spec, "fired_with": context}, default=str))
        os.rename(claim, fired)
    return True
