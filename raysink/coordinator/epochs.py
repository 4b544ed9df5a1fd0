"""The coordinator's state machine, without Ray: epochs, two-phase commit, recovery.

``EpochCoordinator`` owns the decisions of one runtime. It is synchronous and single
threaded; ``CoordinatorActor`` drives it from an asyncio loop (blocking calls in a thread,
one at a time) and adds the waiting: futures for commit requests, backoff timers.

One epoch, as this class sees it::

    open_epoch(E)              OPEN(E, attempt, layout) recorded for every sink
    commit_request(...) * n    one per writer of every sink; stale attempts refused;
                               vnode bitmaps must cover every vnode of a sink, no overlap
      -> all covered           PENDING(E, manifests of all sinks) in one transaction
    next_commit(sink)          each sink on its own, in epoch order (one stalled sink does
    run_commit(step)           not hold the others): skip when the sink's marker says it
    record_commit(outcome)     is there, else sink.commit; then COMMITTED for that sink
    resolve(E)                 COMMITTED | ROLLING_FORWARD | ABORTED (an OPEN attempt is
                               aborted and its staging swept first)

Before PENDING any failure aborts the attempt; after PENDING the epoch only rolls forward.
The decision is shared by all sinks; only the commits are per sink.

On start, ``recover`` loads the meta store and ``reconcile_markers`` reads every target's
marker (``raysink.coordinator.markers``): new epochs are never numbered at or below a
marker, and an implicit epoch is refused while a target holds epochs the store does not
know.

Threads: ``CoordinatorActor`` runs every method here in a worker thread, one at a time,
except ``run_commit``, which does only the sink's I/O (under that sink's own lock) and may
run beside the others, one per sink. Reads from the event loop copy before they iterate.
"""

from __future__ import annotations

import enum
import hashlib
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import pyarrow as pa

from raysink import _faults, _schema
from raysink.coordinator.markers import TargetMarks, refuse_unknown_epochs
from raysink.coordinator.metastore.base import EpochRecord, EpochState, MetaStore
from raysink.errors import (
    BackpressureError,
    DataLossError,
    EpochRegressionError,
    FencedError,
    MetaStoreError,
    RaySinkError,
    RescaleRefusedError,
    SchemaMismatchError,
    SinkUnavailableError,
    StaleAttemptError,
)
from raysink.protocol.messages import CommitRequest
from raysink.protocol.vnodes import Bitmap, CoverageTracker
from raysink.sinks.base import CommitResult, Manifest, Sink

__all__ = [
    "CommitOutcome",
    "CommitStep",
    "EpochCoordinator",
    "OpenDecision",
    "Resolution",
    "StaleAttemptError",
]

log = logging.getLogger(__name__)


class Resolution(str, enum.Enum):
    """What became of an epoch, from the meta store: the driver never guesses."""

    COMMITTED = "COMMITTED"
    ROLLING_FORWARD = "ROLLING_FORWARD"
    ABORTED = "ABORTED"


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
class _Epoch:
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


