"""``Feed``: one producer's part of an epoch, usable from any Ray task or actor.

``rt.open_epoch()`` returns an ``EpochHandle``; ``ep.feed()`` a ``Feed``. A feed is
small and picklable: hand it to Ray tasks or actors on any node. ``feed.write(data)``
routes the data to the writers itself (by vnode when the runtime has a ``key``, spread
otherwise) and sends it straight to them, numbered per writer, with a credit window;
``feed.close()`` sends the feed's barrier to every writer it sent data to, carrying how
many messages it sent there, and tells the coordinator it closed. The data never passes
through the driver.

A producer retried by Ray (a task whose worker died, an actor restarted) unpickles the
same feed again and sends the same numbered messages: the writers drop what they already
have, so nothing is written twice, provided the producer makes the same data in the same
order (what Ray's retries assume anyway). While a feed is in use it sends a heartbeat to
the coordinator; a feed silent for longer than ``feed_timeout`` without closing is lost,
and the epoch's attempt is given up (nothing of it visible) when the driver commits.
Used as a context manager, a feed closes at the end of the block, or, when the block
raises, tells the coordinator it failed, so the commit fails at once.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from raysink import _faults
from raysink.driver import routing
from raysink.driver.calls import public_error, result, results
from raysink.driver.sender import Sender
from raysink.errors import ConfigError, EpochFailedError, RaySinkError, SchemaMismatchError
from raysink.protocol.barrier import BarrierFlags, CheckpointBarrier
from raysink.protocol.clients import CoordinatorClient, WriterClient
from raysink.protocol.vnodes import Bitmap

__all__ = ["Feed", "FeedRoute"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class FeedRoute:
    """What a producer needs to route and send an epoch's data (picklable)."""

    runtime: str
    writers: Mapping[str, Sequence[Any]]
    coordinator: Any
    key: tuple[str, ...] | None
    bitmaps: tuple[Bitmap, ...]
    max_batch_bytes: int | None
    credits: int
    heartbeat: float = 1.0
    evolve: bool = False  # every sink has schema_evolution="add_columns"

    @property
    def writer_count(self) -> int:
        return len(next(iter(self.writers.values())))

    @property
    def coordinator_client(self) -> CoordinatorClient:
        return CoordinatorClient.of(self.coordinator)


