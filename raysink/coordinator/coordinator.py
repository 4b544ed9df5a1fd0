"""``CoordinatorActor``: the asyncio Ray actor around ``EpochCoordinator``.

It adds what needs waiting: commit requests wait on futures until the epoch is PENDING
(that is the writers' ack); recovery runs in the background at start; then each sink has
its own commit worker (RisingWave's coordinator worker per sink), which commits that
sink's decided epochs in order with its own exponential backoff and jitter, so a sink
whose target is down holds no other sink's epochs. Meta store calls and decisions run in
a worker thread, one at a time under one lock; a sink's commit I/O runs in a thread of
its own outside that lock, and logs a warning every ``warn_after`` seconds while it lasts.
``status()`` always answers at once from a snapshot.

Writers report whether they can reach their target (``writer_health``): a writer that
cannot makes its sink ``stalled`` with the error until it can again.

A restarted actor (Ray's restart after a crash) re-runs the constructor: it claims a new
generation in the meta store (only for the holder of the runtime's lease), which fences the
previous one, and recovers.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import random
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from raysink._metrics import CoordinatorMetrics
from raysink.coordinator.epochs import (
    CommitOutcome,
    EpochCoordinator,
    OpenDecision,
    Resolution,
    StaleAttemptError,
)
from raysink.coordinator.health import SinkHealthBook
from raysink.coordinator.maintenance import MaintenanceBook, MaintenanceCalls
from raysink.coordinator.producers import FeedRegistry, FeedsState
from raysink.coordinator.retries import BACKOFF_START, CommitRetries
from raysink.coordinator.stream_calls import StreamCalls
from raysink.coordinator.waits import CommitWaits
from raysink.errors import (
    BackpressureError,
    FencedError,
    MetaStoreError,
    NewerVersionError,
    RaySinkError,
)
from raysink.protocol.messages import CommitRequest, CommitWait, OpenedEpoch
from raysink.protocol.results import EpochSource, RecoveryState, WriterLayout
from raysink.protocol.vnodes import Bitmap, assign
from raysink.reports import ActorProcess, RuntimeStatus, SinkStatus
from raysink.sinks.base import Sink

__all__ = ["CoordinatorActor", "CoordinatorConfig"]

log = logging.getLogger(__name__)
T = TypeVar("T")

_RECENT_EPOCHS = 256
_STATUS_WAITS_FOR_RECOVERY = 10.0
_RECOVERY_WAIT = 10.0


@dataclass(frozen=True, kw_only=True, slots=True)
class CoordinatorConfig:
    """What a coordinator needs; picklable (sinks are descriptions, not connections)."""

    runtime: str
    metastore: str | None
    sinks: dict[str, Sink]
    writers: int
    max_pending_epochs: int = 2
    retry_cap: float = 60.0
    add_sinks: tuple[str, ...] = ()
    drop_sinks: tuple[str, ...] = ()
    epoch_offset: int | None = None
    warn_after: float = 5.0
    """A sink commit running this many seconds logs a warning (again each period)."""
    lease_holder: str | None = None  # the driver's lease: claims need it held


class CoordinatorActor(StreamCalls, MaintenanceCalls, CommitWaits):
    """One per runtime, named ``<runtime>.coordinator`` in the ``raysink`` namespace (the
    continuous stream's calls: ``StreamCalls``; table maintenance: ``MaintenanceCalls``)."""

    def __init__(self, config: CoordinatorConfig) -> None:
        from raysink.coordinator.metastore import open_metastore

        self._config = config
        self._store = open_metastore(config.metastore, config.runtime)
        kinds = {name: sink.kind for name, sink in config.sinks.items()}
        record = self._store.claim(config.runtime, kinds, add=config.add_sinks,
                                   drop=config.drop_sinks, holder=config.lease_holder)
        self._dropped = tuple(record.dropped)
        bitmaps: dict[str, list[Bitmap]] = {
            name: assign(config.writers) for name in config.sinks}
        self._core = EpochCoordinator(
            runtime=config.runtime, store=self._store, sinks=config.sinks,
            generation=record.generation, bitmaps=bitmaps,
            max_pending_epochs=config.max_pending_epochs, epoch_offset=config.epoch_offset)
        self._health = SinkHealthBook(config.sinks)
        self._maintenance = MaintenanceBook(config.sinks, config.retry_cap)
        self._feeds = FeedRegistry()
        self._recent: OrderedDict[int, tuple[str, ...]] = OrderedDict()
        self._started = False
        self._fatal: BaseException | None = None
        self._recovering: BaseException | None = None  # why recovery is being retried
        self._lock: asyncio.Lock | None = None
        self._changed: asyncio.Condition | None = None
        self._recovered: asyncio.Event | None = None
        self._snapshot = RuntimeStatus(name=config.runtime, metastore="", sinks={},
                                       last_committed_epoch=None, pending_epochs=[])
        self._history: dict[str, list[dict[str, Any]]] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._metrics = CoordinatorMetrics(config.runtime, config.sinks, config.max_pending_epochs)
        log.info("coordinator of %s: generation %s on %s", config.runtime,
                 record.generation, self._store.url)

    # ------------------------------------------------------------------ plumbing

    def _ensure_started(self) -> None:
        if self._started:
            return
        self._started = True
        self._lock = asyncio.Lock()
        self._changed = asyncio.Condition()
        self._recovered = asyncio.Event()
        self._take_snapshot()
        self._tasks.append(asyncio.get_running_loop().create_task(self._run()))

    async def _locked(self, fn: Callable[[], T]) -> T:
        """Run a blocking call in a thread under the one lock; refresh the snapshot."""
        assert self._lock is not None
        async with self._lock:
            try:
                return await asyncio.to_thread(fn)
            except FencedError as exc:
                self._fatal = exc
                raise
            finally:
                self._take_snapshot()

    async def _notify(self) -> None:
        assert self._changed is not None
        async with self._changed:
            self._changed.notify_all()

    async def _wait_change(self, timeout: float) -> None:
        assert self._changed is not None
        async with self._changed:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._changed.wait(), timeout)

    async def _until_recovered(self) -> None:
        """Wait for recovery; while it is retried on the meta store's errors, for
        ``_RECOVERY_WAIT`` seconds at most, then ``MetaStoreError`` naming it (a call
        without a deadline of its own must not wait for as long as the store is down)."""
        self._ensure_started()
        assert self._recovered is not None
        while not self._recovered.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._recovered.wait(), _RECOVERY_WAIT)
            if not self._recovered.is_set() and self._recovering is not None:
                raise MetaStoreError(
                    f"the coordinator has not recovered: the meta store failed "
                    f"({self._recovering}); it tries again with backoff, retry once the "
                    f"meta store answers", runtime=self._config.runtime)
        if self._fatal is not None:
            raise self._fatal

    # ------------------------------------------------------------------ background

    async def _run(self) -> None:
        try:
            await self._recover()
            await self._commit_workers()
        except FencedError as exc:
            self._fatal = exc
            log.error("coordinator of %s fenced: %s", self._config.runtime, exc)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # keep status answering with the cause
            self._fatal = exc
            log.exception("coordinator of %s stopped", self._config.runtime)
        finally:
            assert self._recovered is not None
            self._recovered.set()

    async def _recover(self) -> None:
        """Recover, again after a meta store error: that is transient until proven
        otherwise (a PostgreSQL failover right after the claim), so it is retried with
        backoff (up to ``retry_cap`` between tries) for as long as it lasts, ``status()``
        and ``recovery()`` naming it meanwhile. A newer generation (``FencedError``) or a
        target deleted after commits stops this coordinator for good."""
        backoff = BACKOFF_START
        while True:
            try:
                await self._recover_once()
                break
            except NewerVersionError:
                raise  # no retry makes this raysink read a newer one's records
            except MetaStoreError as exc:
                self._recovering = exc
                self._take_snapshot()
                delay = min(backoff, self._config.retry_cap) * random.uniform(0.5, 1.0)
                log.warning("%s: recovery failed on the meta store (%s); trying again in "
                            "%.2fs", self._config.runtime, exc, delay)
                await asyncio.sleep(delay)
                backoff = min(max(backoff * 2, 0.1), self._config.retry_cap)
        self._recovering = None
        self._take_snapshot()
        assert self._recovered is not None
        self._recovered.set()

    async def _recover_once(self) -> None:
        aborted = await self._locked(self._core.recover)
        if aborted:
            log.info("%s: aborted unfinished epochs %s on recovery", self._config.runtime,
                     aborted)
        try:
            await self._locked(self._core.reconcile_markers)
        except MetaStoreError:
            raise
        except RaySinkError as exc:
            self._health.commit_failed(exc.sink or "", exc)
            self._fatal = exc
        self._health.started()
        await self._locked(self._persist_health)

    async def _commit_workers(self) -> None:
        """One commit worker per sink; a fenced coordinator stops them all."""
        workers = [asyncio.get_running_loop().create_task(self._sink_worker(name))
                   for name in self._config.sinks]
        self._tasks.extend(workers)
        try:
            await asyncio.gather(*workers)
        finally:
            for worker in workers:
                worker.cancel()

    async def _sink_worker(self, sink: str) -> None:
        """Commit ``sink``'s share of each PENDING epoch, in epoch order, retrying with its
        own backoff (``retries``: a ``DataLossError`` at the cap, logged once)."""
        retries = CommitRetries(self._config.runtime, sink, self._config.retry_cap)
        while True:
            step = self._core.next_commit(sink)
            if step is None:
                if not await self._maintain_between(sink):  # nothing due: wait for work
                    await self._wait_change(1.0)
                continue
            started = time.monotonic()
            try:
                outcome = (await self._watched(
                    sink, step.epoch, asyncio.to_thread(self._core.run_commit, step))
                    if not step.carries_nothing else self._core.run_commit(step))  # no I/O
                self._remember_skipped(outcome)  # before a waiter can see the epoch done
                await self._locked(functools.partial(self._core.record_commit, outcome))
            except FencedError:
                raise
            except Exception as exc:
                self._health.commit_failed(sink, exc)
                self._metrics.retried(sink)
                await self._record_health()
                await asyncio.sleep(retries.failed(step.epoch, exc))
                continue
            retries.succeeded()
            self._metrics.committed(outcome, time.monotonic() - started)
            self._after_commit(outcome, started)
            await self._record_health()
            await self._notify()

    async def _watched(self, sink: str, epoch: int, work: Awaitable[T]) -> T:
        """Await ``work`` (one sink commit), logging a warning every ``warn_after`` seconds
        while it lasts (RisingWave's periodic "still committing")."""
        task = asyncio.ensure_future(work)
        started = time.monotonic()
        while True:
            done, _ = await asyncio.wait({task}, timeout=self._config.warn_after)
            if done:
                return task.result()
            log.warning("%s: still committing epoch %s to sink %s after %.0fs",
                        self._config.runtime, epoch, sink, time.monotonic() - started)

    async def _record_health(self) -> None:
        """Persist changed sink states. A meta store that is unreachable for a while (a
        PostgreSQL restart) only delays this: the workers must live on and retry.
        Unchanged states are neither written nor read back (most commits change none)."""
        if not self._health.changed():
            self._take_snapshot()
            return
        try:
            await self._locked(self._persist_health)
        except MetaStoreError as exc:
            log.warning("%s: could not record sink states (%s); the commits go on",
                        self._config.runtime, exc)

    def _remember_skipped(self, outcome: CommitOutcome) -> None:
        """Note a sink whose marker already held the epoch (the report's
        ``skipped_sinks``)."""
        recent = self._recent.setdefault(outcome.epoch, ())
        if outcome.skipped and outcome.sink not in recent:
            self._recent[outcome.epoch] = (*recent, outcome.sink)
        while len(self._recent) > _RECENT_EPOCHS:
            self._recent.popitem(last=False)

    def _after_commit(self, outcome: CommitOutcome, started: float) -> None:
        epoch = outcome.epoch
        self._health.committed(outcome.sink)
        if self._core.last_committed is not None and self._core.last_committed >= epoch:
            log.info("%s: epoch %s committed (%.3fs in commit)", self._config.runtime, epoch,
                     time.monotonic() - started)

    def _persist_health(self) -> None:
        """Write changed sink states to the meta store (runs in the worker thread); only
        this generation writes them, so what was stored last is known."""
        changed = self._health.changed()
        for name, state, error in changed:
            self._store.set_sink_status(self._config.runtime, self._core.generation,
                                        name, state, error)
        if changed or not self._history:
            records = self._store.sink_statuses(self._config.runtime)
            self._health.stored(records)
            self._history = {n: list(r.history) for n, r in records.items()}

    # ------------------------------------------------------------------ driver calls

    async def ping(self) -> int:
        self._ensure_started()
        return self._core.generation

    async def process(self) -> ActorProcess:
        """Where this coordinator runs (``rt.processes()``)."""
        return ActorProcess.here("coordinator")

    async def open_epoch(self, requested: int | None, timeout: float) -> OpenedEpoch:
        """Open an epoch before its data is sent (waiting up to ``timeout`` under
        backpressure): its OPEN record is durable before any writer stages."""
        await self._until_recovered()
        decision: OpenDecision = await self._retrying_backpressure(
            lambda: self._core.open_epoch(requested), timeout)
        await self._notify()
        if decision.wait_roll_forward:
            await self.wait_committed(decision.epoch, timeout)
        skip = decision.skip or decision.wait_roll_forward
        return OpenedEpoch(epoch=decision.epoch, attempt=decision.attempt, skip=skip,
                           skipped_sinks=self._skipped_sinks(decision.epoch, skip),
                           generation=self._core.generation,
                           committed_through=self._core.committed_through())

    async def _retrying_backpressure(self, call: Callable[[], T], timeout: float) -> T:
        """``call`` under the lock, again while it raises ``BackpressureError`` (too many
        outstanding epochs), up to ``timeout``."""
        deadline = time.monotonic() + timeout
        waited = False
        while True:
            try:
                return await self._locked(call)
            except BackpressureError:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise
                if not waited:
                    waited = True
                    self._metrics.waited()
                await self._wait_change(min(left, 1.0))

    def _skipped_sinks(self, epoch: int, skip: bool) -> tuple[str, ...]:
        if skip:
            return tuple(self._config.sinks)
        return self._recent.get(epoch, ())

    async def commit_epoch(self, epoch: int, attempt: int, requests: list[CommitRequest],
                           timeout: float, generation: int | None = None) -> CommitWait:
        """Decide an attempt from its writers' commit requests, gathered by the driver from
        their barrier answers (one call per epoch, whatever the writers), then wait up to
        ``timeout`` for every sink to commit it.

        The decision is one meta store transaction: PENDING, with the OPEN of an attempt
        whose open travelled with its data. Bad data across writers
        (``SchemaMismatchError``) aborts the attempt and is raised; so is
        ``StaleAttemptError`` for an attempt that can no longer commit. ``generation``:
        the coordinator generation the driver began an unopened attempt under."""
        await self._until_recovered()

        def decide() -> bool:  # one hop to the worker thread for both steps
            self._core.gather(epoch, attempt, requests, generation)
            return self._core.persist_pending(epoch, attempt)

        self._metrics.decided(epoch, requests)
        try:
            decided = await self._retrying_backpressure(decide, timeout)
        except (StaleAttemptError, BackpressureError, FencedError):
            raise
        except Exception:
            await self._abort_attempt(epoch, attempt)
            raise
        await self._notify()
        if not decided:
            raise StaleAttemptError(f"attempt {attempt} of epoch {epoch} was aborted before "
                                    "its decision", runtime=self._config.runtime, epoch=epoch)
        self._feeds.forget(epoch - 1)
        return await self.wait_committed(epoch, timeout, attempt)

    async def set_layout(self, writers: int) -> WriterLayout:
        """Rescale: ``writers`` writers per sink (their vnode bitmaps by
        ``vnodes.assign``) from the next epoch on. Refused (``RescaleRefusedError``)
        while an epoch is open or a continuous stream runs. Returns the new layout (as
        OPEN records keep it)."""
        await self._until_recovered()
        self._refuse_rescale_in_stream()
        bitmaps = {name: assign(writers) for name in self._config.sinks}
        await self._locked(lambda: self._core.set_layout(bitmaps))
        log.info("%s: writer layout now %s writers per sink", self._config.runtime, writers)
        return self._core.writer_layout()

    async def _abort_attempt(self, epoch: int, attempt: int) -> None:
        """Abort the attempt. When recording the abort fails too (the meta store down), it
        stays OPEN in the core; ``resolve`` or the next open of the epoch aborts it."""
        try:
            await self._locked(lambda: self._core.abort(epoch, attempt))
        except Exception as exc:
            log.warning("%s: could not abort attempt %s of epoch %s yet: %s",
                        self._config.runtime, attempt, epoch, exc)
        await self._notify()

    async def resolve(self, epoch: int, attempt: int | None = None) -> Resolution:
        """COMMITTED, ROLLING_FORWARD or ABORTED; an open attempt is aborted first, and
        what ``attempt`` staged swept when its open never came here."""
        await self._until_recovered()
        resolution: Resolution = await self._locked(lambda: self._core.resolve(epoch, attempt))
        self._feeds.forget(epoch)
        await self._notify()
        return resolution

    async def wait_committed(self, epoch: int, timeout: float,
                             attempt: int | None = None) -> CommitWait:
        """Wait until every sink committed ``epoch`` (or ``timeout``). The wait ends at once
        (``aborted``) for an epoch, or ``attempt``, that is neither decided nor open."""
        await self._until_recovered()
        deadline = time.monotonic() + timeout
        while True:
            last = self._core.last_committed
            if last is not None and last >= epoch:
                return CommitWait(committed=True, skipped_sinks=self._recent.get(epoch, ()),
                                  generation=self._core.generation,
                                  next_attempt=self._core.next_attempt(epoch + 1))
            outcome = (self._core.attempt_outcome(epoch, attempt) if attempt is not None
                       else "open" if self._core.epoch_state(epoch) is not None else "aborted")
            if outcome in ("aborted", "unknown"):
                return CommitWait(committed=False, aborted=True)
            left = deadline - time.monotonic()
            if left <= 0 or self._fatal is not None:
                return CommitWait(committed=False, errors=self._health.errors())
            await self._wait_change(min(left, 0.5))

    async def committed_through(self) -> int | None:
        """The highest epoch every sink holds, by the meta store or by the markers."""
        await self._until_recovered()
        return self._core.committed_through()

    async def epoch_source(self) -> EpochSource | None:
        """The epoch source the runtime is bound to, if any."""
        await self._until_recovered()
        record = await self._locked(lambda: self._store.load(self._config.runtime))
        return EpochSource.from_record(record.epoch_source) if record else None

    async def check_alignment(self, numbering: str, epoch_offset: int | None) -> None:
        """Refuse (``ConfigError``) numbering epochs from this meta store when the targets
        hold epochs it does not know (``markers.refuse_unknown_epochs``): before a
        streaming query is bound here for the first time."""
        await self._until_recovered()
        await self._locked(lambda: self._core.check_alignment(numbering, epoch_offset))

    async def bind_source(self, source: EpochSource) -> None:
        """Bind the runtime to ``source`` (the caller checked it)."""
        await self._until_recovered()
        await self._locked(lambda: self._store.bind_source(
            self._config.runtime, self._core.generation, source.to_record()))

    # ------------------------------------------------------------------ feed calls

    async def feed_alive(self, epoch: int, attempt: int, feed: int) -> None:
        """A producer's heartbeat while it uses its feed of ``(epoch, attempt)``."""
        self._feeds.alive(epoch, attempt, feed, time.monotonic())

    async def feed_closed(self, epoch: int, attempt: int, feed: int,
                          counts: dict[int, int]) -> None:
        """The feed's barrier went to the writers in ``counts`` (messages per writer)."""
        self._ensure_started()
        self._feeds.closed(epoch, attempt, feed, counts, time.monotonic())
        await self._notify()

    async def feed_failed(self, epoch: int, attempt: int, feed: int, reason: str) -> None:
        """The producer gave up its feed (an exception while it wrote)."""
        self._ensure_started()
        self._feeds.failed(epoch, attempt, feed, reason)
        await self._notify()

    async def wait_feeds(self, epoch: int, attempt: int, feeds: list[int], timeout: float,
                         lease: float) -> FeedsState:
        """Wait up to ``timeout`` until every one of ``feeds`` closed, or one is lost."""
        self._ensure_started()
        deadline = time.monotonic() + timeout
        while True:
            state = self._feeds.state(epoch, attempt, feeds, lease=lease, now=time.monotonic())
            left = deadline - time.monotonic()
            if state.done or left <= 0:
                return state
            await self._wait_change(min(left, 0.5))

    # ------------------------------------------------------------------ writer calls

    async def writer_health(self, sink: str, writer_id: int, error: str | None) -> None:
        """A writer could not reach its target (``error``), or can again (``None``)."""
        self._ensure_started()
        self._health.writer(sink, writer_id, error)
        if error is not None:
            log.warning("%s: writer %s of sink %s cannot reach its target: %s",
                        self._config.runtime, writer_id, sink, error)
        await self._record_health()

    # ------------------------------------------------------------------ status, close

    async def status(self) -> RuntimeStatus:
        """The snapshot; right after a (re)start it waits a little for recovery, so the
        epochs it shows are the meta store's, then answers whatever the state."""
        self._ensure_started()
        assert self._recovered is not None
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._recovered.wait(), _STATUS_WAITS_FOR_RECOVERY)
        return self._snapshot

    async def recovery(self, timeout: float) -> RecoveryState:
        """Whether this coordinator has recovered, waiting up to ``timeout`` seconds for it:
        ``pending_epochs`` (the decided epochs still to commit) only mean something then."""
        self._ensure_started()
        assert self._recovered is not None
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._recovered.wait(), timeout)
        fatal = None if self._fatal is None else f"{type(self._fatal).__name__}: {self._fatal}"
        retrying = None if self._recovering is None else (
            f"{type(self._recovering).__name__}: {self._recovering}")
        return RecoveryState(recovered=self._recovered.is_set() and fatal is None,
                             pending_epochs=tuple(self._core.pending_epochs()),
                             retrying=retrying, fatal=fatal)

    def _take_snapshot(self) -> None:
        sinks = {name: SinkStatus(state=health.state,
                                  last_committed_epoch=self._core.sink_last_committed(name),
                                  last_error=health.last_error,
                                  history=list(self._history.get(name, [])),
                                  held_by=health.held_by,
                                  maintenance=self._maintenance.totals(name),
                                  table=self._maintenance.table(name))
                 for name, health in self._health.items()}
        for name in self._dropped:
            sinks[name] = SinkStatus(state="dropped", last_committed_epoch=None, last_error=None)
        self._snapshot = RuntimeStatus(
            name=self._config.runtime, metastore=self._store.url,
            last_committed_epoch=self._core.last_committed,
            pending_epochs=self._core.pending_epochs(),
            open_epoch=self._core.open_epoch_number(),
            error=(str(self._fatal) if self._fatal is not None else None
                   if self._recovering is None else f"recovering (retried on the meta "
                   f"store's error): {self._recovering}"), sinks=sinks)
        self._metrics.status(self._snapshot)

    async def close(self) -> None:
        """The runtime is closing (its epochs are committed or durably decided): sinks
        become PAUSED (a stalled one stays stalled), the commit workers stop once their
        sink's commit in progress ends, and the sinks' and meta store's connections close.
        Nothing is called after it."""
        self._ensure_started()
        self._health.paused()
        try:
            await self._locked(self._persist_health)
        finally:
            for task in self._tasks:
                task.cancel()
            await self._locked(self._release_resources)

    def _release_resources(self) -> None:
        for name, sink in self._core.sinks.items():
            with self._core.sink_io(name):
                try:
                    sink.close()
                except Exception as exc:  # closing must not keep the others open
                    log.warning("%s: closing sink %s: %s", self._config.runtime, name, exc)
        self._store.close()
