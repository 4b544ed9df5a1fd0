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

Where the steps live: this module holds phase one (open, gather, decide, resolve); the
state they work on is ``EpochBook`` (``epoch_book``), the start-up steps are
``Recovery`` (``recovery``) and phase two is ``Commits`` (``commits``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from raysink import _faults, _schema
from raysink.coordinator.commits import Commits
from raysink.coordinator.epoch_book import (
    CommitOutcome,
    CommitStep,
    EpochEntry,
    OpenDecision,
    Resolution,
    evolved_schema,
)
from raysink.coordinator.metastore.base import EpochState
from raysink.coordinator.recovery import Recovery
from raysink.errors import (
    BackpressureError,
    EpochRegressionError,
    RaySinkError,
    SchemaMismatchError,
    StaleAttemptError,
)
from raysink.protocol.messages import CommitRequest
from raysink.protocol.vnodes import Bitmap, CoverageTracker
from raysink.sinks.base import Manifest

__all__ = [
    "CommitOutcome",
    "CommitStep",
    "EpochCoordinator",
    "OpenDecision",
    "Resolution",
    "StaleAttemptError",
]

log = logging.getLogger(__name__)


class EpochCoordinator(Recovery, Commits):
    """Epoch decisions of one runtime over a meta store and its sinks.

    ``bitmaps`` gives each sink's writers their vnode bitmaps (the writer layout of the
    next epoch; ``set_layout`` changes it between epochs, which is how rescale fits).
    ``epoch_offset``: implicit epochs are numbered above it (it also acknowledges targets
    whose markers are ahead of the meta store, see ``raysink.coordinator.markers``).
    """

    def open_epoch(self, requested: int | None) -> OpenDecision:
        """Decide what the driver's write of ``requested`` (or the next epoch) does."""
        if requested is None:
            self.check_alignment()
        epoch = self._next_epoch() if requested is None else requested
        if epoch < 0:
            raise EpochRegressionError(f"epochs are non-negative; got {epoch}",
                                       runtime=self.runtime)
        state = self.epoch_state(epoch)
        if state is None and requested is not None:
            self.refuse_partly_committed(epoch)
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
        self._epochs[epoch] = EpochEntry(
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

    def _open_in_memory(self, epoch: int, attempt: int) -> EpochEntry:
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
        entry = EpochEntry(epoch=epoch, attempt=attempt, state=EpochState.OPEN, recorded=False,
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

    def _check_epoch_schema(self, entry: EpochEntry, sink: str, schema: str) -> None:
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

    def _check_evolution(self, entry: EpochEntry) -> None:
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
                    reference = evolved_schema(reference, _schema.decode(other.schemas[name]), sink)
            if reference is not None:
                _schema.evolve(reference, _schema.decode(text), sink.evolution_rules(),
                               where={"runtime": self.runtime, "sink": name,
                                      "epoch": entry.epoch})

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
