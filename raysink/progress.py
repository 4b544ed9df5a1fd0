"""Progress of long writes: rows, epochs and rate, on a terminal only.

::

    with Progress(total_rows=1_000_000, total_epochs=10) as progress:
        for batch in batches:
            progress.record(rt.write_arrow(batch))      # an EpochReport
    print(progress.summary())

On a terminal the line redraws in place (at most every ``min_interval`` seconds)::

    writing [########--------------]  36%  360,000/1,000,000 rows  4/10 epochs  91,200 rows/s

When the stream is not a terminal (a log file, a pipe, CI) nothing is drawn: the counters
still count, so ``summary()`` works either way. ``Progress`` is thread-safe: a Spark
``foreachBatch`` callback, a background thread and the main thread may all update it.

The runtime can use it without knowing about terminals: hold an optional ``Progress`` and
call ``record(report)`` after each epoch, or ``advance(rows=...)`` as writers acknowledge
data.
"""

from __future__ import annotations

import os
import shutil
import sys
import threading
import time
from dataclasses import dataclass
from types import TracebackType
from typing import Protocol, TextIO

__all__ = ["Progress", "ProgressSnapshot", "format_rate", "stream_is_terminal"]

_BAR_MIN = 10
_BAR_MAX = 30


class _HasRows(Protocol):
    """What ``Progress.record`` reads from an ``EpochReport``."""

    @property
    def rows(self) -> int: ...

    @property
    def skipped(self) -> bool: ...


@dataclass(frozen=True, kw_only=True, slots=True)
class ProgressSnapshot:
    """The counters at one moment."""

    rows: int
    epochs: int
    skipped_epochs: int
    seconds: float
    total_rows: int | None
    total_epochs: int | None

    @property
    def rows_per_second(self) -> float:
        """Average rate since the progress started (0 before any time passed)."""
        return self.rows / self.seconds if self.seconds > 0 else 0.0

    @property
    def fraction(self) -> float | None:
        """Done fraction by rows (else epochs), or ``None`` without a total."""
        if self.total_rows:
            return min(1.0, self.rows / self.total_rows)
        if self.total_epochs:
            return min(1.0, self.epochs / self.total_epochs)
        return None


def stream_is_terminal(stream: TextIO) -> bool:
    """Whether ``stream`` is an interactive terminal that can redraw a line."""
    if os.environ.get("TERM") == "dumb":
        return False
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # closed or not a real file
        return False


def format_rate(rows_per_second: float) -> str:
    """``1.23 M rows/s``, ``45,600 rows/s``."""
    if rows_per_second >= 1_000_000:
        return f"{rows_per_second / 1e6:.2f} M rows/s"
    return f"{rows_per_second:,.0f} rows/s"


class Progress:
    """Counts rows and epochs of a long write and draws a bar when attached to a terminal.

    ``stream`` defaults to ``sys.stdout``; ``enabled=None`` draws only when it is a
    terminal, ``True``/``False`` force it. ``total_rows`` / ``total_epochs`` (optional)
    give the bar its length. The clock starts at construction (or ``start()``).
    """

    def __init__(
        self,
        *,
        total_rows: int | None = None,
        total_epochs: int | None = None,
        label: str = "writing",
        stream: TextIO | None = None,
        enabled: bool | None = None,
        min_interval: float = 0.2,
    ) -> None:
        self._stream = stream if stream is not None else sys.stdout
        self.enabled = stream_is_terminal(self._stream) if enabled is None else enabled
        self.label = label
        self._total_rows = total_rows
        self._total_epochs = total_epochs
        self._min_interval = min_interval
        self._lock = threading.Lock()
        self._rows = 0
        self._epochs = 0
        self._skipped = 0
        self._started = time.monotonic()
        self._drawn_at = 0.0
        self._drawn_width = 0
        self._closed = False

    # ------------------------------------------------------------------ counting

    def start(self) -> Progress:
        """Restart the clock (counters are kept)."""
        with self._lock:
            self._started = time.monotonic()
        return self

    def advance(self, *, rows: int = 0, epochs: int = 0, skipped: int = 0) -> None:
        """Add ``rows`` written and ``epochs`` finished (``skipped`` of them skipped)."""
        with self._lock:
            self._rows += rows
            self._epochs += epochs
            self._skipped += skipped
            self._draw(force=False)

    def record(self, report: _HasRows) -> None:
        """Count one finished epoch from its ``EpochReport``."""
        self.advance(rows=report.rows, epochs=1, skipped=1 if report.skipped else 0)

    def snapshot(self) -> ProgressSnapshot:
        """The counters now."""
        with self._lock:
            return self._snapshot()

    def summary(self) -> str:
        """One line: rows, epochs, seconds and rate."""
        snap = self.snapshot()
        skipped = f" ({snap.skipped_epochs} skipped)" if snap.skipped_epochs else ""
        return (f"{snap.rows:,} rows in {snap.epochs} epochs{skipped}, {snap.seconds:.1f} s, "
                f"{format_rate(snap.rows_per_second)}")

    # ------------------------------------------------------------------ drawing

    def close(self) -> None:
        """Draw the final state and end the line (terminal only); idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self.enabled:
                self._draw(force=True)
                self._write("\n")

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def _snapshot(self) -> ProgressSnapshot:
        return ProgressSnapshot(rows=self._rows, epochs=self._epochs,
                                skipped_epochs=self._skipped,
                                seconds=time.monotonic() - self._started,
                                total_rows=self._total_rows, total_epochs=self._total_epochs)

    def _draw(self, *, force: bool) -> None:
        if not self.enabled or (self._closed and not force):
            return
        now = time.monotonic()
        if not force and now - self._drawn_at < self._min_interval:
            return
        self._drawn_at = now
        columns = shutil.get_terminal_size((100, 24)).columns
        line = render_line(self._snapshot(), self.label, columns)
        pad = max(0, self._drawn_width - len(line))
        self._drawn_width = len(line)
        self._write("\r" + line + " " * pad)

    def _write(self, text: str) -> None:
        try:
            self._stream.write(text)
            self._stream.flush()
        except (OSError, ValueError):  # the terminal went away: stop drawing
            self.enabled = False


def render_line(snap: ProgressSnapshot, label: str, columns: int = 100) -> str:
    """The progress line for ``snap``, cut to ``columns - 1`` characters."""
    parts = [label]
    fraction = snap.fraction
    if fraction is not None:
        width = max(_BAR_MIN, min(_BAR_MAX, columns // 4))
        filled = round(fraction * width)
        parts.append(f"[{'#' * filled}{'-' * (width - filled)}] {fraction * 100:3.0f}%")
    rows = f"{snap.rows:,}" + (f"/{snap.total_rows:,}" if snap.total_rows else "")
    epochs = f"{snap.epochs}" + (f"/{snap.total_epochs}" if snap.total_epochs else "")
    parts += [f"{rows} rows", f"{epochs} epochs", format_rate(snap.rows_per_second)]
    return "  ".join(parts)[: max(1, columns - 1)]
