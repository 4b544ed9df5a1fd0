"""Table maintenance run by the coordinator, mixed into ``CoordinatorActor``::

    driver    maintain(sink, timeout)   -> list[MaintenanceReport]   (``rt.maintain()``)
    worker    _maintain_between(sink)   -> bool                       (a pass ran)

Each sink's commit worker calls ``_maintain_between`` whenever that sink has no commit
step to run, so a pass never overlaps a commit of its sink (and runs under the sink's I/O
lock, as commits, aborts and recovery do). A pass is due after ``every_epochs`` epochs
the sink committed since the last one, and ``min_interval_s`` after it; a request of
``rt.maintain()`` makes one due now (``force``). Its window's deadline is
``step_seconds`` away: the sink stops at the next step boundary after it, so a commit
that arrives meanwhile waits for one step at most; a forced pass that stopped early goes
on after the commits that arrived, until a pass completes.

A failing pass logs a warning, counts in ``status()`` and the metrics, and is tried again
after a backoff (doubling from ``min_interval_s``, up to ``retry_cap``); it never holds a
commit back or marks the sink stalled. ``rt.maintain()`` gets the error itself.
"""

from __future__ import annotations

import asyncio
import logging
import time
from abc import abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from raysink.errors import ConfigError, MaintenanceError
from raysink.sinks._maintenance import (
    MaintenanceReport,
    MaintenanceTotals,
    MaintenanceWindow,
    TableStats,
)

if TYPE_CHECKING:
    from raysink._metrics import CoordinatorMetrics
    from raysink.coordinator.coordinator import CoordinatorConfig
    from raysink.coordinator.epochs import EpochCoordinator
    from raysink.sinks.base import Sink

__all__ = ["MaintenanceBook", "MaintenanceCalls"]

log = logging.getLogger(__name__)
_FIRST_BACKOFF = 1.0


@dataclass
class _SinkBook:
    """One sink's maintenance state in this coordinator."""

    since_epoch: int | None = None  # the sink's committed epoch at the last pass
    last_run: float | None = None  # monotonic end of the last pass (or failure)
    retry_at: float = 0.0
    backoff: float = 0.0
    totals: MaintenanceTotals = field(default_factory=MaintenanceTotals)
    table: TableStats | None = None
    waiting: list[asyncio.Future[MaintenanceReport]] = field(default_factory=list)
    reports: list[MaintenanceReport] = field(default_factory=list)  # of the forced run


class MaintenanceBook:
    """When each sink's next pass is due, and what the passes so far did; no I/O."""

    def __init__(self, sinks: Mapping[str, Sink], retry_cap: float) -> None:
        self._sinks = dict(sinks)
        self._retry_cap = retry_cap
        self._books = {name: _SinkBook() for name in sinks}

    def due(self, sink: str, committed: int | None, now: float) -> bool:
        """Whether ``sink`` should run a pass now (its commits permitting)."""
        book = self._books[sink]
        if book.waiting:
            return True
        policy = self._sinks[sink].maintenance
        if not policy.enabled or committed is None or now < book.retry_at:
            return False
        if book.since_epoch is None:
            book.since_epoch = committed  # counted from the epoch this coordinator found
        if committed - book.since_epoch < policy.every_epochs:
            return False
        return book.last_run is None or now - book.last_run >= policy.min_interval_s

    def forced(self, sink: str) -> bool:
        return bool(self._books[sink].waiting)

    def request(self, sink: str) -> asyncio.Future[MaintenanceReport]:
        """A forced pass of ``sink`` (``rt.maintain()``): answered when one completes."""
        future: asyncio.Future[MaintenanceReport] = asyncio.get_running_loop().create_future()
        self._books[sink].waiting.append(future)
        return future

    def passed(self, sink: str, committed: int | None, report: MaintenanceReport,
               table: TableStats | None, now: float) -> None:
        book = self._books[sink]
        book.since_epoch, book.last_run, book.backoff, book.retry_at = committed, now, 0.0, 0.0
        book.totals = book.totals.add(report, time.time())
        book.table = table if table is not None else book.table
        if book.waiting:
            book.reports.append(report)
        if report.complete and book.waiting:
            summed = _summed(sink, book.reports)
            book.reports = []
            for future in book.waiting:
                if not future.done():
                    future.set_result(summed)
            book.waiting = []

    def failed(self, sink: str, error: BaseException, now: float) -> float:
        """A pass failed: its backoff, in seconds, before the next."""
        book = self._books[sink]
        policy = self._sinks[sink].maintenance
        book.backoff = min(max(book.backoff * 2, policy.min_interval_s, _FIRST_BACKOFF),
                           self._retry_cap)
        book.last_run, book.retry_at = now, now + book.backoff
        book.totals = book.totals.failed(f"{type(error).__name__}: {error}")
        for future in book.waiting:
            if not future.done():
                future.set_exception(error)
        book.waiting, book.reports = [], []
        return book.backoff

    def totals(self, sink: str) -> MaintenanceTotals | None:
        """``None`` for a sink that never maintains and was never asked to."""
        book = self._books.get(sink)
        if book is None or (not self._sinks[sink].maintenance.enabled
                            and book.totals == MaintenanceTotals()):
            return None
        return book.totals

    def table(self, sink: str) -> TableStats | None:
        book = self._books.get(sink)
        return None if book is None else book.table


