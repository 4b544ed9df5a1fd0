"""The coordinator's book of epochs, without Ray: what it knows of each epoch in flight,
the sinks' progress, and the sweeps of aborted attempts.

``EpochBook`` is the state ``EpochCoordinator`` works on (``raysink.coordinator.epochs``):
``Recovery`` (``recovery``) fills it from the meta store and the targets' markers on
start, phase one (``epochs``) opens and decides epochs in it, ``Commits`` (``commits``)
takes the decided ones to the targets. The dataclasses here are what those steps answer.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from raysink import _schema
from raysink.coordinator.markers import TargetMarks
from raysink.coordinator.metastore.base import EpochState, MetaStore
from raysink.errors import (
    FencedError,
    MetaStoreError,
    RaySinkError,
    RescaleRefusedError,
    SchemaMismatchError,
    SinkUnavailableError,
)
from raysink.protocol.results import Resolution, WriterLayout
from raysink.protocol.vnodes import Bitmap, CoverageTracker
from raysink.sinks.base import Manifest, Sink

__all__ = ["CommitOutcome", "CommitStep", "EpochBook", "EpochEntry", "OpenDecision", "Resolution"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class OpenDecision:
    """The answer to ``open_epoch``: write ``(epoch, attempt)``, or skip, or wait."""

    epoch: int
    attempt: int = 0
    skip: bool = False
    wait_roll_forward: bool = False


@dataclass(frozen=True, kw_only=True, slots=True)
class CommitStep:
    """The next commit of one sink: its share of the oldest PENDING epoch it lacks."""

    epoch: int
    sink: str
    manifests: tuple[Manifest, ...]
    attempt: int

    @property
    def carries_nothing(self) -> bool:
        """The decided attempt staged nothing in this sink (no manifest: every writer of
        it idle) and is the epoch's first, so no failed attempt may have left anything
        for the commit to clear away: the target need not be called."""
        return not self.manifests and self.attempt == 0


@dataclass(frozen=True, kw_only=True, slots=True)
class CommitOutcome:
    """One sink commit step done: committed, or ``skipped``: the target held the epoch
    already and its data is not known to be this decision's (another driver's, with a
    meta store of its own, or one the target cannot tell); ``marked``: the commit left the
    marker in the target."""

    epoch: int
    sink: str
    skipped: bool
    marked: bool = True


@dataclass(kw_only=True, slots=True)
class EpochEntry:
    """In-memory view of one epoch across all sinks."""

    epoch: int
    attempt: int
    state: EpochState
    manifests: dict[str, list[Manifest]] = field(default_factory=dict)
    committed: set[str] = field(default_factory=set)
    skipped: set[str] = field(default_factory=set)
    coverage: dict[str, CoverageTracker[Manifest | None]] = field(default_factory=dict)
    schemas: dict[str, str] = field(default_factory=dict)
    complete: bool = False  # every writer's request is in; PENDING is being written
    recorded: bool = True  # False: opened in memory only (its open came with the data)


class EpochBook:
    """The epochs of one runtime as the coordinator knows them, over a meta store and its
    sinks (see ``EpochCoordinator`` for the options)."""

    def __init__(
        self,
        *,
        runtime: str,
        store: MetaStore,
        sinks: Mapping[str, Sink],
        generation: int,
        bitmaps: Mapping[str, Sequence[Bitmap]],
        max_pending_epochs: int = 2,
        epoch_offset: int | None = None,
    ) -> None:
        self.runtime = runtime
        self.store = store
        self.sinks = dict(sinks)
        self.generation = generation
        self.max_pending_epochs = max_pending_epochs
        self.epoch_offset = epoch_offset
        self._marks = TargetMarks()
        self._io = {name: threading.Lock() for name in self.sinks}
        # (epoch, sink) commits this process took to the target and has not recorded yet
        self._tried: set[tuple[int, str]] = set()
        self._unswept: set[int] = set()
        self._bitmaps = {name: list(maps) for name, maps in bitmaps.items()}
        self._epochs: dict[int, EpochEntry] = {}
        self._last_committed: int | None = None
        self._aborted: dict[int, int] = {}
        self._sink_committed: dict[str, int | None] = dict.fromkeys(self.sinks)
        # the last committed epoch whose commit left the sink's marker in its target:
        # what the marker must match (an empty first epoch with no schema leaves none)
        self._sink_marked: dict[str, int | None] = dict.fromkeys(self.sinks)
        # per evolving sink, the schema its decided epochs evolve the target to (as far as
        # this coordinator saw them: the epochs it decided or recovered PENDING)
        self._decided_schemas: dict[str, pa.Schema] = {}

    @property
    def last_committed(self) -> int | None:
        """Highest epoch committed by every sink."""
        return self._last_committed

    def sink_last_committed(self, sink: str) -> int | None:
        return self._sink_committed.get(sink)

    def pending_epochs(self) -> list[int]:
        """Epochs decided (PENDING) but not yet committed by every sink, in order."""
        return sorted(e.epoch for e in list(self._epochs.values())
                      if e.state is EpochState.PENDING)

    def open_epoch_number(self) -> int | None:
        opened = [e.epoch for e in list(self._epochs.values()) if e.state is EpochState.OPEN]
        return opened[0] if opened else None

    def outstanding(self) -> int:
        """OPEN plus PENDING epochs: what ``max_pending_epochs`` bounds."""
        return sum(1 for e in list(self._epochs.values())
                   if e.state in (EpochState.OPEN, EpochState.PENDING))

    def epoch_state(self, epoch: int) -> EpochState | None:
        """COMMITTED also for an epoch every target's marker holds though the meta store
        does not know it (a replay after the store was lost)."""
        if self._last_committed is not None and epoch <= self._last_committed:
            return EpochState.COMMITTED
        entry = self._epochs.get(epoch)
        if entry is not None:
            return entry.state
        floor = self._marks.floor(self.sinks)
        return EpochState.COMMITTED if floor is not None and epoch <= floor else None

    def committed_through(self) -> int | None:
        """The highest epoch every sink holds, by the meta store or by the markers."""
        known = [e for e in (self._last_committed, self._marks.floor(self.sinks))
                 if e is not None]
        return max(known, default=None)

    def decided_through(self) -> int | None:
        """The highest epoch every sink holds or will hold: ``committed_through`` or a
        PENDING epoch above it (decided: it only rolls forward, it is never given up)."""
        known = [e for e in (self.committed_through(), *self.pending_epochs())
                 if e is not None]
        return max(known, default=None)

    def skipped_sinks(self, epoch: int) -> tuple[str, ...]:
        entry = self._epochs.get(epoch)
        return tuple(sorted(entry.skipped)) if entry else ()

    def sink_io(self, sink: str) -> threading.Lock:
        """The lock held around every call into ``sink`` (commits run beside others)."""
        return self._io[sink]

    def layout(self) -> dict[str, Any]:
        """The writer layout an OPEN record keeps: per sink, the writers and a digest of
        their bitmaps (constant size: the bitmaps themselves follow from the writer count
        and would make every OPEN grow with the writers)."""
        return self.writer_layout().to_record()

    def writer_layout(self) -> WriterLayout:
        """Per sink, its writers and the digest of their vnode bitmaps."""
        return WriterLayout(writers={n: len(maps) for n, maps in self._bitmaps.items()},
                            digests={n: _digest(maps) for n, maps in self._bitmaps.items()})

    def set_layout(self, bitmaps: Mapping[str, Sequence[Bitmap]]) -> None:
        """New writer bitmaps, effective from the next epoch (rescale): the next opened
        one, or the next one whose open travels with its data. Refused
        (``RescaleRefusedError``) while an epoch is open; decided epochs keep the
        manifests they were decided with."""
        opened = self.open_epoch_number()
        if opened is not None:
            raise RescaleRefusedError(
                f"epoch {opened} is open (being written, or failed and not yet resolved): "
                "rescale between epochs", runtime=self.runtime, epoch=opened)
        if set(bitmaps) != set(self.sinks):
            raise RaySinkError(f"a layout for sinks {sorted(bitmaps)}, the runtime has "
                               f"{sorted(self.sinks)}", runtime=self.runtime)
        self._bitmaps = {name: list(maps) for name, maps in bitmaps.items()}

    def next_attempt(self, epoch: int) -> int:
        """The attempt number ``epoch`` would be opened with now."""
        entry = self._epochs.get(epoch)
        used = max(self._aborted.get(epoch, -1), -1 if entry is None else entry.attempt)
        return used + 1

    def _sweep_left(self, raising: bool = True, epoch: int | None = None) -> None:
        """Sweep, by epoch, the staging no sweep could reach yet (all, or only ``epoch``:
        before it is opened again). ``raising``: a target still unreachable is
        ``SinkUnavailableError`` (the epoch cannot be written before it is swept)."""
        for left in sorted(self._unswept if epoch is None else self._unswept & {epoch}):
            failed = self._sweep(left, 0, manifests=None, recorded=False)
            if not failed:
                self._unswept.discard(left)
            elif raising:
                sink, error = next(iter(failed.items()))
                raise SinkUnavailableError(
                    f"the staging of epoch {left} in sink {sink!r} could not be swept "
                    f"({error}); the epoch is written again once it is, so retry when the "
                    "target is reachable", runtime=self.runtime, sink=sink, epoch=left)

    def abort(self, epoch: int, attempt: int) -> None:
        """Abort an OPEN attempt: record ABORTED, sweep every sink's staging, forget it."""
        entry = self._epochs.get(epoch)
        if entry is None or entry.state is not EpochState.OPEN or entry.attempt != attempt:
            return
        self._sweep(epoch, attempt, manifests=None, recorded=entry.recorded)
        del self._epochs[epoch]

    def _sweep(self, epoch: int, attempt: int, manifests: Mapping[str, Any] | None,
               recorded: bool = True) -> dict[str, str]:
        """Sweep every sink's staging of ``epoch`` (``recorded``: with its records ABORTED
        first and deleted after). Returns the sinks that could not be swept, with why.

        The attempt number counts as used whatever the sweep does (an attempt number is
        never staged twice). A sink that cannot be swept now (its target unreachable)
        leaves the epoch *unswept*: it is swept by its number before the epoch is opened
        again (``_sweep_left``), and its ABORTED records stay until then. What an aborted
        attempt staged is never part of a decision, so until then it is only garbage.

        An epoch the store has no record of is swept by its number alone, and so never in
        a sink whose marker holds it: that epoch was committed there (by a meta store this
        one is not), and its staged files are the table's own files, which versions of
        the table other than the current one may still reference (time travel)."""
        if recorded:
            self.store.put_aborted(self.runtime, self.generation, epoch, attempt)
        self._aborted[epoch] = max(attempt, self._aborted.get(epoch, -1))
        failed: dict[str, str] = {}
        for name, sink in self.sinks.items():
            with self._io[name]:
                try:
                    if recorded or not holds_epoch(sink, epoch):
                        sink.abort(epoch, None if manifests is None else manifests.get(name))
                except (FencedError, MetaStoreError):
                    raise
                except Exception as exc:
                    failed[name] = f"{type(exc).__name__}: {exc}"
        if failed:
            self._unswept.add(epoch)
            log.warning("could not sweep the staging of epoch %s in %s yet; it is swept "
                        "before the epoch is written again", epoch, failed)
        elif recorded:
            self.store.delete_aborted(self.runtime, self.generation, epoch)
        return failed

    def _note_sink_committed(self, sink: str, epoch: int, *, marked: bool) -> None:
        for seen in (self._sink_committed, self._sink_marked) if marked else (
                self._sink_committed,):
            current = seen.get(sink)
            if current is None or epoch > current:
                seen[sink] = epoch

    def _complete(self, epoch: int) -> None:
        """Every sink committed ``epoch``: forget it, raise the high-water mark."""
        self._epochs.pop(epoch, None)
        if self._last_committed is None or epoch > self._last_committed:
            self._last_committed = epoch

    def _note_decided_schemas(self, schemas: Mapping[str, pa.Schema]) -> None:
        """Remember the schemas of a decided epoch (evolving sinks only). Never raises:
        the epoch is decided already (``gather`` checked it)."""
        for name, schema in schemas.items():
            sink = self.sinks.get(name)
            if sink is None or sink.schema_evolution != "add_columns":
                continue
            try:
                self._decided_schemas[name] = evolved_schema(self._decided_schemas.get(name),
                                                       schema, sink)
            except SchemaMismatchError as exc:
                log.warning("sink %s: the schema of a decided epoch does not evolve the one "
                            "before it (%s); checking later epochs against it alone", name,
                            exc)
                self._decided_schemas[name] = _schema.loosen(schema)


