"""What the targets say: every sink's progress marker, read when the coordinator starts.

The meta store holds the epoch decisions; each target holds a marker of the last epoch
committed to it (``Sink.committed_epoch``). On start, before the first epoch (RisingWave's
``AlignInitialEpoch``), the coordinator reads every marker and reconciles the two:

* a marker **behind** the meta store with no epoch pending: the marker was lost. It is
  re-created when the target exists; a target gone after commits is ``DataLossError``.
* a marker **ahead of everything the meta store knows** of the runtime: the store is not
  the one these targets were written with (the default SQLite file is fresh whenever a
  job starts from another directory; or an old copy was restored). An epoch numbered at
  or below the marker would be skipped as already committed and its rows silently lost.
  So new epochs are never numbered at or below any marker, and an implicit epoch
  (``epoch=None``) is refused with ``ConfigError`` until the caller says how to go on:
  ``metastore=`` the original store, or ``epoch_offset=`` at or above the marker.
  Explicit epochs go ahead (a replay): where a marker holds one it is skipped, never
  written twice.
* a marker that cannot be read (the target is unreachable) is read again before the next
  epoch is numbered.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from raysink.errors import ConfigError

__all__ = ["TargetMarks"]


@dataclass(kw_only=True, slots=True)
class TargetMarks:
    """The markers read from the targets: ``marks[sink]`` (``None``: no marker), and the
    sinks whose marker could not be read, with the error."""

    marks: dict[str, int | None] = field(default_factory=dict)
    unread: dict[str, str] = field(default_factory=dict)

    def record(self, sink: str, marker: int | None) -> None:
        self.marks[sink] = marker
        self.unread.pop(sink, None)

    def failed(self, sink: str, error: BaseException) -> None:
        self.unread[sink] = f"{type(error).__name__}: {error}"

    def highest(self) -> int | None:
        """The highest marker of any sink."""
        return max((m for m in self.marks.values() if m is not None), default=None)

    def floor(self, sinks: Iterable[str]) -> int | None:
        """The highest epoch every one of ``sinks`` holds by its marker (``None`` when one
        has no marker or was not read): an epoch at or below it is in every target."""
        found = [self.marks.get(s) for s in sinks]
        if not found or any(m is None for m in found):
            return None
        return min(m for m in found if m is not None)

    def ahead_of(self, known: int | None) -> dict[str, int]:
        """The sinks whose marker is above ``known`` (the highest epoch the meta store
        knows of the runtime, ``None``: none), with their markers."""
        return {s: m for s, m in self.marks.items()
                if m is not None and (known is None or m > known)}


def refuse_implicit_epoch(*, runtime: str, store_url: str, known: int | None,
                          ahead: Mapping[str, int], describe: Mapping[str, str],
                          epoch_offset: int | None) -> None:
    """Raise ``ConfigError`` unless ``epoch_offset`` acknowledges every marker in ``ahead``
    (the targets' markers above what the meta store knows)."""
    if not ahead:
        return
    top = max(ahead.values())
    sink = max(ahead, key=lambda s: ahead[s])
    if epoch_offset is not None and epoch_offset >= top:
        return
    holds = ", ".join(f"sink {s!r} ({describe.get(s, '')}) holds epoch {m}"
                      for s, m in sorted(ahead.items()))
    store_knows = "no epoch of it" if known is None else f"epochs up to {known} only"
    if epoch_offset is not None:
        raise ConfigError(
            f"epoch_offset={epoch_offset} is below epoch {top}, which the target of sink "
            f"{sink!r} already holds: new epochs would be skipped as committed and their "
            f"rows lost. Use epoch_offset={top} or higher", runtime=runtime, sink=sink)
    raise ConfigError(
        f"the meta store {store_url} knows {store_knows} of this runtime, but its targets "
        f"hold more: {holds}. An epoch numbered from this meta store could be skipped as "
        "already committed and its rows lost, so no epoch is numbered implicitly. Point "
        "metastore= at the meta store these targets were written with, or pass "
        f"epoch_offset={top} (or higher) to go on after epoch {top}; an explicit epoch "
        "(epoch=N) is written, or skipped where the target already holds it",
        runtime=runtime, sink=sink)
