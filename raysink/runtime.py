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
up to ``max_attempts`` attempts. The machinery is in ``raysink.driver`` (the map of
packages is in ``raysink``'s docstring); this module only ties it together.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from raysink._options import rejects_unknown_options
from raysink.driver import routing
from raysink.driver.calls import ask, typed_errors
from raysink.driver.closing import close_actors, end_actors
from raysink.driver.epoch import EpochDriver, EpochSettings
from raysink.driver.handle import EpochHandle
from raysink.driver.lease import LEASE_SECONDS, LeaseKeeper
from raysink.driver.lifecycle import PING_TIMEOUT, ActorSet
from raysink.driver.placement import Placement
from raysink.driver.processes import runtime_processes
from raysink.driver.rescale import check_writers, refuse_rescale, resize_writers
from raysink.driver.runtime_options import (
    Router,
    RuntimeOptions,
    bind_sinks,
    check_name,
    progress_line,
)
from raysink.driver.starting import start_actors
from raysink.driver.stream_controller import StreamController
from raysink.driver.stream_feed import StreamFeed
from raysink.errors import ConfigError, EpochFailedError, RaySinkError, RuntimeUnavailableError
from raysink.progress import Progress
from raysink.protocol.clients import Call
from raysink.reports import ActorProcess, EpochReport, RuntimeStatus, SinkStatus
from raysink.sinks.base import Sink
from raysink.spark.binding import QueryBinding

if TYPE_CHECKING:
    from raysink.driver.datasink import EpochDatasink
    from raysink.sinks._maintenance import MaintenanceReport

__all__ = ["ActorProcess", "EpochReport", "RuntimeOptions", "RuntimeStatus", "SinkRuntime",
           "SinkStatus"]

R = TypeVar("R")
log = logging.getLogger(__name__)

QUERY_SECONDS = 30.0
"""The least a query of the runtime's actors (``status()``, the committed epochs, the
close's look at outstanding epochs) waits for an answer, whatever ``commit_timeout``."""


class SinkRuntime:
    """Exactly-once writes of Arrow data and Spark DataFrames into one or more sinks.

    A single sink is named ``"main"``. Every epoch decision is shared by all sinks: an
    epoch is visible in all of them or (eventually, after roll-forward) in none.

    The options are ``RuntimeOptions``'s (``rt.options``); ``progress`` draws rows, epochs
    and rate on stderr while writing (``None``: only on a terminal; ``False``: never; or
    a ``raysink.progress.Progress`` of your own). ``rescale(writers=n)`` changes the
    writers between epochs.

    ``epoch_offset``: for a Structured Streaming query, epoch = ``batch_id + 1 + offset``
    (re-binding the runtime to a new query); for the runtime's own numbering, implicit
    epochs are numbered above it. Opened with a meta store that knows nothing of epochs
    the targets already hold (a fresh default store when a job starts in another
    directory), an implicit epoch is a ``ConfigError`` until ``metastore=`` names the
    original store or ``epoch_offset=`` is at least the targets' last epoch.

    One driver at a time: ``start()`` takes the runtime's lease in the meta store (see
    ``raysink.driver.lease``) and ``close()`` gives it up; while another live driver holds
    it, ``start()`` raises ``RuntimeInUseError`` naming that driver and until when.

    Every failure of a public method is a ``RaySinkError``; a Ray error behind it is its
    cause. Actors that are restarting are waited for, up to ``commit_timeout`` (a query
    such as ``status()`` at least ``QUERY_SECONDS``, 30 s).
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
        check_name(name)
        self.name = name
        self._sinks = bind_sinks(name, sinks)
        self._options = RuntimeOptions(
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
        self._router = Router.of(name, self._options, self._sinks)
        self._actors: ActorSet | None = None
        self._lease: LeaseKeeper | None = None
        self._binding = QueryBinding(runtime=name, epoch_offset=epoch_offset)
        self._progress = progress_line(name, progress)
        self._handle: EpochHandle | None = None  # the epoch open for producers, if any
        self._stream: StreamController | None = None  # the continuous stream, once begun
        self._epochs = EpochDriver(
            name, EpochSettings(max_attempts=max_attempts, commit_timeout=commit_timeout,
                                credits=credits),
            sinks=len(self._sinks), progress=self._progress)

    # ------------------------------------------------------------------ set-up

    @typed_errors(RuntimeUnavailableError, "starting the runtime")
    def start(self) -> SinkRuntime:
        """Validate the sinks, start the coordinator (which recovers) and the writers (see
        ``raysink.driver.starting``)."""
        if self._actors is None:
            self._actors, self._lease = start_actors(self.name, self._sinks, self._options,
                                                     self.metastore_url)
        return self

    @property
    def metastore_url(self) -> str:
        """The meta store's URL, the default resolved here in the driver's directory (the
        actors may run elsewhere)."""
        from raysink.coordinator.metastore import default_url

        return self._options.metastore or default_url(self.name)

    def __enter__(self) -> SinkRuntime:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 *_: object) -> None:
        """Close; when the block raised, a failure of the close is logged and added to
        that error as a note instead (the block's error is the one to see first)."""
        if error is None:
            self.close()
            return
        try:
            self.close()
        except RaySinkError as exc:
            log.error("%s: close after %s failed: %s", self.name, kind.__name__ if kind
                      else "an error", exc)
            error.add_note(f"then rt.close() failed: {exc}")

    def close(self) -> None:
        """Drain and end the runtime; it may be started again.

        The stream's last epoch is drained and every decided epoch committed (up to
        ``commit_timeout``) before each writer gets the DRAIN barrier: it drops what an
        undecided attempt staged and closes its sink writer (files and connections
        closed); the coordinator pauses the sinks and closes its connections and the meta
        store; then the actors end and their names are free. Every step runs; then close
        raises when something decided may not be committed: ``EpochFailedError`` (the
        stream's last epoch could not be drained, or a stream producer whose rows a
        failed epoch dropped made no call since and did not replay within
        ``feed_timeout``: the error names its feed), ``RuntimeUnavailableError`` (the
        coordinator did not recover in time, naming why), ``SinkUnavailableError`` (a
        decided epoch is still uncommitted: the next start commits it). See
        ``raysink.driver.closing``."""
        actors = self._actors
        if actors is None:
            return
        stream, self._stream = self._stream, None
        try:
            close_actors(self.name, actors, self._epochs, stream,
                         timeout=self._options.commit_timeout, ask=self._ask_started)
        finally:
            self._actors, lease, self._lease = None, self._lease, None
            end_actors(actors, lease, self._progress)

    # ------------------------------------------------------------------ writes

    @typed_errors(EpochFailedError, "write_arrow")
    def write_arrow(self, data: Any, *, epoch: int | None = None) -> EpochReport:
        """Write Arrow data (Table, RecordBatch, ObjectRef, or a list of them) as one epoch."""
        actors = self._require_started()
        self._check_no_open_handle()
        return self._epochs.run(actors, epoch, self._router.plan_arrow(data))

    @typed_errors(EpochFailedError, "open_epoch")
    def open_epoch(self, epoch: int | None = None) -> EpochHandle:
        """Open an epoch for producers anywhere in the cluster: ``ep.feed()`` hands out
        picklable feeds for Ray tasks and actors, ``ep.commit()`` waits for them to close
        and commits, ``ep.abort()`` gives the epoch up (see ``raysink.driver.handle``). An
        epoch the targets hold already opens *skipped*: feeds write nothing and the commit
        reports it skipped. One epoch is open for producers at a time."""
        actors = self._require_started()
        self._check_no_open_handle()
        opened = self._epochs.open(actors, epoch)
        handle = EpochHandle(self._epochs, actors, self._router.feed_route(actors), opened,
                             feed_timeout=self._options.feed_timeout,
                             commit_timeout=self._options.commit_timeout,
                             on_end=self._handle_ended)
        self._handle = handle
        return handle

    @typed_errors(EpochFailedError, "datasink")
    def datasink(self, epoch: int | None = None) -> EpochDatasink:
        """A Ray Data datasink writing a whole Dataset as one epoch, exactly once:
        ``ds.write_datasink(rt.datasink(epoch=N))``; its ``report`` says what happened.
        Each write task is a producer with its own feed (see ``raysink.driver.datasink``);
        the same job run again with the same epoch writes nothing and reports it skipped."""
        from raysink.driver.datasink import EpochDatasink

        handle = self.open_epoch(epoch)
        return EpochDatasink(handle, self._router.feed_route(self._require_started()))

    def _handle_ended(self, handle: EpochHandle) -> None:
        if self._handle is handle:
            self._handle = None

    @typed_errors(EpochFailedError, "stream")
    def stream(self, *, poll_interval: float = 0.5) -> StreamFeed:
        """A feed of the runtime's continuous stream, for one long-lived producer (a Ray
        actor reading a queue, say): ``feed.write(...)`` forever. The first call begins
        the stream: an epoch every ``checkpoint_interval`` seconds, each committed on its
        own; ``close()`` drains it. See ``raysink.driver.stream_feed`` for the producer's
        contract (``StreamRewind``: replay from the last committed epoch).
        ``poll_interval``: how often the producer asks for its barrier (also its
        heartbeat); an epoch is at least that long."""
        actors = self._require_started()
        if self._stream is None:
            self._check_no_open_handle()
            self._stream = StreamController.begin(self._epochs, actors, self._options)
        if poll_interval <= 0:
            raise ConfigError(f"poll_interval must be > 0; got {poll_interval!r}",
                              runtime=self.name)
        return self._stream.new_feed(self._router.feed_route(actors), poll_interval)

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
        return self._epochs.run(actors, epoch, self._router.plan_refs(refs))

    @typed_errors(EpochFailedError, "foreach_batch")
    def foreach_batch(self, df: Any, batch_id: int) -> EpochReport:
        """For ``writeStream.foreachBatch``: micro-batch ``batch_id`` of the query is epoch
        ``batch_id + 1 + offset`` (the runtime is bound to the query, see ``epoch_offset``
        and ``raysink.spark.binding``). Returns the epoch's report (Spark ignores it)."""
        from raysink.spark.write import streaming_query_id

        offset = self._bind_source(streaming_query_id(self.name, df))
        return self._binding.written(batch_id, self.write(df, epoch=int(batch_id) + 1 + offset))

    def _bind_source(self, query_id: str) -> int:
        """Bind the runtime to a streaming query; returns the epoch offset of its batches."""
        actors = self._require_started()
        return self._binding.offset_for(query_id, actors.coordinator_client, self._ask_started)

    # ------------------------------------------------------------------ rescale

    @typed_errors(RuntimeUnavailableError, "rescale")
    def rescale(self, *, writers: int) -> None:
        """Change the number of writers per sink between epochs, without closing the
        runtime (nodes joined, say).

        New writers start first (placed like the others) and must answer; then the
        coordinator takes the new layout (each writer's vnode bitmap by
        ``vnodes.assign``), effective from the next epoch, and this driver routes by it
        from then on; writers no longer needed get the DRAIN barrier and end. A key is
        routed by its vnode, so with a routing key all rows of a key still reach one
        writer in every epoch. Refused with ``RescaleRefusedError``, changing nothing,
        while an epoch is being written or recovered (or is still open at the
        coordinator), and while a continuous stream runs (close the runtime, open it with
        ``writers=N``, start the stream again); an actor that stopped answering is
        replaced first."""
        check_writers(self.name, writers)
        actors = self._require_started()
        if writers == self._options.writers:
            return
        refuse_rescale(self.name, writers, self._handle, self._stream)
        with self._epochs.exclusive():
            self._options = resize_writers(self.name, actors, self._epochs, self._options,
                                           self._sinks, writers, self._ask_started)
            self._router.resize(writers)

    # ------------------------------------------------------------------ status

    @typed_errors(RuntimeUnavailableError, "status")
    def status(self) -> RuntimeStatus:
        """The coordinator's view: epochs committed, pending and open, each sink's state."""
        actors = self._require_started()
        return self._ask(actors, "status", actors.coordinator_client.status())

    @typed_errors(RuntimeUnavailableError, "maintain")
    def maintain(self, sink: str | None = None, *,
                 timeout: float = 600.0) -> list[MaintenanceReport]:
        """Run a full maintenance pass now (compaction, expiry, log cleanup, whatever the
        sink's thresholds say) on ``sink``, or on every sink whose maintenance is on; the
        report of each. The coordinator runs it between the sink's commits, as it runs
        the passes it starts by itself, so it never races one. ``MaintenanceError`` when
        a pass fails or does not end within ``timeout`` seconds."""
        actors = self._require_started()
        return ask(actors.coordinator_client.maintain(sink, timeout), what="maintain",
                   runtime=self.name, heal=actors.heal, timeout=timeout + QUERY_SECONDS)

    @typed_errors(RuntimeUnavailableError, "processes")
    def processes(self, *, timeout: float = 10.0) -> list[ActorProcess]:
        """What runs where: the coordinator, its standby (if any) and every writer, each
        with its Ray node and process id, a writer with its mailbox's state (see
        ``raysink.reports.ActorProcess``). All are asked at once; one that does not answer
        within ``timeout`` seconds (restarting, or its node lost) is listed without node
        and pid. Nothing is replaced: a view (``raysink status NAME --processes`` shows
        the same on any node of the cluster)."""
        return runtime_processes(self._require_started(), timeout)

    def _committed_through(self) -> int:
        """The highest epoch every sink holds, by the meta store or by the targets'
        markers (0 when none): an explicit epoch at or below it is skipped."""
        actors = self._require_started()
        through = self._ask(actors, "committed epochs",
                            actors.coordinator_client.committed_through())
        return 0 if through is None else int(through)

    def _require_started(self) -> ActorSet:
        if self._actors is None:
            raise ConfigError("the runtime is not started; call start() or use it as a "
                              "context manager", runtime=self.name)
        if self._lease is not None and self._lease.lost is not None:
            raise self._lease.lost
        return self._actors

    def _ask(self, actors: ActorSet, what: str, call: Call[R]) -> R:
        """An idempotent query of the runtime's actors, waiting while they restart (up to
        ``commit_timeout``, and at least ``QUERY_SECONDS``: a short ``commit_timeout``
        says how long a write waits for its commit, not that a query may fail while the
        coordinator restarts or a loaded machine answers slowly) and re-creating one
        that is gone."""
        return ask(call, what=what, runtime=self.name, heal=actors.heal,
                   timeout=max(self._options.commit_timeout, QUERY_SECONDS))

    def _ask_started(self, what: str, call: Call[R]) -> R:
        """``_ask`` of the runtime's current actors (it is started, or closing)."""
        if self._actors is None:
            raise ConfigError("the runtime is not started", runtime=self.name)
        return self._ask(self._actors, what, call)

    @property
    def options(self) -> RuntimeOptions:
        return self._options

    @property
    def sinks(self) -> dict[str, Sink]:
        return dict(self._sinks)

    @property
    def key(self) -> tuple[str, ...] | None:
        return self._router.key

    @property
    def writers(self) -> int:
        """Writer actors per sink."""
        return self._options.writers
