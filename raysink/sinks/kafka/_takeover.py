"""``TakeOver``: ``init_transactions`` of a writer's new producer, in a thread of its own
(``KafkaWriter.open``: an actor restarted after a crash must answer at once, and taking a
transactional id over waits for the broker to abort what the earlier holder left open)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from raysink.errors import SinkUnavailableError

__all__ = ["TakeOver"]


class TakeOver:
    """``init_transactions`` of a new producer for ``txn_id``, in a thread: ``result()``
    waits for it and gives the producer and its error watch, or raises what it raised."""

    def __init__(self, make: Callable[[], tuple[Any, Any]], txn_id: str) -> None:
        self._make = make
        self._outcome: tuple[Any, Any] | BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"raysink-kafka-takeover-{txn_id}")
        self._thread.start()

    def _run(self) -> None:
        try:
            self._outcome = self._make()
        except BaseException as exc:  # handed to the caller of result()
            self._outcome = exc

    def done(self) -> bool:
        return not self._thread.is_alive()

    def result(self, timeout: float) -> tuple[Any, Any]:
        self._thread.join(timeout)
        outcome = self._outcome
        if outcome is None:
            raise SinkUnavailableError(f"taking a transactional id over did not end in "
                                       f"{timeout:g} s")
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome
