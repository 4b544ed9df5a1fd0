"""``SinkRuntime``: the user's facade.

::

    with SinkRuntime("orders", ParquetSink("/data/orders"), writers=2) as rt:
        report = rt.write_arrow(table)             # one epoch, committed exactly once
        rt.write(spark_df)                         # a Spark DataFrame, one epoch
        query = stream.writeStream.foreachBatch(rt.foreach_batch).start()

One epoch, from the driver: open it at the coordinator (durable OPEN record), send the data
to the writers with a credit window, send each writer its barrier, wait until every sink
made the epoch visible. After any failure the driver asks the coordinator to ``resolve``
the epoch and re-feeds only an ABORTED one, after every writer rolled the attempt back,
up to ``max_attempts`` attempts.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from raysink._options import rejects_unknown_options
from raysink.coordinator.coordinator import CoordinatorConfig
from raysink.driver import routing
from raysink.driver.calls import ask, get, short, typed_errors
from raysink.driver.epoch import EpochDriver, EpochSettings
from raysink.driver.feed import FeedRoute
from raysink.driver.handle import EpochHandle
from raysink.driver.lease import LEASE_SECONDS, LeaseKeeper
from raysink.driver.lifecycle import PING_TIMEOUT, ActorSet, coordinator_name
from raysink.driver.placement import Placement
from raysink.driver.stream_controller import StreamController
from raysink.driver.stream_feed import StreamFeed
from raysink.errors import (
    ConfigError,
    EpochFailedError,
    RescaleRefusedError,
    RuntimeUnavailableError,
)
from raysink.progress import Progress
from raysink.protocol.barrier import BarrierFlags, CheckpointBarrier
from raysink.protocol.vnodes import Bitmap, assign
from raysink.reports import EpochReport, RuntimeStatus, SinkStatus
from raysink.sinks.base import Sink
from raysink.writer.writer import WriterConfig

if TYPE_CHECKING:
    from raysink.coordinator.metastore.base import MetaStore
    from raysink.driver.datasink import EpochDatasink

__all__ = ["EpochReport", "RuntimeStatus", "SinkRuntime", "SinkStatus"]

log = logging.getLogger(__name__)

_START_SECONDS = 300.0
"""How long ``start()`` waits at least for the actors to start and recover."""


@dataclass(frozen=True, kw_only=True, slots=True)
class _Options:
    writers: int
    key: tuple[str, ...] | None
    metastore: str | None
    flush_interval: float
    max_pending_epochs: int
    commit_timeout: float
    max_attempts: int
    retry_cap: float
    credits: int
    epoch_offset: int | None
    actor_options: dict[str, Any]
    max_batch_bytes: int | None
    max_buffer_bytes: int | None
    warn_interval: float
    feed_timeout: float
    checkpoint_interval: float
    add_sinks: tuple[str, ...]
    drop_sinks: tuple[str, ...]
    placement: Placement
    ping_timeout: float
    lease_timeout: float

    def validate(self, runtime: str) -> None:
        checks: list[tuple[bool, str]] = [
            (self.writers >= 1, f"writers must be at least 1; got {self.writers!r}"),
            (self.flush_interval > 0, f"flush_interval must be > 0; got {self.flush_interval!r}"),
            (self.max_pending_epochs >= 1,
             f"max_pending_epochs must be at least 1; got {self.max_pending_epochs!r}"),
            (self.commit_timeout > 0, f"commit_timeout must be > 0; got {self.commit_timeout!r}"),
            (self.max_attempts >= 1, f"max_attempts must be at least 1; got {self.max_attempts!r}"),
            (self.retry_cap > 0, f"retry_cap must be > 0; got {self.retry_cap!r}"),
            (self.credits >= 1, f"credits must be at least 1; got {self.credits!r}"),
            (self.max_batch_bytes is None or self.max_batch_bytes >= 1,
             f"max_batch_bytes must be at least 1 (or None: no limit); got "
             f"{self.max_batch_bytes!r}"),
            (self.max_buffer_bytes is None or self.max_buffer_bytes >= 1,
             f"max_buffer_bytes must be at least 1 (or None: no limit); got "
             f"{self.max_buffer_bytes!r}"),
            (self.warn_interval > 0, f"warn_interval must be > 0; got {self.warn_interval!r}"),
            (self.feed_timeout > 0, f"feed_timeout must be > 0; got {self.feed_timeout!r}"),
            (self.checkpoint_interval > 0,
             f"checkpoint_interval must be > 0; got {self.checkpoint_interval!r}"),
            (self.ping_timeout > 0, f"ping_timeout must be > 0; got {self.ping_timeout!r}"),
            (self.lease_timeout > 0, f"lease_timeout must be > 0; got {self.lease_timeout!r}"),
            (isinstance(self.placement, Placement),
             f"placement must be a raysink.Placement; got {type(self.placement).__name__}"),
            (self.epoch_offset is None or self.epoch_offset >= 0,
             f"epoch_offset must be >= 0; got {self.epoch_offset!r}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message, runtime=runtime)


class SinkRuntime:
    """Exactly-once writes of Arrow data and Spark DataFrames into one or more sinks.

    A single sink is named ``"main"``. Every epoch decision is shared by all sinks: an
    epoch is visible in all of them or (eventually, after roll-forward) in none.

    Options beyond DESIGN's list: ``max_batch_bytes`` bounds one data message a writer
    takes (local tables are cut to fit; a larger Spark partition or object ref is a
    ``SchemaMismatchError`` and nothing of the epoch is written; ``None``: no limit);
    ``max_buffer_bytes`` bounds each writer's reorder buffer (messages that arrived
    before their turn; one that does not fit is sent again later); ``warn_interval``:
    a sink commit or flush still running logs a warning every this many seconds;
    ``feed_timeout``: a producer's feed (``open_epoch``) silent this long without closing
    is lost, and its epoch's attempt given up; ``checkpoint_interval``: seconds between
    the epochs of a continuous stream (``stream``);
    ``add_sinks``/``drop_sinks`` change the sink set on
    purpose (a dropped sink shows as ``dropped``); ``progress`` draws rows, epochs and rate
    on stderr while writing (``None``: only on a terminal; ``False``: never; or a
    ``raysink.progress.Progress`` of your own).

    On a cluster: ``placement`` (a ``raysink.Placement``) narrows the nodes writers may use
    (labels, custom resources) and where the coordinator runs (by default writers spread
    over the alive nodes, the coordinator on the driver's node; see
    ``raysink.driver.placement``); an actor that does not answer a ping within
    ``ping_timeout`` seconds while an epoch waits on it (its node lost, say) is replaced
    and the epoch fed again, without waiting for Ray's failure detector.
    ``rescale(writers=n)`` changes the writers between epochs.

    ``epoch_offset``: for a Structured Streaming query, epoch = ``batch_id + 1 + offset``
    (re-binding the runtime to a new query); for the runtime's own numbering, implicit
    epochs are numbered above it. Opened with a meta store that knows nothing of epochs
    the targets already hold (a fresh default store when a job starts in another
    directory), an implicit epoch is a ``ConfigError`` until ``metastore=`` names the
    original store or ``epoch_offset=`` is at least the targets' last epoch.

    One driver at a time: ``start()`` takes the runtime's lease in the meta store (see
    ``raysink.driver.lease``) and ``close()`` gives it up; while another live driver holds it,
    ``start()`` raises ``RuntimeInUseError`` naming that driver and until when. A killed
    driver's lease is taken over at once on its own machine, else when it expires:
    ``lease_timeout`` seconds after its last renewal (a start waits that long for it).

    Every failure of a public method is a ``RaySinkError``; a Ray error behind it is its
    cause. Actors that are restarting are waited for, up to ``commit_timeout``.
    """

    @rejects_unknown_options("SinkRuntime")
    def __init__(
        self,
        name: str,
        sinks: Sink | Mapping[str, Sink],
        *,
        writers: int = 2,
        key: Sequence[str] | None = None,
        metastore: str | None = None,
        flush_interval: float = 5.0,
        max_pending_epochs: int = 2,
        commit_timeout: float = 60.0,
        max_attempts: int = 3,
        retry_cap: float = 60.0,
        credits: int = 4,
        epoch_offset: int | None = None,
        actor_options: Mapping[str, Any] | None = None,
        max_batch_bytes: int | None = routing.DEFAULT_MAX_BATCH_BYTES,
        max_buffer_bytes: int | None = routing.DEFAULT_MAX_BUFFER_BYTES,
        warn_interval: float = 5.0,
        feed_timeout: float = 30.0,
        checkpoint_interval: float = 10.0,
        add_sinks: Sequence[str] = (),
        drop_sinks: Sequence[str] = (),
        progress: Progress | bool | None = None,
        placement: Placement | None = None,
        ping_timeout: float = PING_TIMEOUT,
        lease_timeout: float = LEASE_SECONDS,
    ) -> None:
        _check_name(name)
        self.name = name
        self._sinks = _bind_sinks(name, sinks)
        self._options = _Options(
            writers=writers, key=tuple(key) if key else None, metastore=metastore,
            flush_interval=flush_interval, max_pending_epochs=max_pending_epochs,
            commit_timeout=commit_timeout, max_attempts=max_attempts, retry_cap=retry_cap,
            credits=credits, epoch_offset=epoch_offset,
            actor_options=dict(actor_options or {}), max_batch_bytes=max_batch_bytes,
            max_buffer_bytes=max_buffer_bytes, warn_interval=warn_interval,
            feed_timeout=feed_timeout, checkpoint_interval=checkpoint_interval,
            add_sinks=tuple(add_sinks), drop_sinks=tuple(drop_sinks),
            placement=Placement() if placement is None else placement,
            ping_timeout=ping_timeout, lease_timeout=lease_timeout)
        self._options.validate(name)
        self._key = self._routing_key()
        self._bitmaps: list[Bitmap] = assign(writers)
        self._actors: ActorSet | None = None
        self._lease: LeaseKeeper | None = None
        self._bound: tuple[str, int] | None = None
        self._progress = _progress(name, progress)
        self._feeds = 0  # epochs planned: rotates the first writer of round-robin feeds
        self._handle: EpochHandle | None = None  # the epoch open for producers, if any
        self._stream: StreamController | None = None  # the continuous stream, once begun
        self._epochs = EpochDriver(
            name, EpochSettings(max_attempts=max_attempts, commit_timeout=commit_timeout,
                                credits=credits),
            sinks=len(self._sinks), progress=self._progress)

    # ------------------------------------------------------------------ set-up

    def _routing_key(self) -> tuple[str, ...] | None:
        """The routing key: given, or the sinks' upsert key; within every upsert key."""
        key = self._options.key
        upsert_keys = {n: tuple(s.key) for n, s in self._sinks.items() if s.key}
        if key is None and upsert_keys:
            key = next(iter(upsert_keys.values()))
        for sink, upsert in upsert_keys.items():
            if key is not None and not set(key) <= set(upsert):
                raise ConfigError(
                    f"routing key {list(key)} is not within the upsert key {list(upsert)} of "
                    f"sink {sink!r}: all rows of a key must reach one writer. Route by a "
                    "subset of the upsert key", runtime=self.name, sink=sink)
        return key

    @typed_errors(RuntimeUnavailableError, "starting the runtime")
    def start(self) -> SinkRuntime:
        """Validate the sinks, start the coordinator (which recovers) and the writers."""
        import ray

        if self._actors is not None:
            return self
        if not ray.is_initialized():
            ray.init(namespace="raysink")
        lease = LeaseKeeper(self._check_metastore(), self.name, self._options.lease_timeout)
        actors: ActorSet | None = None
        try:
            lease.acquire()  # before anything starts: one driver at a time
            for sink in self._sinks.values():
                sink.validate()
            actors = self._actor_set(lease.holder)
            actors.start(timeout=max(self._options.commit_timeout, _START_SECONDS))
            # wait for recovery (open attempts swept, markers checked against the meta
            # store): a deleted target or marker is an error of start() itself.
            # ``epoch_source`` is the cheapest call that waits for it.
            self._ask(actors, "waiting for recovery", actors.coordinator_call("epoch_source"),
                      timeout=max(self._options.commit_timeout, _START_SECONDS))
        except BaseException:
            if actors is not None:
                actors.stop()
            lease.close()
            raise
        self._actors, self._lease = actors, lease
        return self

    def _metastore_url(self) -> str:
        """The meta store's URL, the default resolved here in the driver's directory (the
        actors may run elsewhere)."""
        from raysink.coordinator.metastore import default_url

        return self._options.metastore or default_url(self.name)

    def _check_metastore(self) -> MetaStore:
        """Reachable and writable, and the sink set is what it was (or changed on purpose):
        refused here, in the driver, before any actor starts. Returns the store, open."""
        from raysink.coordinator.metastore import check_sink_set, open_metastore

        store = open_metastore(self._metastore_url(), self.name)
        try:
            record = store.load(self.name)
            if record is not None:
                check_sink_set(self.name, record.sinks,
                               {n: s.kind for n, s in self._sinks.items()},
                               self._options.add_sinks, self._options.drop_sinks)
        except BaseException:
            store.close()
            raise
        return store

    def _actor_set(self, holder: str) -> ActorSet:
        opts = self._options
        coordinator = CoordinatorConfig(
            runtime=self.name, metastore=self._metastore_url(),
            sinks=self._sinks, writers=opts.writers,
            max_pending_epochs=opts.max_pending_epochs, retry_cap=opts.retry_cap,
            add_sinks=opts.add_sinks, drop_sinks=opts.drop_sinks,
            epoch_offset=opts.epoch_offset, warn_after=opts.warn_interval,
            lease_holder=holder)
        return ActorSet(coordinator_config=coordinator,
                        writer_configs=self._writer_configs(opts.writers),
                        options=opts.actor_options, max_pending_calls=max(64, opts.credits * 8),
                        placement=opts.placement, ping_timeout=opts.ping_timeout)

    def _writer_configs(self, writers: int) -> dict[str, list[WriterConfig]]:
        opts = self._options
        return {
            sink_name: [WriterConfig(runtime=self.name, sink_name=sink_name, sink=sink,
                                     writer_id=i, coordinator=coordinator_name(self.name),
                                     flush_interval=opts.flush_interval,
                                     max_batch_bytes=opts.max_batch_bytes,
                                     max_buffer_bytes=opts.max_buffer_bytes,
                                     warn_interval=opts.warn_interval)
                        for i in range(writers)]
            for sink_name, sink in self._sinks.items()}

    def __enter__(self) -> SinkRuntime:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Drain and end the runtime; it may be started again.

        Outstanding epochs finish, or stay durably decided (up to ``commit_timeout``);
        each writer gets the DRAIN barrier: it drops what an undecided attempt staged and
        closes its sink writer (files and connections closed); the coordinator pauses the
        sinks and closes its connections and the meta store; then the actors end and
        their names are free. A step that fails is logged and the rest still runs."""
        actors = self._actors
        if actors is None:
            return
        steps = (("draining the stream", self._drain_stream),
                 ("finishing outstanding epochs", self._drain_outstanding),
                 ("draining the writers", self._drain_writers),
                 ("closing the coordinator", self._close_coordinator))
        try:
            for what, step in steps:
                try:
                    step(actors)
                except Exception as exc:
                    log.warning("%s: close: %s failed: %s", self.name, what, short(exc))
        finally:
            actors.stop()
            self._actors = None
            if self._lease is not None:
                self._lease.close()
                self._lease = None
            if self._progress is not None:
                self._progress.close()

    def _drain_stream(self, actors: ActorSet) -> None:
        """DRAIN to the stream's producers: they close their last epoch; it commits."""
        stream, self._stream = self._stream, None
        if stream is not None:
            stream.drain()

    def _drain_outstanding(self, actors: ActorSet) -> None:
        pending = self._ask(actors, "status", actors.coordinator_call("status")).pending_epochs
        if pending:
            self._ask(actors, "waiting for outstanding epochs", actors.coordinator_call(
                "wait_committed", max(pending), self._options.commit_timeout))

    def _drain_writers(self, actors: ActorSet) -> None:
        """The DRAIN barrier to every writer, at once; each answers once closed."""
        barrier = CheckpointBarrier(self._epochs.next_checkpoint(), 0, BarrierFlags.DRAIN)
        reports = get([h.drain.remote(barrier) for h in actors.all_writers()],
                      timeout=self._options.commit_timeout)
        swept = [(r.sink, r.writer, r.swept) for r in reports if r.swept is not None]
        if swept:
            log.info("%s: drained; undecided attempts dropped: %s", self.name, swept)

    def _close_coordinator(self, actors: ActorSet) -> None:
        get(actors.coordinator.close.remote(), timeout=30)

    # ------------------------------------------------------------------ writes

    @typed_errors(EpochFailedError, "write_arrow")
    def write_arrow(self, data: Any, *, epoch: int | None = None) -> EpochReport:
        """Write Arrow data (Table, RecordBatch, ObjectRef, or a list of them) as one epoch."""
        actors = self._require_started()
        self._check_no_open_handle()
        plan = routing.plan_arrow(data, writers=self._options.writers, key=self._key,
                                bitmaps=self._bitmaps,
                                max_batch_bytes=self._options.max_batch_bytes,
                                first_writer=self._next_first_writer(),
                                evolve=self._evolving)
        return self._epochs.run(actors, epoch, plan)

    @typed_errors(EpochFailedError, "open_epoch")
    def open_epoch(self, epoch: int | None = None) -> EpochHandle:
        """Open an epoch for producers anywhere in the cluster: ``ep.feed()`` hands out
        picklable feeds for Ray tasks and actors, ``ep.commit()`` waits for them to close
        and commits, ``ep.abort()`` gives the epoch up (see ``raysink.driver.handle``). An epoch
        the targets hold already opens *skipped*: feeds write nothing and the commit
        reports it skipped. One epoch is open for producers at a time."""
        actors = self._require_started()
        self._check_no_open_handle()
        opened = self._epochs.open(actors, epoch)
        handle = EpochHandle(self._epochs, actors, self._route(actors), opened,
                             feed_timeout=self._options.feed_timeout,
                             commit_timeout=self._options.commit_timeout,
                             on_end=self._handle_ended)
        self._handle = handle
        return handle

    @typed_errors(EpochFailedError, "datasink")
    def datasink(self, epoch: int | None = None) -> EpochDatasink:
        """A Ray Data datasink writing a whole Dataset as one epoch, exactly once:
        ``ds.write_datasink(rt.datasink(epoch=N))``; its ``report`` says what happened.
        Each write task is a producer with its own feed (see ``raysink.driver.datasink``); the
        same job run again with the same epoch writes nothing and reports it skipped."""
        from raysink.driver.datasink import EpochDatasink

        handle = self.open_epoch(epoch)
        return EpochDatasink(handle, self._route(self._require_started()))

    def _route(self, actors: ActorSet) -> FeedRoute:
        return FeedRoute(runtime=self.name, writers=actors.writers,
                         coordinator=actors.coordinator, key=self._key,
                         bitmaps=tuple(self._bitmaps),
                         max_batch_bytes=self._options.max_batch_bytes,
                         credits=self._options.credits, evolve=self._evolving)

    @property
    def _evolving(self) -> bool:
        """Whether every sink takes ``schema_evolution="add_columns"``: the tables of one
        epoch (or of one feed) may then differ in schema where they have a union."""
        return all(s.schema_evolution == "add_columns" for s in self._sinks.values())

    def _handle_ended(self, handle: EpochHandle) -> None:
        if self._handle is handle:
            self._handle = None

    @typed_errors(EpochFailedError, "stream")
    def stream(self, *, poll_interval: float = 0.5) -> StreamFeed:
        """A feed of the runtime's continuous stream, for one long-lived producer (a Ray
        actor reading a queue, say): ``feed.write(...)`` forever. The first call begins
        the stream: an epoch every ``checkpoint_interval`` seconds, each committed on its
        own; ``close()`` drains it. See ``raysink.driver.stream_feed`` for the producer's contract
        (``StreamRewind``: replay from the last committed epoch). ``poll_interval``: how
        often the producer asks for its barrier (also its heartbeat); an epoch is at
        least that long."""
        actors = self._require_started()
        if self._stream is None:
            self._check_no_open_handle()
            stream = StreamController(self._epochs, actors,
                                      interval=self._options.checkpoint_interval,
                                      feed_timeout=self._options.feed_timeout,
                                      commit_timeout=self._options.commit_timeout)
            stream.start()
            self._stream = stream
        if poll_interval <= 0:
            raise ConfigError(f"poll_interval must be > 0; got {poll_interval!r}",
                              runtime=self.name)
        return StreamFeed(self._route(actors), self._stream.next_feed_id(), poll_interval,
                          route_number=self._stream.route,
                          timeout=max(_START_SECONDS, 2 * self._options.commit_timeout
                                      + self._options.feed_timeout))

    def _check_no_open_handle(self) -> None:
        if self._stream is not None:
            raise ConfigError("the runtime runs a continuous stream (rt.stream()); its "
                              "epochs come from the stream until close()", runtime=self.name)
        if self._handle is not None:
            raise ConfigError(f"{self._handle!r} is still open; commit or abort it before "
                              "writing another epoch", runtime=self.name)

    @typed_errors(EpochFailedError, "write(df)")
    def write(self, df: Any, *, epoch: int | None = None) -> EpochReport:
        """Write a Spark DataFrame as one epoch (see ``raysink.spark``): checked first,
        then cached in Spark until the epoch is visible; writers pull its partitions from
        the RayDP executors as they are ready. An explicit epoch the targets hold already
        is reported skipped before Spark computes anything."""
        from raysink.spark.write import check_dataframe, open_partitions

        self._require_started()
        check_dataframe(self.name, df)
        if epoch is not None and self._committed_through() >= epoch:
            return self.write_arrow([], epoch=epoch)
        with open_partitions(df) as parts:
            if parts.num_partitions == 0:
                return self.write_arrow(parts.schema.empty_table(), epoch=epoch)
            return self._write_refs(parts.pulls(runtime=self.name), epoch)

    def _write_refs(self, refs: Iterable[Any], epoch: int | None = None) -> EpochReport:
        """One epoch from object refs or pulls, each handed to a writer as it comes."""
        actors = self._require_started()
        self._check_no_open_handle()
        plan = routing.plan_refs(refs, writers=self._options.writers, key=self._key,
                               bitmaps=self._bitmaps, first_writer=self._next_first_writer())
        return self._epochs.run(actors, epoch, plan)

    @typed_errors(EpochFailedError, "foreach_batch")
    def foreach_batch(self, df: Any, batch_id: int) -> EpochReport:
        """For ``writeStream.foreachBatch``: micro-batch ``batch_id`` of the query is epoch
        ``batch_id + 1 + offset`` (the runtime is bound to the query, see ``epoch_offset``).
        Returns the epoch's report (Spark ignores it)."""
        from raysink.spark.write import streaming_query_id

        offset = self._bind_source(streaming_query_id(self.name, df))
        report = self.write(df, epoch=int(batch_id) + 1 + offset)
        log.info("%s: micro-batch %s -> epoch %s (%s rows, %s)", self.name, batch_id,
                 report.epoch, report.rows,
                 "skipped, already committed" if report.skipped else "committed")
        return report

    def _next_first_writer(self) -> int:
        self._feeds += 1
        return (self._feeds - 1) % self._options.writers

    def _bind_source(self, query_id: str) -> int:
        """Bind the runtime to a streaming query; returns the epoch offset of its batches."""
        if self._bound is not None and self._bound[0] == query_id:
            return self._bound[1]
        actors = self._require_started()
        current = self._ask(actors, "epoch source", actors.coordinator_call("epoch_source"))
        last = self._ask(actors, "status", actors.coordinator_call("status")).last_committed_epoch
        offset = source_offset(self.name, current, query_id, self._options.epoch_offset, last)
        source = {"kind": "query", "id": query_id, "offset": offset}
        if source != current:
            # the targets may hold epochs this meta store does not know (a fresh store):
            # the query's batches would be skipped as committed
            self._ask(actors, "checking the targets' markers",
                      actors.coordinator_call("check_alignment", "query",
                                              self._options.epoch_offset))
            self._ask(actors, "binding the epoch source",
                      actors.coordinator_call("bind_source", source))
            log.info("%s: bound to streaming query %s (epoch = batch_id + 1 + %s)", self.name,
                     query_id, offset)
        self._bound = (query_id, offset)
        return offset

    # ------------------------------------------------------------------ rescale

    @typed_errors(RuntimeUnavailableError, "rescale")
    def rescale(self, *, writers: int) -> None:
        """Change the number of writers per sink between epochs, without closing the
        runtime (nodes joined, say).

        New writers start first (placed like the others) and must answer; then the
        coordinator takes the new layout (``set_layout``: each writer's vnode bitmap by
        ``vnodes.assign``), effective from the next epoch, and this driver routes by it
        from then on; writers no longer needed get the DRAIN barrier and end. A key is
        routed by its vnode, so with a routing key all rows of a key still reach one
        writer in every epoch (its vnode's writer in the layout of that epoch). Refused
        with ``RescaleRefusedError``, changing nothing, while an epoch is being written
        or recovered (or is still open at the coordinator), and while a continuous
        stream runs: its producers write at every moment, by the layout they joined with
        (close the runtime, open it with ``writers=N``, start the stream again); an actor
        that stopped answering is replaced first."""
        if not isinstance(writers, int) or writers < 1:
            raise ConfigError(f"writers must be at least 1; got {writers!r}", runtime=self.name)
        actors = self._require_started()
        if writers == self._options.writers:
            return
        if self._handle is not None:
            raise RescaleRefusedError(
                f"{self._handle!r} is open for producers: commit or abort it, then rescale",
                runtime=self.name, epoch=self._handle.epoch)
        if self._stream is not None:
            raise RescaleRefusedError(
                "a continuous stream runs (rt.stream()): its producers write an epoch at "
                "every moment, routed by the layout they joined with. To rescale, close "
                "the runtime (rt.close() drains the stream), open it again with "
                f"writers={writers} and start the stream again (producers resume from "
                "feed.committed())", runtime=self.name)
        with self._epochs.exclusive():
            actors.heal()
            removed = actors.resize(self._writer_configs(writers), commit=lambda: self._ask(
                actors, "changing the writer layout",
                actors.coordinator_call("set_layout", writers)))
            self._options = dataclasses.replace(self._options, writers=writers)
            self._bitmaps = assign(writers)
            self._retire_writers(actors, removed)
        log.info("%s: rescaled to %s writers per sink", self.name, writers)

    def _retire_writers(self, actors: ActorSet, handles: list[Any]) -> None:
        """The DRAIN barrier to writers a rescale removed (each closes its sink writer),
        then end them. They hold nothing undecided: no epoch is in flight."""
        if not handles:
            return
        barrier = CheckpointBarrier(self._epochs.next_checkpoint(), 0, BarrierFlags.DRAIN)
        try:
            get([h.drain.remote(barrier) for h in handles], timeout=self._options.commit_timeout)
        except Exception as exc:  # ending them drops nothing decided
            log.warning("%s: rescale: draining removed writers failed: %s", self.name,
                        short(exc))
        actors.end(handles)

    # ------------------------------------------------------------------ status

    @typed_errors(RuntimeUnavailableError, "status")
    def status(self) -> RuntimeStatus:
        actors = self._require_started()
        status: RuntimeStatus = self._ask(actors, "status", actors.coordinator_call("status"))
        return status

    def _committed_through(self) -> int:
        """The highest epoch every sink holds, by the meta store or by the targets'
        markers (0 when none): an explicit epoch at or below it is skipped."""
        actors = self._require_started()
        through = self._ask(actors, "committed epochs",
                            actors.coordinator_call("committed_through"))
        return 0 if through is None else int(through)

    def _require_started(self) -> ActorSet:
        if self._actors is None:
            raise ConfigError("the runtime is not started; call start() or use it as a "
                              "context manager", runtime=self.name)
        if self._lease is not None and self._lease.lost is not None:
            raise self._lease.lost
        return self._actors

    def _ask(self, actors: ActorSet, what: str, make: Callable[[], Any],
             timeout: float | None = None) -> Any:
        """An idempotent call to the runtime's actors, waiting while they restart (up to
        ``commit_timeout``) and re-creating one that is gone."""
        return ask(make, what=what, runtime=self.name, heal=actors.heal,
                   timeout=self._options.commit_timeout if timeout is None else timeout)

    @property
    def sinks(self) -> dict[str, Sink]:
        return dict(self._sinks)

    @property
    def key(self) -> tuple[str, ...] | None:
        return self._key

    @property
    def writers(self) -> int:
        """Writer actors per sink."""
        return self._options.writers