class EpochCoordinator:
    """Epoch decisions of one runtime over a meta store and its sinks.

    ``bitmaps`` gives each sink's writers their vnode bitmaps (the writer layout of the
    next epoch; ``set_layout`` changes it between epochs, which is how rescale fits).
    ``epoch_offset``: implicit epochs are numbered above it (it also acknowledges targets
    whose markers are ahead of the meta store, see ``raysink.coordinator.markers``).
    """

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
        self._epochs: dict[int, _Epoch] = {}
        self._last_committed: int | None = None
        self._aborted: dict[int, int] = {}
        self._sink_committed: dict[str, int | None] = dict.fromkeys(self.sinks)
        # the last committed epoch whose commit left the sink's marker in its target:
        # what the marker must match (an empty first epoch with no schema leaves none)
        self._sink_marked: dict[str, int | None] = dict.fromkeys(self.sinks)
        # per evolving sink, the schema its decided epochs evolve the target to (as far as
        # this coordinator saw them: the epochs it decided or recovered PENDING)
        self._decided_schemas: dict[str, pa.Schema] = {}

    # ------------------------------------------------------------------ queries

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
        return {"sinks": {name: {"writers": len(maps), "digest": _digest(maps)}
                          for name, maps in self._bitmaps.items()}}

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

    # ------------------------------------------------------------------ recovery

    def recover(self) -> list[int]:
        """Load the meta store: keep COMMITTED, queue PENDING, abort OPEN and ABORTED.

        Returns the epochs that were aborted. PENDING epochs are left for the commits.
        """
        by_epoch: dict[int, list[EpochRecord]] = {}
        for record in self.store.records(self.runtime):
            if record.sink in self.sinks:
                by_epoch.setdefault(record.epoch, []).append(record)
        aborted: list[int] = []
        for epoch in sorted(by_epoch):
            if self._recover_epoch(epoch, by_epoch[epoch]):
                aborted.append(epoch)
        self._sweep_unrecorded(max(by_epoch, default=0))
        return aborted

    def _sweep_unrecorded(self, known: int) -> None:
        """Sweep the staging of the epochs after every one recorded, up to
        ``max_pending_epochs`` of them: an epoch whose open travelled with its data may
        have been staged by writers and never recorded (the coordinator or the driver died
        first), and the runtime only sends such an epoch right after the last one it
        knows, at most that many ahead. Their attempt 0 counts as used (an attempt number
        is never staged twice); a driver still feeding one (the coordinator restarted
        under it) began it under the previous generation, so ``gather`` refuses it.

        A target that cannot be reached now is swept later: before that epoch is opened
        or decided (``_sweep_left``)."""
        for epoch in range(known + 1, known + 1 + self.max_pending_epochs):
            self._aborted[epoch] = max(0, self._aborted.get(epoch, -1))
            self._unswept.add(epoch)
        self._sweep_left(raising=False)

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

    def next_attempt(self, epoch: int) -> int:
        """The attempt number ``epoch`` would be opened with now."""
        entry = self._epochs.get(epoch)
        used = max(self._aborted.get(epoch, -1), -1 if entry is None else entry.attempt)
        return used + 1

    def _recover_epoch(self, epoch: int, records: list[EpochRecord]) -> bool:
        states = {r.state for r in records}
        for record in records:
            if record.state is EpochState.COMMITTED:
                self._note_sink_committed(record.sink, epoch, marked=record.marked)
        if states <= {EpochState.COMMITTED}:
            self._complete(epoch)
            return False
        if EpochState.PENDING in states:
            entry = _Epoch(epoch=epoch, attempt=records[0].attempt, state=EpochState.PENDING)
            for record in records:
                if record.state is EpochState.COMMITTED:
                    entry.committed.add(record.sink)
                else:
                    # the store keeps the JSON the sinks' writers made: their manifests
                    entry.manifests[record.sink] = cast(list[Manifest],
                                                        list(record.manifests or []))
            # a sink without a record of the epoch either went on past it (its rows were
            # pruned: committed) or was not a sink of the runtime when the epoch was
            # decided (added since, or dropped and added back): the decision wrote a row
            # for every sink it covered, so the epoch is none of its business
            recorded = {r.sink for r in records}
            entry.committed |= set(self.sinks) - recorded
            self._epochs[epoch] = entry
            self._note_decided_schemas(_manifest_schemas(entry.manifests))
            return False
        attempt = max(r.attempt for r in records)
        self._sweep(epoch, attempt, manifests=None)
        return True

    def reconcile_markers(self, sinks: Sequence[str] | None = None) -> None:
        """Read the marker of every sink (or of ``sinks``) and reconcile it with the meta
        store (see ``raysink.coordinator.markers``).

        With nothing pending, a marker behind the meta store is re-created
        (``recreate_marker``) when the target still exists; a target that is gone after
        commits is ``DataLossError``. A marker that cannot be read is remembered as unread
        and read again before the next implicit epoch is numbered.
        """
        pending = bool(self.pending_epochs())
        for name in sinks if sinks is not None else list(self.sinks):
            with self._io[name]:
                try:
                    self._marks.record(name, self._reconcile_sink(name, pending))
                except (DataLossError, MetaStoreError):
                    raise
                except Exception as exc:  # unreachable: read again before numbering
                    self._marks.failed(name, exc)
                    log.warning("sink %s: cannot read its progress marker yet (%s); reading "
                                "it again before the next epoch", name, exc)

    def _reconcile_sink(self, name: str, pending: bool) -> int | None:
        sink = self.sinks[name]
        expected = self._sink_marked.get(name)
        # the target first: a marker kept apart from the data (PostgreSQL's progress
        # table) survives a deleted data table
        if expected is not None and not _target_exists(sink):
            raise DataLossError(
                f"the target of sink {name!r} was deleted after raysink committed epoch "
                f"{expected} to it; restore it, or drop the sink from the runtime",
                runtime=self.runtime, sink=name, epoch=expected)
        marker = sink.committed_epoch()
        if expected is None or pending or (marker is not None and marker >= expected):
            return marker
        log.warning("sink %s: progress marker behind the meta store (%s < %s); re-creating",
                    name, marker, expected)
        sink.recreate_marker(expected)
        return expected

    def _store_knows(self) -> int | None:
        """The highest epoch the meta store knows this runtime committed or decided."""
        known = [e.epoch for e in list(self._epochs.values())
                 if e.state is EpochState.PENDING]
        known += [e for e in (self._last_committed, *self._sink_committed.values())
                  if e is not None]
        return max(known, default=None)

    def check_alignment(self, numbering: str = "implicit",
                        epoch_offset: int | None = None) -> None:
        """Before numbering epochs from this meta store (an implicit epoch, or a
        streaming query bound here for the first time with ``epoch_offset``): every
        marker read, none unexplained (``markers.refuse_unknown_epochs``)."""
        if self._marks.unread:
            self.reconcile_markers(list(self._marks.unread))
        if self._marks.unread:
            sink, error = next(iter(self._marks.unread.items()))
            raise SinkUnavailableError(
                f"cannot read the progress marker of sink {sink!r} ({error}), so the next "
                "epoch cannot be numbered safely; retry once the target is reachable",
                runtime=self.runtime, sink=sink)
        refuse_unknown_epochs(
            runtime=self.runtime, store_url=self.store.url, known=self._store_knows(),
            marks=self._marks.marks, describe={n: repr(s) for n, s in self.sinks.items()},
            epoch_offset=self.epoch_offset if numbering == "implicit" else epoch_offset,
            numbering=numbering)

    # ------------------------------------------------------------------ phase one

    def open_epoch(self, requested: int | None) -> OpenDecision:
        """Decide what the driver's write of ``requested`` (or the next epoch) does."""
        if requested is None:
            self.check_alignment()
        epoch = self._next_epoch() if requested is None else requested
        if epoch < 0:
            raise EpochRegressionError(f"epochs are non-negative; got {epoch}",
                                       runtime=self.runtime)
        state = self.epoch_state(epoch)
        if state is EpochState.COMMITTED:
            return OpenDecision(epoch=epoch, skip=True)
        if state is EpochState.PENDING:
            return OpenDecision(epoch=epoch, wait_roll_forward=True)
        self._refuse_regression(epoch)
        self._sweep_left(epoch=epoch)
        attempt = self._retire_open(epoch)
        self._check_backpressure(epoch)
        self.store.put_open(self.runtime, self.generation, epoch, attempt, list(self.sinks),
                            self.layout())
        self._epochs[epoch] = _Epoch(
            epoch=epoch, attempt=attempt, state=EpochState.OPEN,
            coverage={name: CoverageTracker[Manifest | None](expected=len(self._bitmaps[name]))
                      for name in self.sinks})
        _faults.hit("coordinator.after_open", runtime=self.runtime, epoch=epoch)
        return OpenDecision(epoch=epoch, attempt=attempt)

    def _next_epoch(self) -> int:
        """The epoch after every one known: in the meta store, in any target's marker, and
        ``epoch_offset``. (An OPEN epoch is a failed write the driver has not resolved: it
        is retried.)"""
        opened = self.open_epoch_number()
        if opened is not None:
            return opened
        known = [e.epoch for e in list(self._epochs.values())
                 if e.state in (EpochState.OPEN, EpochState.PENDING)]
        known += [e for e in (self._last_committed, self._marks.highest(), self.epoch_offset)
                  if e is not None]
        return max(known) + 1 if known else 1

    def _refuse_regression(self, epoch: int) -> None:
        for entry in list(self._epochs.values()):
            inflight = entry.state in (EpochState.OPEN, EpochState.PENDING)
            if inflight and epoch < entry.epoch:
                raise EpochRegressionError(
                    f"epoch {epoch} is below epoch {entry.epoch}, which is still "
                    f"{entry.state.value}; write epochs in increasing order (or epoch=None)",
                    runtime=self.runtime, epoch=epoch)

    def _retire_open(self, epoch: int) -> int:
        """Abort the open attempt (of this or an older epoch); the next attempt number."""
        entry = self._epochs.get(epoch)
        for other in [e for e in self._epochs.values() if e.state is EpochState.OPEN]:
            self.abort(other.epoch, other.attempt)
        previous = self._aborted.get(epoch, -1)
        if entry is not None:
            previous = max(previous, entry.attempt)
        return previous + 1

    def _check_backpressure(self, epoch: int) -> None:
        if self.outstanding() >= self.max_pending_epochs:
            raise BackpressureError(
                f"{self.outstanding()} epochs are outstanding (max_pending_epochs="
                f"{self.max_pending_epochs}); wait for commits or raise the limit",
                retry_after=0.5, runtime=self.runtime, epoch=epoch)

    def gather(self, epoch: int, attempt: int, requests: Sequence[CommitRequest],
               generation: int | None = None) -> None:
        """Take an attempt's commit requests, all at once, in memory (no I/O): the driver
        gathered them from the writers' barrier answers. ``persist_pending`` is next.

        An attempt that was not opened before (its open travelled with the data, see
        ``SinkRuntime``) is checked here as ``open_epoch`` would: the epoch is not decided,
        the attempt number unused, no later epoch in flight, and within
        ``max_pending_epochs`` (``BackpressureError`` otherwise: ask again later); and it
        began under this coordinator ``generation`` (a restart swept what it staged).

        Raises ``StaleAttemptError`` for an attempt that can no longer commit,
        ``SchemaMismatchError`` when writers of one sink saw different schemas, and
        ``VnodeOverlapError``/``RaySinkError`` when the requests do not cover the layout."""
        entry = self._epochs.get(epoch)
        if entry is None:
            if generation != self.generation:
                raise StaleAttemptError(
                    f"attempt {attempt} of epoch {epoch} began under coordinator generation "
                    f"{generation}, before a restart; feed it again", runtime=self.runtime,
                    epoch=epoch)
            entry = self._open_in_memory(epoch, attempt)
        elif entry.state is not EpochState.OPEN or entry.attempt != attempt or entry.complete:
            raise StaleAttemptError(
                f"commit requests for attempt {attempt} of epoch {epoch}, which is not open",
                runtime=self.runtime, epoch=epoch)
        try:
            for request in requests:
                if request.schema is not None:
                    self._check_epoch_schema(entry, request.sink, request.schema)
                entry.coverage[request.sink].add(request.writer,
                                                 self._writer_bitmap(request, epoch),
                                                 request.manifest)
            self._check_evolution(entry)
        except Exception:
            if not entry.recorded:
                del self._epochs[epoch]
            raise
        missing = [n for n, tracker in entry.coverage.items() if not tracker.aligned]
        if missing:
            raise RaySinkError(f"the commit requests of attempt {attempt} do not cover every "
                               f"writer of sinks {missing}", runtime=self.runtime, epoch=epoch)
        entry.complete = True

    def _writer_bitmap(self, request: CommitRequest, epoch: int) -> Bitmap:
        maps = self._bitmaps.get(request.sink)
        if maps is None or not 0 <= request.writer < len(maps):
            raise RaySinkError(
                f"a commit request from writer {request.writer} of sink {request.sink!r}, "
                f"but the layout has {0 if maps is None else len(maps)} writers for it (a "
                "rescale the coordinator did not hear of?)", runtime=self.runtime,
                sink=request.sink, epoch=epoch)
        return maps[request.writer]

    def _open_in_memory(self, epoch: int, attempt: int) -> _Epoch:
        """An attempt whose open travelled with its data: checked, not yet recorded."""
        if self.epoch_state(epoch) is not None or attempt <= self._aborted.get(epoch, -1):
            raise StaleAttemptError(
                f"attempt {attempt} of epoch {epoch} cannot be opened: the epoch is "
                f"{self.epoch_state(epoch) or 'past that attempt'}", runtime=self.runtime,
                epoch=epoch)
        self._refuse_regression(epoch)
        self._check_backpressure(epoch)
        if epoch in self._unswept:  # sweeping by epoch now would take this attempt's data
            raise StaleAttemptError(
                f"epoch {epoch} still holds staging no sweep could reach since the restart; "
                "it is opened first and fed again", runtime=self.runtime, epoch=epoch)
        entry = _Epoch(epoch=epoch, attempt=attempt, state=EpochState.OPEN, recorded=False,
                       coverage={name: CoverageTracker[Manifest | None](expected=len(maps))
                                 for name, maps in self._bitmaps.items()})
        self._epochs[epoch] = entry
        _faults.hit("coordinator.after_open", runtime=self.runtime, epoch=epoch)
        return entry

    def attempt_outcome(self, epoch: int, attempt: int) -> str:
        """``"committed"``, ``"pending"``, ``"open"``, ``"aborted"`` (that attempt can no
        longer commit) or ``"unknown"``."""
        state = self.epoch_state(epoch)
        if state is EpochState.COMMITTED:
            return "committed"
        entry = self._epochs.get(epoch)
        if entry is not None and entry.attempt == attempt:
            return "pending" if entry.state is EpochState.PENDING else "open"
        if entry is not None and entry.attempt > attempt:
            return "aborted"
        return "aborted" if attempt <= self._aborted.get(epoch, -1) else "unknown"

    def persist_pending(self, epoch: int, attempt: int) -> bool:
        """Record the gathered ``(epoch, attempt)`` PENDING for every sink in one
        transaction (with its OPEN when that was never recorded): the decision. False
        when it was aborted meanwhile."""
        entry = self._epochs.get(epoch)
        if (entry is None or entry.attempt != attempt or not entry.complete
                or entry.state is not EpochState.OPEN):
            return False
        manifests = {name: [m for _, m in sorted(tracker.items()) if m is not None]
                     for name, tracker in entry.coverage.items()}
        if entry.recorded:
            self.store.put_pending(self.runtime, self.generation, epoch, attempt, manifests)
        else:
            self.store.put_decided(self.runtime, self.generation, epoch, attempt,
                                   self.layout(), manifests)
            entry.recorded = True
        entry.state = EpochState.PENDING
        entry.manifests = manifests
        entry.coverage = {}
        self._note_decided_schemas({n: _schema.decode(t) for n, t in entry.schemas.items()})
        _faults.hit("coordinator.after_pending", runtime=self.runtime, epoch=epoch)
        return True

    def _check_epoch_schema(self, entry: _Epoch, sink: str, schema: str) -> None:
        """Writers of one epoch agree on its schema: the same one, or with the sink's
        ``schema_evolution="add_columns"`` schemas with a union (which becomes the
        epoch's)."""
        first = entry.schemas.setdefault(sink, schema)
        if first == schema:
            return
        expected, got = _schema.decode(first), _schema.decode(schema)
        if expected.equals(got, check_metadata=False):
            return
        where: dict[str, Any] = {"runtime": self.runtime, "sink": sink, "epoch": entry.epoch}
        if self.sinks[sink].schema_evolution != "add_columns":
            raise SchemaMismatchError(
                f"writers of one epoch received different schemas ({expected.to_string()!r} "
                f"and {got.to_string()!r}); an epoch has one schema (or give the sink "
                "schema_evolution='add_columns')", **where)
        try:
            entry.schemas[sink] = _schema.encode(_schema.union([expected, got]))
        except SchemaMismatchError as exc:
            raise SchemaMismatchError(f"writers of one epoch disagree: {exc.message}",
                                      column=exc.column, **where) from None

    def _check_evolution(self, entry: _Epoch) -> None:
        """An evolving sink's epoch schema must evolve the schemas of the epochs decided
        before it, by the sink's rules: their commits may not have reached the target when
        this epoch's writers checked it, and a decided epoch must never meet a change its
        target refuses at commit."""
        earlier = [e for e in list(self._epochs.values())
                   if e.epoch < entry.epoch and e.complete and e.state is EpochState.OPEN]
        for name, text in entry.schemas.items():
            sink = self.sinks[name]
            if sink.schema_evolution != "add_columns":
                continue
            reference = self._decided_schemas.get(name)
            for other in sorted(earlier, key=lambda e: e.epoch):  # gathered, not yet PENDING
                if name in other.schemas:
                    reference = _evolved(reference, _schema.decode(other.schemas[name]), sink)
            if reference is not None:
                _schema.evolve(reference, _schema.decode(text), sink.evolution_rules(),
                               where={"runtime": self.runtime, "sink": name,
                                      "epoch": entry.epoch})

    def _note_decided_schemas(self, schemas: Mapping[str, pa.Schema]) -> None:
        """Remember the schemas of a decided epoch (evolving sinks only). Never raises:
        the epoch is decided already (``gather`` checked it)."""
        for name, schema in schemas.items():
            sink = self.sinks.get(name)
            if sink is None or sink.schema_evolution != "add_columns":
                continue
            try:
                self._decided_schemas[name] = _evolved(self._decided_schemas.get(name),
                                                       schema, sink)
            except SchemaMismatchError as exc:
                log.warning("sink %s: the schema of a decided epoch does not evolve the one "
                            "before it (%s); checking later epochs against it alone", name,
                            exc)
                self._decided_schemas[name] = _schema.loosen(schema)

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
                    if recorded or not _holds(sink, epoch):
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

    def resolve(self, epoch: int, attempt: int | None = None) -> Resolution:
        """COMMITTED, ROLLING_FORWARD or ABORTED; an OPEN attempt is aborted first, and
        what an attempt never opened here staged (``attempt``: its open travelled with the
        data that never arrived) is swept."""
        state = self.epoch_state(epoch)
        if state is EpochState.COMMITTED:
            return Resolution.COMMITTED
        if state is EpochState.PENDING:
            return Resolution.ROLLING_FORWARD
        entry = self._epochs.get(epoch)
        if entry is not None:
            self.abort(epoch, entry.attempt)
        elif attempt is not None:
            self._sweep(epoch, attempt, manifests=None, recorded=False)
        return Resolution.ABORTED

    # ------------------------------------------------------------------ phase two

    def next_commit(self, sink: str | None = None) -> CommitStep | None:
        """The next commit of ``sink`` (any sink when ``None``): its share of the oldest
        PENDING epoch it has not committed. Each sink goes through the epochs in order on
        its own; a stalled sink holds only itself."""
        for epoch in self.pending_epochs():
            entry = self._epochs.get(epoch)
            if entry is None:
                continue
            done = set(entry.committed)
            for name in [sink] if sink is not None else list(self.sinks):
                if name not in done:
                    return CommitStep(epoch=epoch, sink=name, attempt=entry.attempt,
                                      manifests=tuple(entry.manifests.get(name, [])))
        return None

    def run_commit(self, step: CommitStep) -> CommitOutcome:
        """The sink's I/O of ``step`` (marker check, then ``Sink.commit``), under the sink's
        own lock and nothing else: it may run beside other sinks' commits. Idempotent.

        An epoch that carried nothing to the sink (no writer of it staged anything, not
        even a schema, in its first and only attempt) is not taken to the target at all:
        there is nothing to make visible, and a marker of its own would cost a durable
        write per sink and, in Delta and Iceberg, an empty table version. It is recorded
        committed without a marker (as an epoch with nothing to create a missing target
        with already was)."""
        if step.carries_nothing:
            return CommitOutcome(epoch=step.epoch, sink=step.sink, skipped=False,
                                 marked=False)
        target = self.sinks[step.sink]
        key = (step.epoch, step.sink)
        with self._io[step.sink]:
            tried = key in self._tried
            marker = target.committed_epoch()
            self._check_marker_for_pending(step.sink, marker, step.epoch)
            held, marked = marker is not None and marker >= step.epoch, True
            if not held:
                self._tried.add(key)
                started = time.monotonic()
                result = target.commit(step.epoch, list(step.manifests))
                marked = result is not CommitResult.NO_TARGET
                held = result is CommitResult.ALREADY
                log.debug("sink %s committed epoch %s in %.3fs%s", step.sink, step.epoch,
                          time.monotonic() - started, "" if marked else " (no target, no marker)")
            skipped = held and not self._own_commit(target, step, tried)
            _faults.hit("coordinator.after_commit", runtime=self.runtime, epoch=step.epoch,
                        sink=step.sink)
        return CommitOutcome(epoch=step.epoch, sink=step.sink, skipped=skipped, marked=marked)

    def _own_commit(self, target: Sink, step: CommitStep, tried: bool) -> bool:
        """Whether the data the target already holds as the step's epoch is this
        decision's: a commit of it landed before (its answer lost, its record failed, or
        its coordinator crashed before recording it), which is no skip. The target tells
        (``Sink.holds_decision``: another driver of the runtime, with a meta store of its own, may
        have committed other data as the epoch); where it cannot, whether this process
        took the commit to it before (``tried``)."""
        held = target.holds_decision(step.epoch, list(step.manifests))
        if held is False:
            log.warning("sink %s holds another decision of epoch %s (a driver of %s with a "
                        "meta store of its own?): this one's rows are not written",
                        step.sink, step.epoch, self.runtime)
        return tried if held is None else held

    def record_commit(self, outcome: CommitOutcome) -> None:
        """Record one sink's commit COMMITTED; the epoch is complete once every sink is."""
        epoch, sink = outcome.epoch, outcome.sink
        self.store.put_committed(self.runtime, self.generation, epoch, sink,
                                 marked=outcome.marked)
        self._tried.discard((epoch, sink))
        entry = self._epochs.get(epoch)
        self._note_sink_committed(sink, epoch, marked=outcome.marked)
        if entry is None:
            return
        entry.committed.add(sink)
        if outcome.skipped:
            entry.skipped.add(sink)
        if entry.committed >= set(self.sinks):
            self._complete(epoch)
        else:
            _faults.hit("coordinator.mid_commit", runtime=self.runtime, epoch=epoch, sink=sink)

    def _check_marker_for_pending(self, name: str, marker: int | None, epoch: int) -> None:
        expected = self._sink_marked.get(name)
        if expected is None or (marker is not None and marker >= expected):
            return
        raise DataLossError(
            f"the progress marker of sink {name!r} is gone (the meta store says epoch "
            f"{expected} was committed) while epoch {epoch} is pending: nothing can tell "
            "whether that epoch reached the target. Restore the marker or the target",
            runtime=self.runtime, sink=name, epoch=epoch)

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


