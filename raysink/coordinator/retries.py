"""A sink commit worker's retries: how long to wait, and what to log.

A commit that fails is tried again with exponential backoff and jitter, up to
``retry_cap`` seconds between tries: a target that is down comes back, and a sink whose
target is down holds only itself. A ``DataLossError`` is not of that kind: the records a
decided epoch needs are gone (a Kafka replay after retention took the lost parts' records;
a target deleted under a pending epoch), and no retry brings them back. The sink's status
then reads ``failed`` (``health``), not ``stalled``, as a marker or target lost at
recovery does (``markers``), and its commits are still tried, at the cap only: an operator
who restores the target or the marker lets the epoch complete without a restart. The
error is logged at ERROR when it first comes (or changes), then at DEBUG, with a WARNING
every ``REMIND_EVERY`` tries: a sink failed for days must not flood the log.
"""

from __future__ import annotations

import logging
import random

from raysink.errors import DataLossError

__all__ = ["BACKOFF_START", "REMIND_EVERY", "CommitRetries"]

log = logging.getLogger("raysink.coordinator.coordinator")

BACKOFF_START = 0.01
REMIND_EVERY = 20


class CommitRetries:
    """One sink's retry state: the next backoff, the last error logged and its repeats."""

    def __init__(self, runtime: str, sink: str, cap: float) -> None:
        self.runtime = runtime
        self.sink = sink
        self.cap = cap
        self._backoff = BACKOFF_START
        self._last: str | None = None
        self._repeats = 0

    def failed(self, epoch: int, exc: BaseException) -> float:
        """The seconds to wait before the next try after ``exc``, logged (see the module
        docstring)."""
        lost = isinstance(exc, DataLossError)
        if lost:
            self._backoff = self.cap  # nothing comes back sooner
        delay = min(self._backoff, self.cap) * random.uniform(0.5, 1.0)
        self._backoff = min(max(self._backoff * 2, BACKOFF_START), self.cap)
        if lost:
            self._log_lost(epoch, exc, delay)
        else:
            self._last, self._repeats = None, 0
            log.warning("%s: commit of epoch %s to sink %s failed (%s); retrying in %.2fs",
                        self.runtime, epoch, self.sink, exc, delay)
        return delay

    def _log_lost(self, epoch: int, exc: BaseException, delay: float) -> None:
        text = str(exc)
        if text != self._last:
            self._last, self._repeats = text, 0
            log.error("%s: sink %s failed: epoch %s cannot be committed, its data is lost "
                      "(%s); its commit is tried again every %.0fs in case the data is "
                      "restored", self.runtime, self.sink, epoch, exc, self.cap)
            return
        self._repeats += 1
        level = logging.WARNING if self._repeats % REMIND_EVERY == 0 else logging.DEBUG
        log.log(level, "%s: sink %s still failed (epoch %s's data lost, %d tries since); "
                "next try in %.2fs", self.runtime, self.sink, epoch, self._repeats, delay)

    def succeeded(self) -> None:
        self._backoff, self._last, self._repeats = BACKOFF_START, None, 0