def evolved_schema(reference: pa.Schema | None, schema: pa.Schema, sink: Sink) -> pa.Schema:
    """``reference`` evolved by ``schema`` under the sink's rules, every column nullable
    (the target, not the coordinator, knows which columns must be set)."""
    if reference is None:
        return _schema.loosen(schema)
    return _schema.loosen(_schema.evolve(reference, schema, sink.evolution_rules()).schema)


def manifest_schemas(manifests: Mapping[str, Sequence[Manifest]]) -> dict[str, pa.Schema]:
    """Per sink, the union of the schemas its recovered manifests report."""
    found: dict[str, pa.Schema] = {}
    for name, listed in manifests.items():
        try:
            united = _schema.united(listed)
        except SchemaMismatchError as exc:  # decided already: never refuse it now
            log.warning("sink %s: recovered manifests disagree on the schema: %s", name, exc)
            continue
        if united is not None:
            found[name] = united
    return found


def _digest(bitmaps: Sequence[Bitmap]) -> str:
    return hashlib.sha256("".join(b.to_hex() for b in bitmaps).encode()).hexdigest()[:16]


def holds_epoch(sink: Sink, epoch: int) -> bool:
    """Whether the sink's marker holds ``epoch`` (a marker that cannot be read raises:
    the sweep is tried again later)."""
    marker = sink.committed_epoch()
    return marker is not None and marker >= epoch


def target_exists(sink: Sink) -> bool:
    """``sink.target_exists()``; a probe that cannot answer is not evidence of loss."""
    try:
        return sink.target_exists()
    except MetaStoreError:
        raise
    except Exception:
        return True
