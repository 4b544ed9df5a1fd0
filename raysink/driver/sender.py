"""Sending one feed's data messages to the writers, with a credit window per writer.

A ``Sender`` belongs to one producer of one ``(epoch, attempt)``: the driver (feed 0) or a
``Feed`` in a Ray task or actor. Writer ``k`` of every sink receives the same messages,
numbered ``seq`` 0, 1, ... per writer index, so the writer can put each feed's messages
back in order and drop a message sent twice (a producer retried by Ray sends the same
numbers again). At most ``credits`` writes per writer are unacknowledged; a write the
writer's full mailbox refused (``BackpressureError``) is kept and sent again.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from raysink.errors import BackpressureError
from raysink.protocol.clients import WriterClient

__all__ = ["Sender"]


class Sender:
    """Numbered, credit-windowed writes of one feed of ``(epoch, attempt)``.

    ``on_rows`` hears the rows each acknowledged write carried (counted once, not per
    sink). Raises what a write raised (a dead actor, bad data) as soon as it is seen."""

    def __init__(self, writers: Mapping[str, Sequence[Any]], *, epoch: int, attempt: int,
                 credits: int, feed: int = 0,
                 on_rows: Callable[[int], None] | None = None) -> None:
        self.writers = writers
        self.epoch, self.attempt, self.feed = epoch, attempt, feed
        self.credits = max(1, credits)
        self.seqs = [0] * len(next(iter(writers.values())))
        self._first = next(iter(writers))
        self._on_rows = on_rows
        self._windows: dict[tuple[str, int], deque[tuple[Any, int, Any]]] = {}
        self._refused: dict[tuple[str, int], list[tuple[int, Any]]] = {}

    def send(self, k: int, ref: Any) -> None:
        """The next message for writer ``k`` of every sink."""
        seq = self.seqs[k]
        self.seqs[k] += 1
        for sink in self.writers:
            self.send_numbered(sink, k, seq, ref)

    def number(self, k: int) -> int:
        """Take the next ``seq`` of writer ``k`` without sending (tests reorder sends)."""
        seq = self.seqs[k]
        self.seqs[k] += 1
        return seq

    def send_numbered(self, sink: str, k: int, seq: int, ref: Any) -> None:
        """Message ``seq`` to writer ``k`` of ``sink``, once the window has room."""
        while len(self._windows.get((sink, k), ())) >= self.credits:
            self._settle(sink, k)
        self._submit(sink, k, seq, ref)

    def finish(self) -> None:
        """Settle every write in flight; send the refused ones again, lowest ``seq``
        first, until every writer took everything. Each round makes progress: a writer
        always takes the message it needs next."""
        while True:
            wait = 0.0
            for (sink, k), window in self._windows.items():
                while window:
                    wait = max(wait, self._settle(sink, k))
            if not any(self._refused.values()):
                return
            time.sleep(wait)
            for (sink, k), items in self._refused.items():
                again, items[:] = sorted(items, key=lambda item: item[0]), []
                for seq, ref in again:
                    while len(self._windows.get((sink, k), ())) >= self.credits:
                        wait = max(wait, self._settle(sink, k))
                    self._submit(sink, k, seq, ref)

    def _submit(self, sink: str, k: int, seq: int, ref: Any) -> None:
        from ray.exceptions import PendingCallsLimitExceeded

        try:
            call = WriterClient(self.writers[sink][k]).write(
                self.epoch, self.attempt, seq, [ref], self.feed).send()
        except PendingCallsLimitExceeded as exc:
            raise BackpressureError("a writer's mailbox is full; slow down or raise credits",
                                    retry_after=0.5, epoch=self.epoch) from exc
        self._windows.setdefault((sink, k), deque()).append((call, seq, ref))

    def _settle(self, sink: str, k: int) -> float:
        """Settle the oldest write in flight to ``(sink, k)``; a write the writer's full
        mailbox refused is kept to send again (other writes go on meanwhile: the one the
        writer needs next may not be sent yet). Returns the wait it asked for."""
        from raysink.driver.calls import get

        call, seq, ref = self._windows[(sink, k)].popleft()
        try:
            rows = int(get(call))
        except BackpressureError as exc:
            self._refused.setdefault((sink, k), []).append((seq, ref))
            return exc.retry_after
        if self._on_rows is not None and sink == self._first:
            self._on_rows(rows)
        return 0.0
