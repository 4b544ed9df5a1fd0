"""What the runtime's actors answer the driver, as frozen dataclasses (not dicts).

::

    coordinator.open_epoch(E | None, timeout)          -> OpenedEpoch
    coordinator.wait_committed(E, timeout, attempt)    -> CommitWait
    writer.barrier(barrier, attempt, last_seq)         -> BarrierAck  (pre-committed, its
                                                          CommitRequest recorded)
    writer -> coordinator.commit_request(CommitRequest) -> None      (recorded, not decided)
    writer.drain(DRAIN barrier)                        -> DrainReport
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from raysink.errors import RaySinkError

__all__ = ["BarrierAck", "CommitRequest", "CommitWait", "DrainReport", "OpenedEpoch"]


@dataclass(frozen=True, kw_only=True, slots=True)
class OpenedEpoch:
    """Write ``(epoch, attempt)``; or, with ``skip``, nothing: the epoch is in every target
    already (``skipped_sinks`` lists them all)."""

    epoch: int
    attempt: int = 0
    skip: bool = False
    skipped_sinks: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True, slots=True)
class CommitWait:
    """Whether every sink made the epoch visible before the wait ended. ``aborted``: the
    epoch's attempt was aborted (nothing to wait for); ``errors``: why a sink is stalled;
    ``skipped_sinks``: the sinks whose marker already held the epoch."""

    committed: bool
    aborted: bool = False
    skipped_sinks: tuple[str, ...] = ()
    errors: Mapping[str, str] = field(default_factory=dict)
    error: RaySinkError | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class CommitRequest:
    """A writer's pre-commit of its share of ``(epoch, attempt)`` of ``sink``: its
    manifest and the schema it wrote (``raysink._schema.encode``), if it saw one."""

    sink: str
    writer: int
    epoch: int
    attempt: int
    manifest: dict[str, Any]
    schema: str | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class BarrierAck:
    """A writer's epoch is PENDING: the rows it applied and the manifest it staged."""

    rows: int
    manifest: Mapping[str, Any]


@dataclass(frozen=True, kw_only=True, slots=True)
class DrainReport:
    """A writer closed: its rows over its life, and the undecided attempt it dropped."""

    sink: str
    writer: int
    rows_total: int
    swept: tuple[int, int] | None = None
