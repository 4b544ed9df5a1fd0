"""``CommitWaits``: the coordinator's call a writer blocks on until the epochs before the
one it pre-commits are committed to its sink (``raysink.writer.ordering``).

A writer of a sink that holds transactions (Kafka) pre-commits an epoch only once every
earlier epoch is committed to that sink. When its barrier does not say so (a stream,
whose writers pre-commit while earlier epochs commit), it used to poll the coordinator's
status every 20 ms: a round trip per poll, and on average half a poll interval added to
the epoch's latency. The coordinator wakes every waiter at each commit it records
(``_notify``), so the writer's one call answers within the commit's own step.

Served by ``CoordinatorActor``.
"""

from __future__ import annotations

import time
from abc import abstractmethod
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from raysink.reports import RuntimeStatus

__all__ = ["CommitWaits"]


class CommitWaits:
    """The writers' wait for earlier commits, served by ``CoordinatorActor``."""

    if TYPE_CHECKING:  # CoordinatorActor's
        @abstractmethod
        async def status(self) -> RuntimeStatus: ...
        @abstractmethod
        async def _wait_change(self, timeout: float) -> None: ...

    async def earlier_committed(self, sink: str, epoch: int, wait: float) -> RuntimeStatus:
        """The status once no decided epoch before ``epoch`` is missing from ``sink``
        (``RuntimeStatus.committed_before``), or after ``wait`` seconds whatever it says
        (the writer asks again, up to its own deadline)."""
        deadline = time.monotonic() + wait
        while True:
            status = await self.status()
            left = deadline - time.monotonic()
            if left <= 0 or status.committed_before(sink, epoch):
                return status
            # the snapshot is taken before each ``_notify``: a commit recorded while this
            # waits wakes it; the bound only caps a wake that never comes
            await self._wait_change(min(left, 0.5))
