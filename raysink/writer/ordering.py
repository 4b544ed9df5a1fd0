"""``EarlierCommits``: a writer of a sink that holds transactions pre-commits an epoch only
once every earlier epoch is committed to that sink.

Such a sink (``Sink.holds_transactions``: Kafka) writes an epoch's records at its
pre-commit, so no later epoch's records may precede an earlier one's in the target, even
when an earlier epoch had to be written again (replayed) by its commit. The writer knows
the earlier epochs committed in one of two ways:

* **told**: the barrier (or an ``EpochHandle``'s seal) carries ``committed_through``, an
  epoch the driver knows every sink committed with every epoch before it (the previous
  epoch's commit answer said so, or the epoch's open answer, ``OpenedEpoch``).
  A commit is never taken back, so the fact stays true however late the barrier arrives;
  the highest epoch heard is kept, from barriers and from the status answers below;
* **asked**: otherwise the coordinator is asked, and answers once no decided (PENDING)
  epoch before this one is missing from the sink (sinks commit their epochs in order;
  ``CoordinatorActor.earlier_committed`` wakes at each commit it records, so the answer
  comes without polling) or after a few seconds, when it is asked again; a coordinator
  being replaced is asked again, up to the barrier timeout.

Being told saves the round trip before each pre-commit on the common path (one epoch
after another through ``rt.write*``); a stream, whose writers pre-commit while earlier
epochs commit, still asks.

``now(epoch)`` is the question without the wait, for a writer that would begin an epoch's
transaction before its pre-commit (``SinkWriter.start_early``: a large epoch produced
while the rest of it still arrives): yes only when every epoch up to ``epoch - 1`` is
committed to every sink (the runtime's ``last_committed_epoch``), or ``epoch`` is the
lowest epoch open and no epoch below it is decided and uncommitted (every epoch below it
then committed or aborted: an epoch below one in flight is never opened after it). That
is stricter than ``committed_before``, which does not count an earlier epoch still being
gathered. Asked of the coordinator once for each epoch, then at most once a second.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from raysink.errors import EpochFailedError
from raysink.reports import RuntimeStatus

__all__ = ["EarlierCommits"]


class EarlierCommits:
    """One writer's wait for the epochs before the one it pre-commits (module docstring).
    ``status(epoch, wait)`` asks the coordinator, which answers once the epochs before
    ``epoch`` are committed or after ``wait`` seconds; ``lost`` is called when that
    failed (the writer looks the coordinator up again)."""

    def __init__(self, *, runtime: str, sink: str, writer: int, timeout: float,
                 status: Callable[[int, float], RuntimeStatus], lost: Callable[[], None],
                 ask_every: float = 5.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._runtime, self._sink, self._writer = runtime, sink, writer
        self._timeout, self._ask_every = timeout, ask_every
        self._status, self._lost = status, lost
        self._clock = clock
        self._asked: tuple[int, float] | None = None  # ``now``'s last question: epoch, when
        # every epoch up to this one is committed to every sink
        self.committed_through: int | None = None

    def learn(self, epoch: int | None) -> None:
        """Every epoch up to ``epoch`` is committed to every sink (``None``: nothing new)."""
        if epoch is not None and (self.committed_through is None
                                  or epoch > self.committed_through):
            self.committed_through = epoch

    def known(self, epoch: int) -> bool:
        """Whether every epoch before ``epoch`` is known committed without asking."""
        return self.committed_through is not None and self.committed_through >= epoch - 1

    def now(self, epoch: int) -> bool:
        """Whether every epoch before ``epoch`` is committed to every sink: known, or the
        coordinator's answer without waiting (asked once an epoch, then at most once a
        second; ``False`` when it cannot answer now). See the module docstring."""
        if self.known(epoch):
            return True
        now = self._clock()
        if self._asked is not None and self._asked[0] == epoch and now - self._asked[1] < 1.0:
            return False
        self._asked = (epoch, now)
        try:
            status = self._status(epoch, 0.0)
        except Exception:
            self._lost()
            return False
        self.learn(status.last_committed_epoch)
        # or ``epoch`` is the lowest epoch open and none below it is decided: every epoch
        # below it is then committed or aborted (the runtime's first epoch, or numbers
        # skipped), since none below an epoch in flight can be opened after it
        return self.known(epoch) or (status.open_epoch == epoch and not any(
            p < epoch for p in status.pending_epochs))

    def wait(self, epoch: int) -> None:
        """Return once every epoch before ``epoch`` is committed to the sink: at once when
        known, else by the coordinator's status; ``EpochFailedError`` after the timeout."""
        if self.known(epoch):
            return
        deadline = time.monotonic() + self._timeout
        while True:
            left = deadline - time.monotonic()
            try:
                status = self._status(epoch, max(0.0, min(self._ask_every, left)))
                self.learn(status.last_committed_epoch)
                if status.committed_before(self._sink, epoch):
                    return
                error: Exception | None = None
            except Exception as exc:
                self._lost()
                error = exc
            if time.monotonic() > deadline:
                raise EpochFailedError(
                    f"writer {self._writer} waited {self._timeout:g} s for the epochs before "
                    f"{epoch} to be committed to sink {self._sink!r}"
                    + (f" ({error})" if error else ""), runtime=self._runtime,
                    sink=self._sink, epoch=epoch)
            if error is not None:
                time.sleep(0.5)