def source_offset(runtime: str, current: Mapping[str, Any] | None, query_id: str,
                  epoch_offset: int | None, last_committed: int | None) -> int:
    """The epoch offset for batches of ``query_id``, or ``ConfigError`` when binding to it
    would silently skip data (a new checkpoint location restarts ``batch_id`` at 0)."""
    if current is not None and current.get("kind") == "query" and current.get("id") == query_id:
        bound = int(current.get("offset", 0))
        if epoch_offset is not None and epoch_offset != bound:
            raise ConfigError(
                f"the runtime is bound to query {query_id} with epoch_offset={bound}; got "
                f"epoch_offset={epoch_offset}. Drop the option or use the bound value",
                runtime=runtime)
        return bound
    if current is None and last_committed is None:
        return epoch_offset or 0
    if epoch_offset is None:
        what = (f"query {current.get('id')}" if current and current.get("kind") == "query"
                else "its own epoch numbering")
        raise ConfigError(
            f"this runtime is bound to {what} (last committed epoch {last_committed}) and is "
            f"now fed by query {query_id}, whose batches would be skipped as already "
            f"committed. Re-bind with SinkRuntime(..., epoch_offset={last_committed or 0}) "
            "or use another runtime name", runtime=runtime)
    if last_committed is not None and epoch_offset < last_committed:
        raise ConfigError(
            f"epoch_offset={epoch_offset} is below the last committed epoch {last_committed}: "
            f"the new query's first batches would be skipped. Use at least {last_committed}",
            runtime=runtime)
    return epoch_offset


def _progress(name: str, choice: Progress | bool | None) -> Progress | None:
    """A progress line on stderr: drawn only on a terminal unless forced with ``True``."""
    if choice is False:
        return None
    if isinstance(choice, Progress):
        return choice
    return Progress(label=name, stream=sys.stderr, enabled=True if choice else None)


def _check_name(name: str) -> None:
    if not name or not all(c.isalnum() or c in "-_" for c in name):
        raise ConfigError(f"runtime names use letters, digits, '-' and '_'; got {name!r}")


def _bind_sinks(runtime: str, sinks: Sink | Mapping[str, Sink]) -> dict[str, Sink]:
    named = {"main": sinks} if isinstance(sinks, Sink) else dict(sinks)
    if not named:
        raise ConfigError("give at least one sink", runtime=runtime)
    bound: dict[str, Sink] = {}
    for name, sink in named.items():
        if not isinstance(sink, Sink):
            raise ConfigError(f"sink {name!r} is not a raysink Sink; got {type(sink).__name__}",
                              runtime=runtime)
        _check_name(name)
        bound[name] = sink.bind(runtime, name)
    return bound
