"""``SinkWriterActor``: one Ray actor per sink writer, owning one ``SinkWriter``.

The commands of a sink writer, as actor methods:

=============  ==========  ==================================================================
method         group       what it does
=============  ==========  ==================================================================
write          data        file ``(epoch, attempt, seq, [ref])``; apply in seq order; an early
                           message over the reorder buffer's byte bound is refused with
                           ``BackpressureError`` (the sender sends it again)
barrier        barrier     wait for ``last_seq`` writes, flush, pre-commit; answer with the
                           commit request (the driver gathers every writer's and sends them
                           to the coordinator at once). With ``DRAIN`` set it was the last
                           epoch: the writer closes after it. ``committed_through``: what
                           the sender knows committed (see below)
cancel         control     a ``CANCEL`` barrier: the attempt was abandoned; stop waiting for
                           it and drop what it staged
drain          control     a ``DRAIN`` barrier between epochs (``rt.close()``): drop what an
                           undecided attempt staged, close the sink writer (files closed,
                           connections closed); nothing is taken after it
finish         control     a sink whose writers hold their part open (``holds_transactions``:
                           Kafka): the sink's commit or abort, in the coordinator, asks the
                           writer to end it
process, ping  control     answer at once (``process``: where the writer runs and its
                           mailbox's state, for ``rt.processes()``)
=============  ==========  ==================================================================

A sink with ``holds_transactions`` pre-commits an epoch only once every earlier epoch is
committed to it (``raysink.writer.ordering``: told by the barrier's
``committed_through``, else asked of the coordinator); it may begin a large epoch's
transaction before the barrier, once every earlier epoch is committed (``_start_early``).

A timer flushes every ``flush_interval`` seconds (sharing the write lock), and a watchdog
warns every ``warn_interval`` seconds while a call into the sink lasts. A write error
poisons the epoch: its barrier rolls back and fails. Data refs travel nested (``[ref]``)
so no call waits on an unresolved argument; the writer fetches them itself, and reads
pulls (``raysink.protocol.pull``: a Spark partition on a RayDP executor) at their source. A writer
that cannot reach its target tells the coordinator, which shows the sink ``stalled`` until
it can again.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn, TypeVar

import pyarrow as pa

from raysink import _faults, _schema
from raysink._metrics import WriterMetrics
from raysink.errors import (
    BackpressureError,
    BarrierOrderError,
    EpochFailedError,
    RaySinkError,
    SchemaMismatchError,
    SinkUnavailableError,
)
from raysink.protocol.barrier import CheckpointBarrier
from raysink.protocol.clients import NAMESPACE as NAMESPACE
from raysink.protocol.clients import CoordinatorClient
from raysink.protocol.messages import BarrierAck, CommitRequest, DrainReport
from raysink.protocol.pull import resolve
from raysink.protocol.results import WriterStatus
from raysink.reports import ActorProcess, RuntimeStatus
from raysink.sinks._format import stamp
from raysink.sinks.base import Held, Sink
from raysink.writer.held import HeldRows, Key
from raysink.writer.mailbox import EpochSlot, FeedId, Mailbox, Verdict
from raysink.writer.ordering import EarlierCommits
from raysink.writer.watchdog import Watchdog

__all__ = ["SinkWriterActor", "WriterConfig"]

log = logging.getLogger(__name__)
T = TypeVar("T")

@dataclass(frozen=True, kw_only=True, slots=True)
class WriterConfig:
    runtime: str
    sink_name: str
    sink: Sink
    writer_id: int
    coordinator: str
    flush_interval: float = 5.0
    barrier_timeout: float = 600.0
    max_batch_bytes: int | None = None
    max_buffer_bytes: int | None = None
    warn_interval: float = 5.0


class SinkWriterActor:
    """Named ``<runtime>.<sink>.writer-<i>`` in the ``raysink`` namespace."""

    def __init__(self, config: WriterConfig) -> None:
        _faults.hit("writer.start", runtime=config.runtime, writer=config.writer_id,
                    sink=config.sink_name)
        self._config = config
        self._writer = config.sink.create_writer(config.writer_id)
        self._lock = threading.Lock()
        self._opened = False
        self._unreachable = False
        self._closed = threading.Event()
        # a periodic flush that failed since the last pre-commit or rollback (under _lock)
        self._flush_failed: BaseException | None = None
        self._books = HeldRows()  # whose rows the sink writer holds (under _lock)
        self._coordinator_handle: Any = None
        self._earlier = EarlierCommits(runtime=config.runtime, sink=config.sink_name,
                                       writer=config.writer_id,
                                       timeout=config.barrier_timeout,
                                       status=self._coordinator_status,
                                       lost=self._forget_coordinator)
        self._watchdog = Watchdog(self._name, config.warn_interval)
        self._open_writer(deferrable=True)
        self._mailbox: Mailbox[pa.Table] = Mailbox(config.max_buffer_bytes)
        self._rows_total = 0
        self._refused = 0
        self._metrics = WriterMetrics(config.runtime, config.sink_name, config.writer_id,
                                      config.max_buffer_bytes)
        for target, name in ((self._flush_timer, "raysink-flush"),
                             (lambda: self._watchdog.run(self._closed), "raysink-watchdog")):
            threading.Thread(target=target, daemon=True, name=name).start()

    def _open_writer(self, *, deferrable: bool = False) -> None:
        """Connect the sink writer (idempotent). At start an unreachable target is not
        fatal: an actor whose constructor fails is dead for good, and Ray keeps its name a
        while, so neither Ray nor the runtime could bring the writer back. The connection
        is tried again before the next write or pre-commit (the epoch fails meanwhile and
        is retried by the runtime)."""
        if self._opened:
            return
        try:
            self._sink_call("open", self._writer.open)
        except SinkUnavailableError as exc:
            if not deferrable:
                raise
            log.warning("%s: the sink is unreachable at start (%s); connecting again before "
                        "the next write", self._name, exc)
            return
        self._opened = True
        self._reachable()

    def _sink_call(self, call: str, fn: Callable[[], T]) -> T:
        """Run a call into the sink writer under the watchdog; an unreachable target is
        reported to the coordinator (the sink shows ``stalled`` with the error)."""
        with self._watchdog.watching(call):
            try:
                return fn()
            except SinkUnavailableError as exc:
                self._report_health(f"{type(exc).__name__}: {exc}")
                raise

    def _reachable(self) -> None:
        """The sink writer reached its target: clear an earlier report."""
        if self._unreachable:
            self._report_health(None)

    def _report_health(self, error: str | None) -> None:
        """Tell the coordinator (without waiting) whether the target is reachable."""
        self._unreachable = error is not None
        try:
            self._coordinator().writer_health(
                self._config.sink_name, self._config.writer_id, error).send()
        except Exception as exc:  # no coordinator right now: the next report tells it
            self._coordinator_handle = None
            log.debug("%s: could not report to the coordinator: %s", self._name, exc)

    # ------------------------------------------------------------------ data group

    def write(self, epoch: int, attempt: int, seq: int, refs: Sequence[Any],
              feed: FeedId = 0) -> int:
        """File one data message of ``feed``; returns the rows it carried (0 when dropped:
        a duplicate, or of an attempt given up). An early message the mailbox has no room
        for is ``BackpressureError``: send it again after ``retry_after``."""
        self._refuse_if_closed(epoch)
        if self._mailbox.is_stale(epoch, attempt):
            return 0
        table = _as_table(_fetch(refs))
        verdict, replaced = self._mailbox.offer(epoch, attempt, feed, seq, table,
                                                int(table.nbytes))
        self._roll_back(replaced)
        if verdict is Verdict.FULL:
            self._refused += 1
            self._metrics.refused()
            raise BackpressureError(
                f"writer {self._config.writer_id}'s mailbox is full "
                f"({self._config.max_buffer_bytes:,} bytes of early messages); message "
                f"{seq} is refused for now, send it again", retry_after=0.05,
                runtime=self._config.runtime, sink=self._config.sink_name, epoch=epoch)
        if verdict is not Verdict.ACCEPTED:
            return 0
        self._drain()
        return int(table.num_rows)

    def feed_barrier(self, barrier: CheckpointBarrier, attempt: int, feed: FeedId,
                     last_seq: int) -> None:
        """``feed``'s barrier of ``(barrier.epoch, attempt)``: it sent this writer
        ``last_seq`` messages of it; what it sends after belongs to a later epoch."""
        self._refuse_if_closed(barrier.epoch)
        self._roll_back(self._mailbox.close_feed(barrier, attempt, feed, last_seq))

    def _refuse_if_closed(self, epoch: int) -> None:
        if self._closed.is_set():
            raise EpochFailedError(f"writer {self._config.writer_id} is closed (drained)",
                                   runtime=self._config.runtime, sink=self._config.sink_name,
                                   epoch=epoch)

    def _roll_back(self, keys: Sequence[tuple[int, int]]) -> None:
        """Roll back attempts a newer attempt of their epoch replaced."""
        for epoch, attempt in keys:
            self._rollback_writer(epoch, attempt)

    def _drain(self) -> None:
        """Apply what the current epoch can take now, in order (one thread at a time).
        A run whose attempt was given up or replaced after it was taken is dropped: the
        slot is looked up under the lock a rollback takes, so the run is either applied
        before the attempt's rollback or not at all (applied after it, its rows would
        stay in the sink writer for the next attempt's pre-commit)."""
        while True:
            claimed = self._mailbox.take_ready()
            if claimed is None:
                self._metrics.mailbox(self._mailbox.depth(),
                                      self._mailbox.waiting_bytes)
                return
            (epoch, attempt), run = claimed
            _faults.hit("writer.before_apply", runtime=self._config.runtime, epoch=epoch,
                        attempt=attempt, writer=self._config.writer_id,
                        sink=self._config.sink_name)
            rows = nbytes = 0
            try:
                with self._lock:
                    slot = self._mailbox.live_slot(epoch, attempt)
                    if slot is not None:
                        self._hold(epoch, attempt)
                    for _, table in run:
                        if slot is not None:
                            self._apply(slot, table)
                            self._start_early(epoch, attempt)
                        rows += table.num_rows
                        nbytes += table.nbytes
                        _faults.hit("writer.during_write", runtime=self._config.runtime,
                                    epoch=epoch, writer=self._config.writer_id,
                                    sink=self._config.sink_name)
            except Exception as exc:
                log.warning("%s: write to epoch %s failed, epoch poisoned: %s",
                            self._name, epoch, exc)
                self._mailbox.poison((epoch, attempt), exc)
            finally:
                self._mailbox.applied((epoch, attempt), [feed for feed, _ in run], rows)
                self._metrics.applied(rows, nbytes)

    def _start_early(self, epoch: int, attempt: int) -> None:
        """``SinkWriter.start_early`` when the sink writer asks for it and every earlier
        epoch is committed to every sink (``EarlierCommits.now``; under ``_lock``)."""
        if (self._config.sink.holds_transactions and self._writer.wants_early_start()
                and self._earlier.now(epoch)):
            self._sink_call("start_early",
                            functools.partial(self._writer.start_early, epoch, attempt))

    def _apply(self, slot: EpochSlot[pa.Table], table: pa.Table) -> None:
        limit = self._config.max_batch_bytes
        self._open_writer()
        if limit is not None and table.nbytes > limit:
            raise SchemaMismatchError(
                f"a batch of {table.nbytes:,} bytes ({table.num_rows:,} rows) is over "
                f"max_batch_bytes={limit:,}; split the data into smaller batches (in Spark: "
                "df.repartition(n) with more partitions) or raise max_batch_bytes",
                runtime=self._config.runtime, sink=self._config.sink_name,
                epoch=slot.epoch)
        if slot.schema is None:
            slot.schema = table.schema
        elif not table.schema.equals(slot.schema, check_metadata=False):
            slot.schema = self._epoch_schema(slot.schema, table.schema, slot.epoch)
        if table.num_rows == 0:
            # no rows, but the schema: a sink whose target does not exist yet creates it
            # from the schema at commit, so an empty first epoch leaves its marker too. A
            # column of Arrow's null type (an empty Python list) says nothing of its type,
            # so such a schema must not shape a target.
            if not any(pa.types.is_null(f.type) for f in table.schema):
                empty = pa.RecordBatch.from_pylist([], schema=table.schema)
                self._sink_call("write", lambda: self._writer.write(empty))
            return
        for batch in table.to_batches():
            if batch.num_rows:
                self._sink_call("write", functools.partial(self._writer.write, batch))

    def _epoch_schema(self, epoch_schema: pa.Schema, batch: pa.Schema,
                      epoch: int) -> pa.Schema:
        """A batch of another schema than the epoch's so far: with the sink's
        ``schema_evolution="add_columns"`` the epoch's schema becomes their union (what
        the barrier reports); otherwise, or without a union, ``SchemaMismatchError``."""
        where: dict[str, Any] = {"runtime": self._config.runtime,
                                 "sink": self._config.sink_name, "epoch": epoch}
        if self._config.sink.schema_evolution != "add_columns":
            raise SchemaMismatchError(
                "a batch's schema differs from the epoch's: "
                f"{_schema.describe(epoch_schema, batch)}; send one schema per epoch (or "
                "give the sink schema_evolution='add_columns')", **where)
        try:
            return _schema.union([epoch_schema, batch])
        except SchemaMismatchError as exc:
            raise SchemaMismatchError(exc.message, column=exc.column, **where) from None

    # ------------------------------------------------------------------ barrier group

    def barrier(self, barrier: CheckpointBarrier, attempt: int, last_seq: int,
                committed_through: int | None = None) -> BarrierAck:
        """The driver's barrier: it was the epoch's only feed (feed 0) and sent
        ``last_seq`` messages. Pre-commit once they are applied."""
        self.feed_barrier(barrier, attempt, 0, last_seq)
        return self.seal(barrier, attempt, [0], committed_through)

    def seal(self, barrier: CheckpointBarrier, attempt: int, feeds: Sequence[FeedId],
             committed_through: int | None = None) -> BarrierAck:
        """The epoch ``barrier.epoch`` has these ``feeds``: once each delivered its barrier
        (``feed_barrier``) and its messages are applied (aligned: a
        ``BarrierAligner`` over the feeds), and every earlier epoch is done here,
        pre-commit; the answer carries the commit request. ``DRAIN`` set: close after.
        ``committed_through``: an epoch the sender knows every sink committed, with every
        epoch before it (``None``: it does not know; ``raysink.writer.ordering``)."""
        epoch = barrier.epoch
        self._earlier.learn(committed_through)
        if barrier.is_cancel:
            raise BarrierOrderError("a CANCEL barrier goes to cancel(), not barrier()",
                                    checkpoint_id=barrier.checkpoint_id, epoch=epoch,
                                    runtime=self._config.runtime)
        self._refuse_if_closed(epoch)
        self._roll_back(self._mailbox.seal(epoch, attempt, feeds))
        self._drain()  # the epoch may have become current with its data already here
        self._await_feeds(barrier, attempt)
        slot = next((s for s in self._mailbox.slots() if s.key == (epoch, attempt)), None)
        rows = slot.rows if slot else 0
        schema = None if slot is None or slot.schema is None else _schema.encode(slot.schema)
        if self._config.sink.holds_transactions:
            self._earlier.wait(epoch)
        _faults.hit("writer.before_pre_commit", runtime=self._config.runtime, epoch=epoch,
                    attempt=attempt, writer=self._config.writer_id,
                    sink=self._config.sink_name)
        with self._lock:
            if self._mailbox.live_slot(epoch, attempt) is None:
                raise self._given_up_while_sealing(epoch, attempt)
            self._hold(epoch, attempt)
            spoiled, self._flush_failed = self._flush_failed, None
            if spoiled is None:
                self._open_writer()
                self._sink_call("flush", self._writer.flush)
                manifest = self._sink_call(
                    "pre_commit", functools.partial(self._writer.pre_commit, epoch, attempt))
                self._books.pre_commit((epoch, attempt))
        if spoiled is not None:
            self._refuse_spoiled(epoch, attempt, spoiled)
        self._reachable()
        _faults.hit("writer.after_pre_commit", runtime=self._config.runtime, epoch=epoch,
                    writer=self._config.writer_id, sink=self._config.sink_name)
        # Done here: what it staged is the coordinator's to commit or sweep, by epoch.
        self._mailbox.finish(epoch, attempt)
        self._rows_total += rows
        self._drain()  # the next epoch's data waiting here can go now
        if barrier.is_drain:
            self._close_writer()
        request = CommitRequest(sink=self._config.sink_name, writer=self._config.writer_id,
                                epoch=epoch, attempt=attempt, manifest=stamp(manifest),
                                schema=schema,
                                rows=rows)
        return BarrierAck(rows=rows, request=request)

    def _refuse_spoiled(self, epoch: int, attempt: int, error: BaseException) -> NoReturn:
        """A periodic flush failed since the last pre-commit: the sink writer may have
        dropped rows of this attempt (a file it could not write), so the attempt is rolled
        back and fails rather than pre-commit without them."""
        self._rollback_writer(epoch, attempt)
        self._mailbox.finish(epoch, attempt)
        raise EpochFailedError(
            f"writer {self._config.writer_id}: a periodic flush of this attempt failed "
            f"({type(error).__name__}: {error}); rows it held may not be written, so the "
            "attempt is given up (nothing of it is visible) and the epoch must be written "
            "again", runtime=self._config.runtime, sink=self._config.sink_name,
            epoch=epoch) from error

    def _given_up_while_sealing(self, epoch: int, attempt: int) -> EpochFailedError:
        """The attempt was given up (cancelled, or replaced by a newer one) after its seal
        was ready: its rollback ran, and the sink writer may hold the next attempt's rows
        by now, which a pre-commit of this attempt would take."""
        return EpochFailedError(
            f"writer {self._config.writer_id}: attempt {attempt} of epoch {epoch} was given "
            "up while it was sealed here; nothing of it is pre-committed",
            runtime=self._config.runtime, sink=self._config.sink_name, epoch=epoch)

    def _await_feeds(self, barrier: CheckpointBarrier, attempt: int) -> None:
        """Wait until the epoch's feeds are aligned and applied; else roll the attempt
        back and raise why (its bad data, or that it was given up, or the timeout)."""
        epoch = barrier.epoch
        outcome = self._mailbox.wait_sealed(epoch, attempt, self._config.barrier_timeout)
        if outcome == "ready":
            return
        slot = next((s for s in self._mailbox.slots() if s.key == (epoch, attempt)), None)
        poison = slot.poison if slot else None
        lost, outside = self._mailbox.why_unready((epoch, attempt))
        lost = lost if outcome == "lost" else []
        self._rollback_writer(epoch, attempt)
        self._mailbox.finish(epoch, attempt)
        if isinstance(poison, RaySinkError):
            raise poison
        if lost:
            raise EpochFailedError(
                f"writer {self._config.writer_id} was restarted after feeds {lost} sent it "
                "their data: what they sent went with its previous process, so this "
                "attempt cannot pre-commit; it is given up (nothing of it is visible) and "
                "the epoch must be fed again", runtime=self._config.runtime,
                sink=self._config.sink_name, epoch=epoch)
        if outcome == "unsealed":
            raise EpochFailedError(
                f"feeds {outside} sent writer {self._config.writer_id} data of this "
                "attempt but the commit leaves them out (ep.commit(feeds=...)): their rows "
                "cannot be taken back out, so nothing of the attempt is committed. Abort "
                "it and feed the epoch again with only the feeds to commit", attempts=1,
                runtime=self._config.runtime, sink=self._config.sink_name, epoch=epoch)
        raise EpochFailedError(
            f"writer {self._config.writer_id} could not pre-commit: {outcome}"
            + (f" ({type(poison).__name__}: {poison})" if poison else ""),
            runtime=self._config.runtime, sink=self._config.sink_name, epoch=epoch)

    def _coordinator_status(self, epoch: int, wait: float) -> RuntimeStatus:
        import ray

        # no wait (``EarlierCommits.now``, under the write lock): given up soon
        status: RuntimeStatus = ray.get(self._coordinator().earlier_committed(
            self._config.sink_name, epoch, wait).send(), timeout=wait + 30 if wait else 2.0)
        return status

    def _forget_coordinator(self) -> None:
        self._coordinator_handle = None

    def _coordinator(self) -> CoordinatorClient:
        """The coordinator's calls; its handle looked up by name once (again after a call
        failed: the driver may have replaced it)."""
        import ray

        if self._coordinator_handle is None:
            self._coordinator_handle = ray.get_actor(self._config.coordinator,
                                                     namespace=NAMESPACE)
        return CoordinatorClient.of(self._coordinator_handle)

    # ------------------------------------------------------------------ control group

    def cancel(self, barrier: CheckpointBarrier, attempt: int) -> None:
        """A ``CANCEL`` barrier: the attempt (and older ones of its epoch) was abandoned.
        A seal waiting for it stops waiting, what it staged is dropped, and later
        messages of it are ignored."""
        if not barrier.is_cancel:
            raise BarrierOrderError("cancel() takes a CANCEL barrier",
                                    checkpoint_id=barrier.checkpoint_id, epoch=barrier.epoch,
                                    runtime=self._config.runtime)
        for slot in self._mailbox.cancel(barrier.epoch, attempt):
            self._rollback_writer(slot.epoch, slot.attempt)
        self._rollback_writer(barrier.epoch, attempt)
        self._drain()

    def _rollback_writer(self, epoch: int, attempt: int) -> None:
        with self._lock:
            self._roll_back_held(epoch, attempt)

    # ------------------------------------------------------------------ held rows

    def _hold(self, epoch: int, attempt: int) -> None:
        """Rows of ``(epoch, attempt)`` go into the sink writer, or it pre-commits that
        attempt (under ``_lock``): another attempt's rows are rolled back first, and that
        attempt poisoned (``raysink.writer.held``)."""
        other = self._books.other_than((epoch, attempt))
        if other is not None:
            log.warning("%s: the sink writer holds rows of epoch %s attempt %s when epoch %s "
                        "attempt %s needs it: they are rolled back and that attempt fails",
                        self._name, other[0], other[1], epoch, attempt)
            self._roll_back_held(*other)
            self._set_aside(other, (epoch, attempt))
        self._books.held = (epoch, attempt)

    def _roll_back_held(self, epoch: int, attempt: int) -> None:
        """Roll ``(epoch, attempt)`` back in the sink writer, if it has anything of it
        (under ``_lock``); another attempt whose rows that dropped is poisoned."""
        if not self._books.needs_rollback((epoch, attempt)):
            return
        self._flush_failed = None  # what it may have dropped is rolled back too
        self._sink_call("rollback", functools.partial(self._writer.rollback, epoch, attempt))
        other = self._books.rolled_back((epoch, attempt))
        if other is not None:
            self._set_aside(other, (epoch, attempt))

    def _set_aside(self, held: Key, by: Key) -> None:
        """Poison ``held``: the rollback ``by`` needed dropped its rows from the sink
        writer (a no-op once its slot is gone)."""
        self._mailbox.poison(held, EpochFailedError(
            f"writer {self._config.writer_id}: rows of attempt {held[1]} of epoch {held[0]} "
            f"were rolled back from the sink writer for attempt {by[1]} of epoch {by[0]} "
            "(their data arrived out of order); this attempt is given up and its epoch is "
            "written again", runtime=self._config.runtime, sink=self._config.sink_name,
            epoch=held[0]))

    def drain(self, barrier: CheckpointBarrier) -> DrainReport:
        """A ``DRAIN`` barrier between epochs (the runtime is closing): attempts still here
        were never decided, so what they staged is dropped; then the sink writer is closed
        (files closed, connections closed). Nothing is taken after it."""
        if not barrier.is_drain:
            raise BarrierOrderError("drain() takes a DRAIN barrier",
                                    checkpoint_id=barrier.checkpoint_id, epoch=barrier.epoch,
                                    runtime=self._config.runtime)
        slots = self._mailbox.slots()
        for slot in slots:
            for dropped in self._mailbox.cancel(slot.epoch, slot.attempt):
                self._rollback_writer(dropped.epoch, dropped.attempt)
        self._close_writer()
        swept = (slots[0].epoch, slots[0].attempt) if slots else None
        return DrainReport(sink=self._config.sink_name, writer=self._config.writer_id,
                           rows_total=self._rows_total, swept=swept)

    def finish(self, epoch: int, attempt: int, commit: bool) -> Held:
        """End what the sink writer holds open for ``(epoch, attempt)`` (see
        ``SinkWriter.finish``): the sink's commit or abort asks, from the coordinator."""
        with self._lock:
            self._open_writer()
            return self._sink_call("finish", functools.partial(
                self._writer.finish, epoch, attempt, commit=commit))

    def ping(self) -> int:
        return os.getpid()

    def process(self) -> ActorProcess:
        return ActorProcess.here("writer", sink=self._config.sink_name,
                                 writer=self._config.writer_id, mailbox=self._status())

    def _status(self) -> WriterStatus:
        slots = self._mailbox.slots()
        slot = slots[0] if slots else None
        return WriterStatus(
            writer=self._config.writer_id, sink=self._config.sink_name, pid=os.getpid(),
            rows_total=self._rows_total,
            epoch=None if slot is None else slot.epoch,
            attempt=None if slot is None else slot.attempt,
            epochs_here=tuple(s.key for s in slots),
            waiting_for_feeds=self._mailbox.waiting_for(),
            mailbox_depth=self._mailbox.depth(),
            mailbox_bytes=self._mailbox.waiting_bytes, refused=self._refused,
            busy=self._watchdog.busy(), slow_warnings=self._watchdog.warnings,
            closed=self._closed.is_set())

    def _close_writer(self) -> None:
        """Close the sink writer once (it is never called twice); stops the timers."""
        with self._lock:
            if self._closed.is_set():
                return
            self._closed.set()
            self._sink_call("close", self._writer.close)

    # ------------------------------------------------------------------ timer

    def _flush_timer(self) -> None:
        interval = self._config.flush_interval
        while not self._closed.wait(interval):
            if not self._lock.acquire(timeout=interval):
                log.warning("%s: periodic flush waited %.1fs for the write lock; the sink "
                            "may be stuck", self._name, interval)
                continue
            started = time.monotonic()
            try:
                if not self._closed.is_set():
                    self._sink_call("flush", self._writer.flush)
            except Exception as exc:
                log.warning("%s: periodic flush failed, the attempt in progress fails at "
                            "its pre-commit: %s", self._name, exc)
                self._flush_failed = self._flush_failed or exc
            finally:
                self._lock.release()
            took = time.monotonic() - started
            if took > interval:
                log.warning("%s: periodic flush took %.1fs (interval %.1fs)", self._name,
                            took, interval)

    @property
    def _name(self) -> str:
        return f"{self._config.runtime}.{self._config.sink_name}.writer-{self._config.writer_id}"


def _fetch(refs: Sequence[Any]) -> list[Any]:
    """The data of one message: refs fetched, pulls (e.g. Spark partitions) pulled here."""
    return [resolve(r) for r in refs]


def _as_table(parts: list[Any]) -> pa.Table:
    tables = [pa.Table.from_batches([p]) if isinstance(p, pa.RecordBatch) else p
              for p in parts]
    if len(tables) == 1:
        table: pa.Table = tables[0]
        return table
    return pa.concat_tables(tables)
