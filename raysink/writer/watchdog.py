"""A watchdog for calls into a sink that may hang: it keeps warning while one lasts.

A writer runs its sink's ``write``, ``flush`` and ``pre_commit`` under ``watching(name)``.
A thread of its own checks every fraction of ``every`` seconds and logs a warning each
time the call in progress has run another ``every`` seconds ("flush has been running for
15 s"), so a flush that hangs is reported again and again, not once. ``busy()`` says what
runs now, for status.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["Watchdog"]

log = logging.getLogger(__name__)


class Watchdog:
    """Watches one call at a time (the writer's sink calls are serialised by its lock)."""

    def __init__(self, name: str, every: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._name = name
        self._every = every
        self._clock = clock
        self._call: tuple[str, float] | None = None
        self._warned = 0
        self.warnings = 0

    @contextlib.contextmanager
    def watching(self, call: str) -> Iterator[None]:
        self._call, self._warned = (call, self._clock()), 0
        try:
            yield
        finally:
            self._call = None

    def check(self) -> float | None:
        """Warn when the call in progress has run another ``every`` seconds; returns how
        long it has run (``None``: nothing runs)."""
        current = self._call
        if current is None:
            return None
        call, started = current
        elapsed = self._clock() - started
        if elapsed >= (self._warned + 1) * self._every:
            self._warned = int(elapsed // self._every)
            self.warnings += 1
            log.warning("%s: %s has been running for %.0f s; the sink may be stuck",
                        self._name, call, elapsed)
        return elapsed

    def busy(self) -> dict[str, Any] | None:
        current = self._call
        if current is None:
            return None
        return {"call": current[0], "seconds": round(self._clock() - current[1], 3)}

    def run(self, stop: threading.Event) -> None:
        """Check until ``stop`` is set (the body of the watchdog's thread)."""
        while not stop.wait(min(1.0, self._every / 4)):
            self.check()
