"""Each sink's health as status shows it: what the commits and the writers say.

A sink is ``stalled`` while its commits fail (the coordinator's own retries) or while any of
its writers cannot reach the target (a ``SinkUnavailableError`` a writer reported, as
Materialize reports connection errors through its sink statuses); ``last_error`` says
why, and ``held_by`` what holds it (a transaction left open on the target) when the sink
names it. A commit that failed with ``DataLossError`` (the data a decided epoch needs is
gone: no retry brings it back) makes it ``failed`` instead, until a commit succeeds (the
data restored); the recovery's marker check fails the coordinator the same way. Otherwise
it is ``starting`` until recovery is done, ``running`` while the runtime is
open and ``paused`` once it is closed. A writer that reaches the target again clears its
error; a successful commit clears every error of the sink.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from raysink.coordinator.metastore.base import SinkStatusRecord
from raysink.errors import DataLossError
from raysink.reports import SinkState

__all__ = ["SinkHealth", "SinkHealthBook"]


@dataclass(kw_only=True, slots=True)
class SinkHealth:
    """One sink: its lifecycle phase and the errors that make it stalled."""

    phase: SinkState = "starting"
    commit_error: str | None = None
    writer_errors: dict[int, str] = field(default_factory=dict)
    failures: int = 0
    held_by: dict[str, Any] | None = None  # what holds the commits back, when the sink says
    lost: bool = False  # the last commit error was a DataLossError

    @property
    def state(self) -> SinkState:
        if self.commit_error is not None and self.lost:
            return "failed"
        if self.commit_error is not None or self.writer_errors:
            return "stalled"
        return self.phase

    @property
    def last_error(self) -> str | None:
        if self.commit_error is not None:
            return self.commit_error
        if self.writer_errors:
            writer = min(self.writer_errors)
            return f"writer {writer}: {self.writer_errors[writer]}"
        return None


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


class SinkHealthBook:
    """Every sink's health, and what of it the meta store has already stored."""

    def __init__(self, sinks: Iterable[str]) -> None:
        self._health = {name: SinkHealth() for name in sinks}
        self._stored: dict[str, tuple[str, str | None]] = {}

    def __getitem__(self, sink: str) -> SinkHealth:
        return self._health[sink]

    def items(self) -> list[tuple[str, SinkHealth]]:
        return list(self._health.items())

    def started(self) -> None:
        for health in self._health.values():
            if health.phase == "starting":
                health.phase = "running"

    def paused(self) -> None:
        for health in self._health.values():
            health.phase = "paused"

    def commit_failed(self, sink: str, exc: BaseException) -> None:
        health = self._health.get(sink)
        if health is not None:
            health.commit_error = _describe(exc)
            health.lost = isinstance(exc, DataLossError)
            health.failures += 1
            held = getattr(exc, "held", None)
            health.held_by = dict(held) if isinstance(held, Mapping) else None

    def committed(self, sink: str) -> None:
        """A commit reached the target: it is reachable again, for the writers too (a
        writer that reported it could not reach it may have had nothing to write since,
        and would never say otherwise)."""
        health = self._health.get(sink)
        if health is not None:
            health.commit_error, health.failures, health.held_by = None, 0, None
            health.lost = False
            health.writer_errors.clear()

    def writer(self, sink: str, writer_id: int, error: str | None) -> None:
        """A writer reached the target (``error=None``) or could not."""
        health = self._health.get(sink)
        if health is None:
            return
        if error is None:
            health.writer_errors.pop(writer_id, None)
        else:
            health.writer_errors[writer_id] = error

    def errors(self) -> dict[str, str]:
        return {n: h.last_error for n, h in self._health.items() if h.last_error}

    def changed(self) -> list[tuple[str, str, str | None]]:
        """``(sink, state, error)`` of every sink whose state or error differs from what
        was last stored."""
        return [(name, h.state, h.last_error) for name, h in self._health.items()
                if self._stored.get(name) != (h.state, h.last_error)]

    def stored(self, records: Mapping[str, SinkStatusRecord]) -> None:
        """What the meta store holds now."""
        self._stored = {n: (r.state, r.last_error) for n, r in records.items()}