def _summed(sink: str, reports: list[MaintenanceReport]) -> MaintenanceReport:
    steps: list[str] = []
    for report in reports:
        steps += [s for s in report.steps if s not in steps]
    return MaintenanceReport(
        sink=sink, steps=tuple(steps),
        files_compacted=sum(r.files_compacted for r in reports),
        files_written=sum(r.files_written for r in reports),
        bytes_rewritten=sum(r.bytes_rewritten for r in reports),
        snapshots_expired=sum(r.snapshots_expired for r in reports),
        files_deleted=sum(r.files_deleted for r in reports),
        seconds=sum(r.seconds for r in reports), complete=True)


class MaintenanceCalls:
    """The coordinator's maintenance; ``CoordinatorActor`` provides the rest."""

    _config: CoordinatorConfig
    _core: EpochCoordinator
    _metrics: CoordinatorMetrics
    _maintenance: MaintenanceBook

    if TYPE_CHECKING:  # CoordinatorActor's
        @abstractmethod
        async def _until_recovered(self) -> None: ...
        @abstractmethod
        async def _notify(self) -> None: ...
        @abstractmethod
        def _take_snapshot(self) -> None: ...

    async def maintain(self, sink: str | None, timeout: float) -> list[MaintenanceReport]:
        """A full pass (``force``) of ``sink``, or of every sink whose maintenance is on,
        each between two of its commits; the summed report of each. ``MaintenanceError``
        when a pass fails or does not end within ``timeout`` (it goes on meanwhile)."""
        await self._until_recovered()
        if sink is not None and sink not in self._config.sinks:
            raise ConfigError(f"rt.maintain(sink={sink!r}): no such sink; the runtime has "
                              f"{sorted(self._config.sinks)!r}", runtime=self._config.runtime)
        names = [sink] if sink is not None else [
            n for n, s in self._config.sinks.items() if s.maintenance.enabled]
        futures = [self._maintenance.request(name) for name in names]
        await self._notify()
        try:
            return list(await asyncio.wait_for(asyncio.gather(*futures), timeout))
        except asyncio.TimeoutError:
            raise MaintenanceError(
                f"maintenance of {names!r} did not end within {timeout:g}s (it runs between "
                "the sinks' commits and goes on; raise timeout=)",
                runtime=self._config.runtime) from None
        except MaintenanceError:
            raise
        except Exception as exc:
            raise MaintenanceError(f"maintenance failed: {type(exc).__name__}: {exc}",
                                   runtime=self._config.runtime) from exc

    async def _maintain_between(self, sink: str) -> bool:
        """Run a pass of ``sink`` if one is due (its worker has no commit to run)."""
        committed = self._core.sink_last_committed(sink)
        if not self._maintenance.due(sink, committed, time.monotonic()):
            return False
        target = self._core.sinks[sink]
        window = MaintenanceWindow(
            deadline=time.monotonic() + target.maintenance.step_seconds,
            committed_epoch=committed, force=self._maintenance.forced(sink))

        def run() -> tuple[MaintenanceReport, TableStats | None]:
            with self._core.sink_io(sink):
                report = target.maintain(window)
                return report, target.table_stats()

        try:
            report, table = await asyncio.to_thread(run)
        except Exception as exc:
            delay = self._maintenance.failed(sink, exc, time.monotonic())
            self._metrics.maintenance_failed(sink)
            log.warning("%s: maintenance of sink %s failed (%s); trying again in %.0fs",
                        self._config.runtime, sink, exc, delay)
        else:
            self._maintenance.passed(sink, committed, report, table, time.monotonic())
            self._metrics.maintained(report, table)
            if report.steps:
                log.info("%s: maintained sink %s (%s) in %.2fs", self._config.runtime, sink,
                         ", ".join(report.steps), report.seconds)
        self._take_snapshot()
        return True
