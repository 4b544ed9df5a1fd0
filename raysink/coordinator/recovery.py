"""The coordinator's recovery on start, without Ray: load the meta store, sweep what
undecided attempts staged, and read every target's progress marker.

``recover`` keeps COMMITTED epochs, queues PENDING ones for their commits (they only roll
forward) and aborts OPEN ones (their staging swept). ``reconcile_markers`` reads every
sink's marker (``raysink.coordinator.markers``): new epochs are never numbered at or below
a marker, and ``check_alignment`` refuses an implicit epoch while a target holds epochs the
meta store does not know.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import cast

from raysink import _faults
from raysink.coordinator.epoch_book import (
    EpochBook,
    EpochEntry,
    manifest_schemas,
    target_exists,
)
from raysink.coordinator.markers import refuse_partly_committed, refuse_unknown_epochs
from raysink.coordinator.metastore.base import EpochRecord, EpochState
from raysink.errors import (
    DataLossError,
    MetaStoreError,
    SinkUnavailableError,
)
from raysink.sinks._format import check_manifests
from raysink.sinks.base import Manifest, Sink

__all__ = ["Recovery"]

log = logging.getLogger(__name__)


class Recovery(EpochBook):
    """Recovery steps of ``EpochCoordinator``."""

    def recover(self) -> list[int]:
        """Load the meta store: keep COMMITTED, queue PENDING, abort OPEN and ABORTED.

        Returns the epochs that were aborted. PENDING epochs are left for the commits.
        Every manifest's format is checked before anything is swept or committed: one
        of a newer raysink stops the coordinator (``NewerVersionError``).
        Safe to run again after a ``MetaStoreError`` (the coordinator retries it): every
        step sets what the store says, or sweeps again what was swept.
        """
        try:
            _faults.hit("metastore.recover", runtime=self.runtime)
        except _faults.InjectedFault as exc:
            raise MetaStoreError(f"injected meta store failure during recovery ({exc})",
                                 runtime=self.runtime) from exc
        by_epoch: dict[int, list[EpochRecord]] = {}
        for record in self.store.records(self.runtime):
            if record.sink in self.sinks:
                check_manifests(record.manifests or [], written_by=record.written_by,
                                runtime=self.runtime, sink=record.sink, epoch=record.epoch)
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

    def _recover_epoch(self, epoch: int, records: list[EpochRecord]) -> bool:
        states = {r.state for r in records}
        for record in records:
            if record.state is EpochState.COMMITTED:
                self._note_sink_committed(record.sink, epoch, marked=record.marked)
        if states <= {EpochState.COMMITTED}:
            self._complete(epoch)
            return False
        if EpochState.PENDING in states:
            entry = EpochEntry(epoch=epoch, attempt=records[0].attempt, state=EpochState.PENDING)
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
            self._note_decided_schemas(manifest_schemas(entry.manifests))
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
                    marker = self._reconcile_sink(name, pending)
                    partial = None if pending else self._partly_committed(name)
                    offset = self.epoch_offset
                    if partial is not None and offset is not None and offset >= partial[0]:
                        marker, partial = partial[0], None  # epoch_offset accepted it as in
                    self._marks.record(name, marker, partial)
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
        if expected is not None and not target_exists(sink):
            raise DataLossError(
                f"the target of sink {name!r} was deleted after raysink committed epoch "
                f"{expected} to it; restore it, or drop the sink from the runtime",
                runtime=self.runtime, sink=name, epoch=expected)
        marker = sink.committed_epoch()
        if expected is None or (marker is not None and marker >= expected):
            return marker
        marker = sink.heal_marker(expected)  # held back (an open transaction), not lost?
        if pending or (marker is not None and marker >= expected):
            return marker
        log.warning("sink %s: progress marker behind the meta store (%s < %s); re-creating",
                    name, marker, expected)
        sink.recreate_marker(expected)
        return expected

    def _partly_committed(self, name: str) -> tuple[int, tuple[int, ...]] | None:
        """The epoch partly in the sink's target (``Sink.partly_committed``) when the meta
        store does not know it: it was decided elsewhere (``markers``).

        Asked only while nothing is pending in the meta store: with an epoch pending, the
        parts above a marker are that epoch's commit in progress, which rolls forward,
        and Kafka's answer would wait for writers that hold their part records in open
        transactions until this coordinator asks them to commit. (A restored old copy
        of the store with an older epoch pending is not checked; that case is left.)"""
        partial = self.sinks[name].partly_committed()
        known = self._store_knows()
        if partial is None or (known is not None and partial[0] <= known):
            return None
        log.warning("sink %s: epoch %s is partly in the target (writers %s) and the meta "
                    "store does not know it", name, partial[0], list(partial[1]))
        return partial

    def refuse_partly_committed(self, epoch: int) -> None:
        """Before an explicit ``epoch`` the meta store does not know is decided:
        ``ConfigError`` when it is partly in a target (``markers.refuse_partly_committed``;
        one ``epoch_offset`` accepted counts as that target's marker, so it is skipped).
        A sink that can hold such an epoch and whose marker could not be read is read
        again first; still unread, the epoch is refused for now
        (``SinkUnavailableError``)."""
        unread = [n for n in self._marks.unread
                  if type(self.sinks[n]).partly_committed is not Sink.partly_committed]
        if unread:
            self.reconcile_markers(unread)
        for name in unread:
            if name in self._marks.unread:
                raise SinkUnavailableError(
                    f"cannot read the progress of sink {name!r} "
                    f"({self._marks.unread[name]}), so whether epoch {epoch} is partly in "
                    "it is unknown; retry once the target is reachable",
                    runtime=self.runtime, sink=name, epoch=epoch)
        refuse_partly_committed(
            runtime=self.runtime, store_url=self.store.url, partial=self._marks.partial,
            describe={n: repr(s) for n, s in self.sinks.items()},
            epoch_offset=self.epoch_offset, epoch=epoch)

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
        offset = self.epoch_offset if numbering == "implicit" else epoch_offset
        refuse_partly_committed(
            runtime=self.runtime, store_url=self.store.url, partial=self._marks.partial,
            describe={n: repr(s) for n, s in self.sinks.items()}, epoch_offset=offset)
        refuse_unknown_epochs(
            runtime=self.runtime, store_url=self.store.url, known=self._store_knows(),
            marks=self._marks.marks, describe={n: repr(s) for n, s in self.sinks.items()},
            epoch_offset=self.epoch_offset if numbering == "implicit" else epoch_offset,
            numbering=numbering)
