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
  written twice. A Structured Streaming query bound for the first time in such a store is
  refused the same way (its batch ids number its epochs, from ``epoch_offset``).
* markers ahead of the meta store that **disagree** with each other: a sink behind the
  highest marker lacks epochs decided in another meta store, which alone can roll them
  forward. No offset gives them back, so nothing is numbered until ``metastore=`` names
  that store (or the lagging sinks leave the runtime).
* a marker that cannot be read (the target is unreachable) is read again before the next
  epoch is numbered.
* an epoch **partly** in a target above its marker (``Sink.partly_committed``: Kafka's
  writers commit their own parts before the committer writes the epoch record) that the
  meta store does not have pending: the commit that was cut there was decided in a meta
  store this one is not (the default SQLite file lost with the driver and coordinator
  together, say). Only that store knows the other parts, and a new decision of the epoch
  would write the parts already in a second time. So that epoch is never decided again:
  an explicit write of it and implicit numbering are refused (``ConfigError``, naming the
  epoch and the writers whose parts are in) until ``metastore=`` names the store that
  decided it (its commit then completes the epoch) or ``epoch_offset=`` is at or above
  the epoch (the caller accepts that the parts not in are lost; an explicit write of the
  epoch is then skipped as in). ``ConfigError``, not ``DataLossError``: nothing is lost
  while the original store can still be named; what to do is a choice of configuration.
  The alternative, completing the epoch from a new decision with the parts already in
  left out, would be exact only if the new decision routed the same rows to the same
  writers, which nothing guarantees.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from raysink.errors import ConfigError

__all__ = ["TargetMarks", "refuse_unknown_epochs"]


@dataclass(kw_only=True, slots=True)
class TargetMarks:
    """The markers read from the targets: ``marks[sink]`` (``None``: no marker), and the
    sinks whose marker could not be read, with the error."""

    marks: dict[str, int | None] = field(default_factory=dict)
    unread: dict[str, str] = field(default_factory=dict)
    partial: dict[str, tuple[int, tuple[int, ...]]] = field(default_factory=dict)
    """Per sink, an epoch partly in its target the meta store does not know, and the
    writers whose parts are in (see the module docstring)."""

    def record(self, sink: str, marker: int | None,
               partial: tuple[int, tuple[int, ...]] | None = None) -> None:
        self.marks[sink] = marker
        self.unread.pop(sink, None)
        if partial is None:
            self.partial.pop(sink, None)
        else:
            self.partial[sink] = partial

    def failed(self, sink: str, error: BaseException) -> None:
        self.unread[sink] = f"{type(error).__name__}: {error}"

    def highest(self) -> int | None:
        """The highest marker of any sink, or epoch partly in one (never numbered again)."""
        found = [m for m in self.marks.values() if m is not None]
        found += [epoch for epoch, _ in self.partial.values()]
        return max(found, default=None)

    def floor(self, sinks: Iterable[str]) -> int | None:
        """The highest epoch every one of ``sinks`` holds by its marker (``None`` when one
        has no marker or was not read): an epoch at or below it is in every target."""
        found = [self.marks.get(s) for s in sinks]
        if not found or any(m is None for m in found):
            return None
        return min(m for m in found if m is not None)


def refuse_partly_committed(*, runtime: str, store_url: str,
                            partial: Mapping[str, tuple[int, tuple[int, ...]]],
                            describe: Mapping[str, str], epoch_offset: int | None,
                            epoch: int | None = None) -> None:
    """Raise ``ConfigError`` for an epoch partly in a target that the meta store does not
    have pending (see the module docstring), unless ``epoch_offset`` is at or above it
    (the runtime's own ``epoch_offset`` makes it that target's marker when read, so an
    explicit write of it is skipped as in). ``epoch``: an explicit epoch about to be
    decided (only a partly committed epoch equal to it matters: one below is held by
    that sink's marker); ``None``: numbering."""
    for sink, (held, writers) in sorted(partial.items()):
        if epoch is not None and epoch != held:
            continue
        if epoch is None and epoch_offset is not None and epoch_offset >= held:
            continue
        asked = ("it cannot be written again" if epoch is not None
                 else "no epoch is numbered from this meta store")
        raise ConfigError(
            f"epoch {held} is partly in the target of sink {sink!r} ({describe.get(sink, '')})"
            f": writers {list(writers)} committed their parts of it, but its commit did not "
            f"end, and the meta store {store_url} does not know it (it was decided in "
            f"another meta store, which alone knows its other parts). Deciding epoch {held} "
            f"again would write those parts twice, so {asked}. Point metastore= at the "
            f"meta store that decided it (its commit then completes the epoch), or pass "
            f"epoch_offset={held} (or higher) to go on after it, accepting that the parts "
            f"of epoch {held} not in the target are lost", runtime=runtime, sink=sink,
            epoch=held)