class Feed:
    """One producer's part of ``(epoch, attempt)``, numbered ``id`` (0 is the driver)."""

    def __init__(self, route: FeedRoute, *, epoch: int, attempt: int, feed_id: int,
                 checkpoint_id: int, skip: bool = False) -> None:
        if feed_id < 1:
            raise ConfigError(f"feed ids start at 1 (0 is the driver's); got {feed_id}")
        self.route = route
        self.epoch, self.attempt, self.id = epoch, attempt, feed_id
        self.checkpoint_id = checkpoint_id
        self.skip = skip
        self._reset()

    def _reset(self) -> None:
        """The per-process state: a feed unpickled elsewhere starts numbering at 0 again
        (a retried producer's messages are the same messages)."""
        self._sender: Sender | None = None
        self._schema: pa.Schema | None = None
        self._turn = self.id
        self._rows = 0
        self._done = False
        self._failed: str | None = None  # why this feed gave up, if it did
        self._lock = threading.Lock()
        self._beat: threading.Event | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {"route": self.route, "epoch": self.epoch, "attempt": self.attempt,
                "id": self.id, "checkpoint_id": self.checkpoint_id, "skip": self.skip}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._reset()

    def __repr__(self) -> str:
        return (f"Feed({self.route.runtime!r}, epoch={self.epoch}, attempt={self.attempt}, "
                f"id={self.id})")

    def __enter__(self) -> Feed:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 tb: object) -> None:
        if error is None:
            self.close()
        else:
            self.cancel(f"{type(error).__name__}: {error}")

    # ------------------------------------------------------------------ data

    def write(self, data: pa.Table | pa.RecordBatch | Sequence[Any]) -> int:
        """Send a Table, a RecordBatch (or a list of them, or object refs to them) to the
        writers; returns the rows sent (0 for an epoch the targets hold already). Raises
        raysink errors only (a writer gone: ``RuntimeUnavailableError``); after one, the
        feed is given up and the epoch's commit fails."""
        try:
            return self._write(data)
        except Exception as exc:
            raise self._public(exc, "a write") from exc

    def _public(self, exc: Exception, what: str) -> RaySinkError:
        return public_error(exc, what=f"{self!r}: {what}", runtime=self.route.runtime,
                            kind=EpochFailedError, epoch=self.epoch,
                            then=f"nothing of epoch {self.epoch} attempt {self.attempt} "
                                 "becomes visible: open the epoch again and feed it again")

    def _write(self, data: pa.Table | pa.RecordBatch | Sequence[Any]) -> int:
        """``write``, raising what failed as it is (a stream's feed tells a writer gone
        from a fault)."""
        with self._lock:
            self._check_open()
            if self.skip:
                return 0
            sender = self._start()
            plan = routing.plan_arrow(data, writers=self.route.writer_count, key=self.route.key,
                                    bitmaps=self.route.bitmaps,
                                    max_batch_bytes=self.route.max_batch_bytes,
                                    first_writer=self._turn % self.route.writer_count,
                                    evolve=self.route.evolve)
            self._check_schema(plan)
            self._turn += 1
            try:
                for k, ref in plan:
                    sender.send(k, ref)
            except BaseException as exc:  # part of it may have been sent: it cannot close
                self._give_up(f"a write failed: {type(exc).__name__}: {exc}")
                raise
            self._rows += plan.rows or 0
            return plan.rows or 0

    def close(self, checkpoint_id: int | None = None) -> int:
        """End this producer's part of the epoch: every write acknowledged, the barrier to
        each writer it sent data to, the coordinator told. Returns the rows sent.
        Closing twice is harmless. ``checkpoint_id``: the barrier's, when the stream's
        tick chose it after the feed was made. Raises raysink errors only."""
        try:
            return self._close(checkpoint_id)
        except Exception as exc:
            raise self._public(exc, "its close") from exc

    def _close(self, checkpoint_id: int | None = None) -> int:
        """``close``, raising what failed as it is."""
        with self._lock:
            if self._failed is not None:
                raise EpochFailedError(
                    f"{self!r} failed ({self._failed}) and cannot close; the epoch's "
                    "commit fails: open the epoch again and feed it again",
                    runtime=self.route.runtime, epoch=self.epoch)
            if self._done:
                return self._rows
            if not self.skip:
                try:
                    self._close_parts(checkpoint_id)
                except BaseException as exc:
                    # a close that failed (a writer lost, say) can never close: the commit
                    # must not wait for it (its heartbeat would go on while this worker
                    # lives, and the commit would wait its whole ``commit_timeout``)
                    self._give_up(f"its close failed: {type(exc).__name__}: {exc}")
                    raise
            self._finish()
            return self._rows

    def _close_parts(self, checkpoint_id: int | None) -> None:
        """Every write acknowledged, a barrier to each writer written to, the coordinator
        told."""
        _faults.hit("feed.before_close", runtime=self.route.runtime, epoch=self.epoch,
                    feed=self.id)
        sender = self._start()
        sender.finish()
        counts = {k: n for k, n in enumerate(sender.seqs) if n}
        barrier = CheckpointBarrier(
            self.checkpoint_id if checkpoint_id is None else checkpoint_id,
            self.epoch, BarrierFlags.NONE)
        results(WriterClient(handles[k]).feed_barrier(barrier, self.attempt, self.id, n)
                for handles in self.route.writers.values()
                for k, n in counts.items())
        result(self.route.coordinator_client.feed_closed(self.epoch, self.attempt,
                                                      self.id, counts))

    def cancel(self, reason: str = "cancelled by its producer") -> None:
        """Give this producer's part up: the epoch's commit fails at once (nothing of the
        attempt becomes visible) and the caller feeds the epoch again."""
        with self._lock:
            if self._done:
                return
            if not self.skip:
                self._give_up(reason)
            self._finish()

    def _give_up(self, reason: str) -> None:
        """Tell the coordinator this feed failed (best effort), and stop its heartbeat."""
        try:
            result(self.route.coordinator_client.feed_failed(
                self.epoch, self.attempt, self.id, reason))
        except Exception as exc:  # the lease expires instead
            log.warning("%r: could not report its failure: %s", self, exc)
        self._failed = reason
        self._finish()

    def _check_open(self) -> None:
        if self._failed is not None:
            raise EpochFailedError(
                f"{self!r} failed ({self._failed}); it takes no more data: open the epoch "
                "again and feed it again", runtime=self.route.runtime, epoch=self.epoch)
        if self._done:
            raise ConfigError(f"{self!r} is closed; a closed feed takes no more data "
                              "(take a new feed from the next epoch's handle)")

    def _check_schema(self, plan: routing.FeedPlan) -> None:
        """One schema per feed; with ``add_columns`` on every sink, schemas with a union
        (which the writers and the coordinator check again)."""
        schema = plan.schema
        if schema is None:
            return
        if self._schema is None:
            self._schema = schema
        elif not schema.equals(self._schema, check_metadata=False):
            from raysink import _schema

            if self.route.evolve:
                try:
                    self._schema = _schema.union([self._schema, schema])
                    return
                except SchemaMismatchError as exc:
                    raise SchemaMismatchError(f"{self!r}: {exc.message}", column=exc.column,
                                              runtime=self.route.runtime,
                                              epoch=self.epoch) from None
            raise SchemaMismatchError(
                f"{self!r}: this batch's schema differs from the feed's earlier batches: "
                f"{_schema.describe(self._schema, schema)}; an epoch has one schema (or "
                "give every sink schema_evolution='add_columns')",
                runtime=self.route.runtime, epoch=self.epoch)

    def _start(self) -> Sender:
        if self._sender is None:
            self._sender = Sender(self.route.writers, epoch=self.epoch,
                                  attempt=self.attempt, credits=self.route.credits,
                                  feed=self.id)
            self._beat = _start_heartbeat(self)
        return self._sender

    def _finish(self) -> None:
        self._done = True
        if self._beat is not None:
            self._beat.set()


def _start_heartbeat(feed: Feed) -> threading.Event:
    """Tell the coordinator every ``heartbeat`` seconds that ``feed`` is in use, until it
    closes, or is dropped unclosed (its task ended): then the beats stop and its lease
    runs out."""
    stop = threading.Event()
    coordinator, interval = feed.route.coordinator_client, feed.route.heartbeat
    key = (feed.epoch, feed.attempt, feed.id)
    weakref.finalize(feed, stop.set)

    def beat() -> None:
        while True:
            try:
                coordinator.feed_alive(*key).send()
            except Exception as exc:  # the coordinator restarting: beat again later
                log.debug("feed %s heartbeat: %s", key, exc)
            if stop.wait(interval):
                return

    threading.Thread(target=beat, daemon=True, name=f"raysink-feed-{feed.id}").start()
    return stop
