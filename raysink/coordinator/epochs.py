"""The coordinator's state machine, without Ray: epochs, two-phase commit, recovery.

``EpochCoordinator`` owns the decisions of one runtime. It is synchronous and single
threaded; ``CoordinatorActor`` drives it from an asyncio loop (blocking calls in a thread,
one at a time) and adds the waiting: futures for commit requests, backoff timers.

One epoch, as this class sees it::

    open_epoch(E)              OPEN(E, attempt, layout) recorded for every sink
    commit_request(...) * n    one per writer of every sink; stale attempts refused;
                               vnode bitmaps must cover every vnode of a sink, no overlap
      -> all covered           PENDING(E, manifests of all sinks) in one transaction
    commit_next()              per sink, in epoch order: skip when the sink's marker says
                               it is there, else sink.commit; then COMMITTED for that sink
    resolve(E)                 COMMITTED | ROLLING_FORWARD | ABORTED (an OPEN attempt is
                               aborted and its staging swept first)

Before PENDING any failure aborts the attempt; after PENDING the epoch only rolls forward.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from raysink import _faults
from raysink.coordinator.metastore.base import EpochRecord, EpochState, MetaStore
from raysink.coordinator.vnodes import Bitmap, CoverageTracker
from raysink.errors import (
    BackpressureError,
    DataLossError,
    EpochRegressionError,
    MetaStoreError,
    RaySinkError,
    SchemaMismatchError,
    StaleAttemptError,
)
from raysink.sinks.base import Manifest, Sink

__all__ = [
    "CommitOutcome",
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
class CommitOutcome:
    """One sink commit step: which epoch, which sink, skipped by marker or committed."""

    epoch: int
    sink: str
    skipped: bool


@dataclass(kw_only=True, slots=True)
class _Epoch:
    """In-memory view of one epoch across all sinks."""

    epoch: int
    attempt: int
    state: EpochState
    manifests: dict[str, list[Manifest]] = field(default_factory=dict)
    committed: set[str] = field(default_factory=set)
    skipped: set[str] = field(default_factory=set)
    coverage: dict[str, CoverageTracker[Manifest]] = field(default_factory=dict)
    schemas: dict[str, str] = field(default_factory=dict)


class EpochCoordinator:
    """Epoch decisions of one runtime over a meta store and its sinks.

    ``bitmaps`` gives each sink's writers their vnode bitmaps (the writer layout of the
    next epoch; ``set_layout`` changes it between epochs, which is how rescale fits).
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
    ) -> None:
        self.runtime = runtime
        self.store = store
        self.sinks = dict(sinks)
        self.generation = generation
        self.max_pending_epochs = max_pending_epochs
        self._bitmaps = {name: list(maps) for name, maps in bitmaps.items()}
        self._epochs: dict[int, _Epoch] = {}
        self._last_committed: int | None = None
        self._aborted: dict[int, int] = {}
        self._sink_committed: dict[str, int | None] = dict.fromkeys(self.sinks)
        # the last committed epoch whose commit left the sink's marker in its target:
        # what the marker must match (an empty first epoch with no schema leaves none)
        self._sink_marked: dict[str, int | None] = dict.fromkeys(self.sinks)

    # ------------------------------------------------------------------ queries

    @property
    def last_committed(self) -> int | None:
        """Highest epoch committed by every sink."""
        return self._last_committed

    def sink_last_committed(self, sink: str) -> int | None:
        return self._sink_committed.get(sink)

    def pending_epochs(self) -> list[int]:
        """Epochs decided (PENDING) but not yet committed by every sink, in order."""
        return sorted(e.epoch for e in self._epochs.values() if e.state is EpochState.PENDING)

    def open_epoch_number(self) -> int | None:
        opened = [e.epoch for e in self._epochs.values() if e.state is EpochState.OPEN]
        return opened[0] if opened else None

    def outstanding(self) -> int:
        """OPEN plus PENDING epochs: what ``max_pending_epochs`` bounds."""
        return sum(1 for e in self._epochs.values()
                   if e.state in (EpochState.OPEN, EpochState.PENDING))

    def epoch_state(self, epoch: int) -> EpochState | None:
        if self._last_committed is not None and epoch <= self._last_committed:
            return EpochState.COMMITTED
        entry = self._epochs.get(epoch)
        return entry.state if entry else None

    def skipped_sinks(self, epoch: int) -> tuple[str, ...]:
        entry = self._epochs.get(epoch)
        return tuple(sorted(entry.skipped)) if entry else ()

    def layout(self) -> dict[str, Any]:
        return {"sinks": {name: {"writers": len(maps), "bitmaps": [b.to_hex() for b in maps]}
                          for name, maps in self._bitmaps.items()}}

    def set_layout(self, bitmaps: Mapping[str, Sequence[Bitmap]]) -> None:
        """New writer bitmaps, effective from the next opened epoch (rescale)."""
        if self.open_epoch_number() is not None:
            raise RaySinkError("cannot change the writer layout while an epoch is open",
                               runtime=self.runtime)
        self._bitmaps = {name: list(maps) for name, maps in bitmaps.items()}

    # ------------------------------------------------------------------ recovery

    def recover(self) -> list[int]:
        """Load the meta store: keep COMMITTED, queue PENDING, abort OPEN and ABORTED.

        Returns the epochs that were aborted. PENDING epochs are left for ``commit_next``.
        """
        by_epoch: dict[int, list[EpochRecord]] = {}
        for record in self.store.records(self.runtime):
            if record.sink in self.sinks:
                by_epoch.setdefault(record.epoch, []).append(record)
        aborted: list[int] = []
        for epoch in sorted(by_epoch):
            if self._recover_epoch(epoch, by_epoch[epoch]):
                aborted.append(epoch)
        return aborted

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
                    entry.manifests[record.sink] = list(record.manifests or [])
            self._epochs[epoch] = entry
            return False
        attempt = max(r.attempt for r in records)
        self._sweep(epoch, attempt, manifests=None)
        return True

    def check_markers(self) -> None:
        """With nothing pending, compare each sink's marker with the meta store.

        A marker behind the meta store is re-created (``recreate_marker``) when the target
        still exists; a target that is gone after commits is ``DataLossError``.
        """
        if self.pending_epochs():
            return
        for name, sink in self.sinks.items():
            expected = self._sink_marked.get(name)
            if expected is None:
                continue
            # the target first: a marker kept apart from the data (PostgreSQL's progress
            # table) survives a deleted data table
            if not _target_exists(sink):
                raise DataLossError(
                    f"the target of sink {name!r} was deleted after raysink committed epoch "
                    f"{expected} to it; restore it, or drop the sink from the runtime",
                    runtime=self.runtime, sink=name, epoch=expected)
            marker = sink.committed_epoch()
            if marker is not None and marker >= expected:
                continue
            log.warning("sink %s: progress marker behind the meta store (%s < %s); re-creating",
                        name, marker, expected)
            sink.recreate_marker(expected)

    # ------------------------------------------------------------------ phase one

    def open_epoch(self, requested: int | None) -> OpenDecision:
        """Decide what the driver's write of ``requested`` (or the next epoch) does."""
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
        attempt = self._retire_open(epoch)
        self._check_backpressure(epoch)
        self.store.put_open(self.runtime, self.generation, epoch, attempt, list(self.sinks),
                            self.layout())
        self._epochs[epoch] = _Epoch(
            epoch=epoch, attempt=attempt, state=EpochState.OPEN,
            coverage={name: CoverageTracker[Manifest]() for name in self.sinks})
        _faults.hit("coordinator.after_open", runtime=self.runtime, epoch=epoch)
        return OpenDecision(epoch=epoch, attempt=attempt)

    def _next_epoch(self) -> int:
        known = [e.epoch for e in self._epochs.values()
                 if e.state in (EpochState.OPEN, EpochState.PENDING)]
        if self._last_committed is not None:
            known.append(self._last_committed)
        # An OPEN epoch is a failed write the driver has not resolved: retry it.
        opened = self.open_epoch_number()
        if opened is not None:
            return opened
        return max(known) + 1 if known else 1

    def _refuse_regression(self, epoch: int) -> None:
        for entry in self._epochs.values():
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

    def commit_request(
        self,
        *,
        sink: str,
        writer_id: int,
        epoch: int,
        attempt: int,
        manifest: Manifest,
        schema: str | None = None,
    ) -> bool:
        """Record one writer's pre-commit. True when this request completed the epoch (it
        is now PENDING); raises ``StaleAttemptError`` for an attempt that is not open and
        ``SchemaMismatchError`` when writers of one sink saw different schemas."""
        entry = self._epochs.get(epoch)
        if entry is None or entry.state is not EpochState.OPEN or entry.attempt != attempt:
            raise StaleAttemptError(
                f"commit request for attempt {attempt} of epoch {epoch}, which is not open",
                runtime=self.runtime, sink=sink, epoch=epoch)
        if schema is not None:
            self._check_epoch_schema(entry, sink, schema)
        bitmap = self._bitmaps[sink][writer_id]
        entry.coverage[sink].add(writer_id, bitmap, manifest)
        if not all(tracker.aligned for tracker in entry.coverage.values()):
            return False
        self._persist_pending(entry)
        return True

    def _check_epoch_schema(self, entry: _Epoch, sink: str, schema: str) -> None:
        first = entry.schemas.setdefault(sink, schema)
        if first == schema:
            return
        from raysink.actors.writer import schema_from_text

        expected, got = schema_from_text(first), schema_from_text(schema)
        if expected.equals(got, check_metadata=False):
            return
        raise SchemaMismatchError(
            f"writers of one epoch received different schemas ({expected.to_string()!r} and "
            f"{got.to_string()!r}); an epoch has one schema", runtime=self.runtime,
            sink=sink, epoch=entry.epoch)

    def _persist_pending(self, entry: _Epoch) -> None:
        manifests = {name: [m for _, m in sorted(tracker.items())]
                     for name, tracker in entry.coverage.items()}
        self.store.put_pending(self.runtime, self.generation, entry.epoch, entry.attempt,
                               manifests)
        entry.state = EpochState.PENDING
        entry.manifests = manifests
        entry.coverage = {}
        _faults.hit("coordinator.after_pending", runtime=self.runtime, epoch=entry.epoch)

    def abort(self, epoch: int, attempt: int) -> None:
        """Abort an OPEN attempt: record ABORTED, sweep every sink's staging, forget it."""
        entry = self._epochs.get(epoch)
        if entry is None or entry.state is not EpochState.OPEN or entry.attempt != attempt:
            return
        self._sweep(epoch, attempt, manifests=None)
        del self._epochs[epoch]

    def _sweep(self, epoch: int, attempt: int, manifests: Mapping[str, Any] | None) -> None:
        self.store.put_aborted(self.runtime, self.generation, epoch, attempt)
        for name, sink in self.sinks.items():
            sink.abort(epoch, None if manifests is None else manifests.get(name))
        self.store.delete_aborted(self.runtime, self.generation, epoch)
        self._aborted[epoch] = max(attempt, self._aborted.get(epoch, -1))

    def resolve(self, epoch: int) -> Resolution:
        """COMMITTED, ROLLING_FORWARD or ABORTED; an OPEN attempt is aborted first."""
        state = self.epoch_state(epoch)
        if state is EpochState.COMMITTED:
            return Resolution.COMMITTED
        if state is EpochState.PENDING:
            return Resolution.ROLLING_FORWARD
        entry = self._epochs.get(epoch)
        if entry is not None:
            self.abort(epoch, entry.attempt)
        return Resolution.ABORTED

    # ------------------------------------------------------------------ phase two

    def next_commit(self) -> tuple[int, str] | None:
        """The next ``(epoch, sink)`` to commit: the oldest PENDING epoch first."""
        for epoch in self.pending_epochs():
            entry = self._epochs[epoch]
            for name in self.sinks:
                if name not in entry.committed:
                    return epoch, name
        return None

    def commit_sink(self, epoch: int, sink: str) -> CommitOutcome:
        """Commit one sink's share of a PENDING epoch (marker-checked); idempotent."""
        entry = self._epochs[epoch]
        target = self.sinks[sink]
        if entry.committed and sink not in entry.committed:
            _faults.hit("coordinator.mid_commit", runtime=self.runtime, epoch=epoch, sink=sink)
        marker = target.committed_epoch()
        self._check_marker_for_pending(sink, target, marker, epoch)
        skipped = marker is not None and marker >= epoch
        marked = True
        if not skipped:
            started = time.monotonic()
            marked = target.commit(epoch, entry.manifests.get(sink, [])) is not False
            log.debug("sink %s committed epoch %s in %.3fs%s", sink, epoch,
                      time.monotonic() - started, "" if marked else " (no target, no marker)")
        _faults.hit("coordinator.after_commit", runtime=self.runtime, epoch=epoch, sink=sink)
        self.store.put_committed(self.runtime, self.generation, epoch, sink, marked=marked)
        entry.committed.add(sink)
        if skipped:
            entry.skipped.add(sink)
        self._note_sink_committed(sink, epoch, marked=marked)
        if entry.committed >= set(self.sinks):
            self._complete(epoch)
        return CommitOutcome(epoch=epoch, sink=sink, skipped=skipped)

    def _check_marker_for_pending(
        self, name: str, sink: Sink, marker: int | None, epoch: int
    ) -> None:
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

    # ------------------------------------------------------------------ sources

    def records_snapshot(self) -> list[dict[str, Any]]:
        """Epochs still in memory, for status and debugging."""
        return [{"epoch": e.epoch, "attempt": e.attempt, "state": e.state.value,
                 "committed": sorted(e.committed)} for e in sorted(
                     self._epochs.values(), key=lambda x: x.epoch)]


def _target_exists(sink: Sink) -> bool:
    probe = getattr(sink, "target_exists", None)
    if probe is None:
        return True
    try:
        return bool(probe())
    except MetaStoreError:
        raise
    except Exception:  # a probe that cannot answer is not evidence of loss
        return True
