"""What the runtime's actors and the driver send each other, as frozen dataclasses.

::

    coordinator.open_epoch(E | None, timeout)            -> OpenedEpoch
    writer.barrier(barrier, attempt, last_seq)           -> BarrierAck   (pre-committed:
                                                            carries its CommitRequest)
    coordinator.commit_epoch(E, attempt, [CommitRequest], timeout)
                                                         -> CommitWait   (the driver
                                                            gathered the requests)
    coordinator.wait_committed(E, timeout, attempt)      -> CommitWait
    writer.drain(DRAIN barrier)                          -> DrainReport
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from raysink.sinks.base import Manifest

__all__ = ["BarrierAck", "CommitRequest", "CommitWait", "DrainReport", "OpenedEpoch"]


@dataclass(frozen=True, kw_only=True, slots=True)
class OpenedEpoch:
    """Write ``(epoch, attempt)``; or, with ``skip``, nothing: the epoch is in every target
    already (``skipped_sinks`` lists them all). ``generation``: the coordinator's.
    ``committed_through``: every sink held every epoch up to it when the epoch opened
    (``None``: none yet); the writers' barriers carry it (``raysink.writer.ordering``)."""

    epoch: int
    attempt: int = 0
    skip: bool = False
    skipped_sinks: tuple[str, ...] = ()
    generation: int = 0
    committed_through: int | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class CommitWait:
    """Whether every sink made the epoch visible before the wait ended. ``aborted``: the
    epoch's attempt was aborted (nothing to wait for); ``errors``: why a sink is stalled;
    ``skipped_sinks``: the sinks whose marker already held the epoch; ``generation``: the
    coordinator's; ``next_attempt``: the attempt the epoch after this one would open
    with (the driver sends that epoch's data before its open)."""

    committed: bool
    aborted: bool = False
    skipped_sinks: tuple[str, ...] = ()
    errors: Mapping[str, str] = field(default_factory=dict)
    generation: int = 0
    next_attempt: int = 0


@dataclass(frozen=True, kw_only=True, slots=True)
class CommitRequest:
    """A writer's pre-commit of its share of ``(epoch, attempt)`` of ``sink``: its
    manifest and the schema it wrote (``raysink._schema.encode``), if it saw one, and the
    rows it applied (for the metrics). A ``None`` manifest stands for a writer that
    received nothing in the attempt, so staged nothing: the driver answers for it without
    asking it."""

    sink: str
    writer: int
    epoch: int
    attempt: int
    manifest: Manifest | None
    schema: str | None = None
    rows: int = 0


@dataclass(frozen=True, kw_only=True, slots=True)
class BarrierAck:
    """A writer pre-committed its share of an attempt: the rows it applied, and its
    commit request for the coordinator."""

    rows: int
    request: CommitRequest


@dataclass(frozen=True, kw_only=True, slots=True)
class DrainReport:
    """A writer closed: its rows over its life, and the undecided attempt it dropped."""

    sink: str
    writer: int
    rows_total: int
    swept: tuple[int, int] | None = None
