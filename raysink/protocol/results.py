"""What the coordinator and the writers answer besides the epoch messages, as dataclasses.

::

    coordinator.resolve(E, attempt)        -> Resolution      (COMMITTED | ROLLING_FORWARD
                                                                | ABORTED)
    coordinator.set_layout(writers)        -> WriterLayout    (rescale)
    coordinator.epoch_source()             -> EpochSource | None
    coordinator.bind_source(EpochSource)
    coordinator.recovery(timeout)          -> RecoveryState   (has it recovered?)
    writer.process()                       -> ActorProcess (raysink.reports), whose
                                              mailbox is the writer's WriterStatus

``EpochSource`` is kept in the meta store as a JSON object (``to_record``/``from_record``).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["EpochSource", "RecoveryState", "Resolution", "WriterLayout", "WriterStatus"]


class Resolution(str, enum.Enum):
    """What became of an epoch, from the meta store: the driver never guesses."""

    COMMITTED = "COMMITTED"
    ROLLING_FORWARD = "ROLLING_FORWARD"
    ABORTED = "ABORTED"


@dataclass(frozen=True, kw_only=True, slots=True)
class EpochSource:
    """What numbers a runtime's epochs: a Structured Streaming query (``kind="query"``,
    its ``id``; epoch = ``batch_id + 1 + offset``), or nothing (the runtime's own
    numbering, when no source is bound)."""

    kind: str
    id: str
    offset: int = 0

    def to_record(self) -> dict[str, Any]:
        return {"kind": self.kind, "id": self.id, "offset": self.offset}

    @classmethod
    def from_record(cls, record: Mapping[str, Any] | None) -> EpochSource | None:
        if not record:
            return None
        return cls(kind=str(record.get("kind", "")), id=str(record.get("id", "")),
                   offset=int(record.get("offset", 0)))


@dataclass(frozen=True, kw_only=True, slots=True)
class RecoveryState:
    """Whether the coordinator has recovered from the meta store (only then are its
    ``pending_epochs`` the decided epochs to commit: before, it knows none). ``retrying``:
    why recovery is being tried again (a meta store that fails over); ``fatal``: why this
    coordinator stopped for good (fenced, or a target deleted after commits)."""

    recovered: bool
    pending_epochs: tuple[int, ...] = ()
    retrying: str | None = None
    fatal: str | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class WriterLayout:
    """The writer layout an OPEN record keeps: per sink, its writers and a digest of their
    vnode bitmaps (the bitmaps follow from the writer count)."""

    writers: Mapping[str, int]
    digests: Mapping[str, str]

    def to_record(self) -> dict[str, Any]:
        return {"sinks": {name: {"writers": count, "digest": self.digests[name]}
                          for name, count in self.writers.items()}}


@dataclass(frozen=True, kw_only=True, slots=True)
class WriterStatus:
    """One writer actor's state: what it holds and how busy its mailbox is."""

    sink: str
    writer: int
    pid: int
    rows_total: int
    epoch: int | None
    attempt: int | None
    epochs_here: tuple[tuple[int, int], ...]
    waiting_for_feeds: Mapping[str, list[Any]]  # per 'epoch/attempt', the feeds awaited
    mailbox_depth: int
    mailbox_bytes: int
    refused: int
    busy: Mapping[str, Any] | None  # the sink call running longer than a warning, if any
    slow_warnings: int
    closed: bool