def refuse_unknown_epochs(*, runtime: str, store_url: str, known: int | None,
                          marks: Mapping[str, int | None], describe: Mapping[str, str],
                          epoch_offset: int | None, numbering: str = "implicit") -> None:
    """Raise ``ConfigError`` when the targets hold epochs the meta store does not know
    (their markers above ``known``, the highest epoch the store knows) and numbering
    new epochs would go wrong:

    * the sinks' markers disagree: a sink below the highest marker lacks epochs that were
      decided in a meta store this one is not; no offset can give them back, so the
      lagging sink is named and nothing is numbered (the original store rolls it forward);
    * ``epoch_offset`` is missing or below the highest marker: new epochs would be
      skipped as committed and their rows lost.

    ``numbering``: ``"implicit"`` for the runtime's own numbering (``epoch=None``),
    ``"query"`` for a Structured Streaming query bound in this store for the first time
    (its batch ids would be numbered from ``epoch_offset``)."""
    ahead = {s: m for s, m in marks.items() if m is not None and (known is None or m > known)}
    if not ahead:
        return
    top = max(ahead.values())
    sink = max(ahead, key=lambda s: ahead[s])
    lagging = {s: m for s, m in marks.items() if m is None or m < top}
    if lagging:
        raise ConfigError(_lagging_message(store_url, known, top, sink, lagging),
                          runtime=runtime, sink=min(lagging))
    if epoch_offset is not None and epoch_offset >= top:
        return
    if epoch_offset is not None:
        raise ConfigError(
            f"epoch_offset={epoch_offset} is below epoch {top}, which the target of sink "
            f"{sink!r} already holds: new epochs would be skipped as committed and their "
            f"rows lost. Use epoch_offset={top} or higher", runtime=runtime, sink=sink)
    holds = ", ".join(f"sink {s!r} ({describe.get(s, '')}) holds epoch {m}"
                      for s, m in sorted(ahead.items()))
    store_knows = "no epoch of it" if known is None else f"epochs up to {known} only"
    raise ConfigError(
        f"the meta store {store_url} knows {store_knows} of this runtime, but its targets "
        f"hold more: {holds}. {_NUMBERING[numbering]} Point metastore= at the meta store "
        f"these targets were written with, or pass epoch_offset={top} (or higher) to go "
        f"on after epoch {top}{_EXPLICIT[numbering]}", runtime=runtime, sink=sink)


_NUMBERING = {
    "implicit": "An epoch numbered from this meta store could be skipped as already "
                "committed and its rows lost, so no epoch is numbered implicitly.",
    "query": "This streaming query's micro-batches would be numbered from epoch 1 and "
             "every one at or below that epoch skipped as already committed, its rows "
             "lost, so the query is not bound to the runtime.",
}
_EXPLICIT = {
    "implicit": "; an explicit epoch (epoch=N) is written, or skipped where the target "
                "already holds it",
    "query": " (a new query, with a new checkpoint location); the same query restarted "
             "from its checkpoint needs the meta store it was bound in",
}


def _lagging_message(store_url: str, known: int | None, top: int, sink: str,
                     lagging: Mapping[str, int | None]) -> str:
    behind = ", ".join(f"sink {s!r} {'holds no epoch' if m is None else f'holds epoch {m}'}"
                       for s, m in sorted(lagging.items()))
    store_knows = "no epoch" if known is None else f"epochs up to {known} only"
    return (
        f"the targets of this runtime disagree: sink {sink!r} holds epoch {top}, but "
        f"{behind}, and the meta store {store_url} knows {store_knows}. The epochs "
        f"between were decided in another meta store, which still holds what the lagging "
        f"sinks need to catch up; going on from here (epoch_offset={top}) would leave "
        f"them without those epochs for good. Point metastore= at the meta store these "
        f"targets were written with; or, if the lagging sinks' targets should not have "
        f"those epochs, run this runtime without them")
