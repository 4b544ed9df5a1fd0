"""What the runtime reports: one ``EpochReport`` per ``write*`` call, and ``RuntimeStatus``
with a ``SinkStatus`` per sink (``rt.status()``, built by the coordinator; ``raysink
status`` builds the same from the meta store alone)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = ["EpochReport", "RuntimeStatus", "SinkState", "SinkStatus"]

SinkState = Literal["starting", "running", "stalled", "paused", "dropped"]


@dataclass(frozen=True, kw_only=True, slots=True)
class EpochReport:
    """What one ``write*`` call did.

    ``committed``: the epoch is visible in every sink (or, ``False``, decided and rolling
    forward). ``skipped``: none of this call's rows were written, because every sink held
    the epoch already (a replay of an epoch committed before, or one another driver of
    the runtime committed with other data); ``skipped_sinks`` names the sinks that held
    it. ``rows``: the rows written (counted once, whatever the sinks), 0 when skipped; with
    some sinks skipped, the rows written to the others."""

    epoch: int
    rows: int
    committed: bool
    skipped: bool
    skipped_sinks: tuple[str, ...]
    attempts: int
    seconds: float


@dataclass(frozen=True, kw_only=True, slots=True)
class SinkStatus:
    """One sink: ``stalled`` while its commits fail or a writer cannot reach its target
    (``last_error`` says why); ``history`` holds its recent state changes."""

    state: SinkState
    last_committed_epoch: int | None
    last_error: str | None
    history: list[dict[str, Any]] = field(default_factory=list)


@dataclass(frozen=True, kw_only=True, slots=True)
class RuntimeStatus:
    """The runtime: its last epoch every sink committed, the epochs decided but not yet
    visible everywhere, the epoch being written (``open_epoch``), and a fatal error that
    stopped the coordinator (``error``), if any."""

    name: str
    metastore: str
    last_committed_epoch: int | None
    pending_epochs: list[int]
    sinks: dict[str, SinkStatus]
    open_epoch: int | None = None
    error: str | None = None
