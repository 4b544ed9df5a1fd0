"""Phase two, without Ray: each sink takes the decided (PENDING) epochs to its target, in
order, on its own.

``next_commit(sink)`` names the oldest PENDING epoch the sink lacks; ``run_commit`` does
the sink's I/O (its marker checked first: a commit is skipped when the target holds the
epoch already); ``record_commit`` records COMMITTED for that sink, and the epoch is
complete once every sink holds it. One stalled sink holds only itself.
"""

from __future__ import annotations

import logging
import time

from raysink import _faults
from raysink.coordinator.epoch_book import (
    CommitOutcome,
    CommitStep,
    EpochBook,
)
from raysink.errors import (
    DataLossError,
)
from raysink.sinks.base import CommitResult, Sink

__all__ = ["Commits"]

log = logging.getLogger(__name__)


class Commits(EpochBook):
    """Phase two of ``EpochCoordinator``."""

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
            marker = self._marker_for_pending(step.sink, target, step.epoch)
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

    def _marker_for_pending(self, name: str, target: Sink, epoch: int) -> int | None:
        """The sink's marker before ``epoch`` is committed to it; one behind the meta
        store is healed when the target can (``Sink.heal_marker``: a marker held back,
        not lost), else ``DataLossError``."""
        marker = target.committed_epoch()
        expected = self._sink_marked.get(name)
        if expected is None or (marker is not None and marker >= expected):
            return marker
        marker = target.heal_marker(expected)
        if marker is not None and marker >= expected:
            return marker
        raise DataLossError(
            f"the progress marker of sink {name!r} is gone (the meta store says epoch "
            f"{expected} was committed) while epoch {epoch} is pending: nothing can tell "
            "whether that epoch reached the target. Restore the marker or the target",
            runtime=self.runtime, sink=name, epoch=epoch)