def _evolved(reference: pa.Schema | None, schema: pa.Schema, sink: Sink) -> pa.Schema:
    """``reference`` evolved by ``schema`` under the sink's rules, every column nullable
    (the target, not the coordinator, knows which columns must be set)."""
    if reference is None:
        return _schema.loosen(schema)
    return _schema.loosen(_schema.evolve(reference, schema, sink.evolution_rules()).schema)


def _manifest_schemas(manifests: Mapping[str, Sequence[Manifest]]) -> dict[str, pa.Schema]:
    """Per sink, the union of the schemas its recovered manifests report."""
    found: dict[str, pa.Schema] = {}
    for name, listed in manifests.items():
        schemas = [_schema.decode(text) for m in listed
                   if isinstance(text := m.get("schema"), str)]
        if schemas:
            try:
                found[name] = _schema.union(schemas)
            except SchemaMismatchError as exc:  # decided already: never refuse it now
                log.warning("sink %s: recovered manifests disagree on the schema: %s", name,
                            exc)
    return found


def _digest(bitmaps: Sequence[Bitmap]) -> str:
    return hashlib.sha256("".join(b.to_hex() for b in bitmaps).encode()).hexdigest()[:16]


def _holds(sink: Sink, epoch: int) -> bool:
    """Whether the sink's marker holds ``epoch`` (a marker that cannot be read raises:
    the sweep is tried again later)."""
    marker = sink.committed_epoch()
    return marker is not None and marker >= epoch


def _target_exists(sink: Sink) -> bool:
    """``sink.target_exists()``; a probe that cannot answer is not evidence of loss."""
    try:
        return sink.target_exists()
    except MetaStoreError:
        raise
    except Exception:
        return True
