"""``ray.util.metrics`` of raysink's processes, tagged by runtime, sink and writer; best
effort.

Ray exports them on each node's metrics port as ``ray_raysink_<name>`` (counters end in
``_total``), with Ray's own labels (``SessionName``, ``NodeAddress``, ``WorkerId``, ...).
The catalogue (``METRICS``) names each one, its tags, and the process that records it;
the Grafana dashboard and the alert rules in ``raysink.dashboards`` chart only these.

=========================  =========  ====================  ====================================
metric                     kind       tags                  what (recorded by)
=========================  =========  ====================  ====================================
rows_written               counter    runtime sink writer   rows applied by writers (writer)
bytes_written              counter    runtime sink writer   Arrow bytes applied (writer)
mailbox_depth              gauge      runtime sink writer   early messages waiting (writer)
mailbox_bytes              gauge      runtime sink writer   bytes of early messages (writer)
mailbox_limit_bytes        gauge      runtime sink          ``max_buffer_bytes`` (writer)
backpressure_refusals      counter    runtime sink writer   writes refused, mailbox full (writer)
epoch_commit_seconds       histogram  runtime sink          one sink commit (coordinator)
commit_retries             counter    runtime sink          failed sink commits (coordinator)
rows_committed             counter    runtime sink          rows made visible (coordinator)
last_committed_epoch       gauge      runtime sink          (coordinator)
pending_epochs             gauge      runtime sink          decided, not yet committed
                                                            there (coordinator)
sink_state                 gauge      runtime sink state    1 for the sink's state, 0 for the
                                                            others (coordinator)
max_pending_epochs         gauge      runtime               the limit (coordinator)
backpressure_waits         counter    runtime               epoch opens that waited on
                                                            ``max_pending_epochs`` (coordinator)
actor_restarts             counter    runtime role          Ray restarted the actor (the actor)
actor_replacements         counter    runtime role          the driver replaced it (driver)
epoch_failures             counter    runtime               failed epoch attempts (driver)
stream_rewinds             counter    runtime               stream rewinds (driver)
maintenance_passes         counter    runtime sink          maintenance passes run (coordinator)
maintenance_failures       counter    runtime sink          failed passes, retried (coordinator)
maintenance_files_compacted counter   runtime sink          small files rewritten (coordinator)
maintenance_files_deleted  counter    runtime sink          files removed from storage
                                                            (coordinator)
maintenance_last_timestamp gauge      runtime sink          unix time the last pass ended
                                                            (coordinator)
table_data_files           gauge      runtime sink          live data files (coordinator)
table_data_bytes           gauge      runtime sink          their bytes (coordinator)
table_snapshots            gauge      runtime sink          retained snapshots or log versions
                                                            (coordinator)
table_metadata_bytes       gauge      runtime sink          metadata or log on disk (coordinator)
spark_partitions_pulled    counter    runtime               read from RayDP executors (writer)
spark_executor_fallbacks   counter    runtime               served by another executor than
                                                            Spark's choice (writer)
=========================  =========  ====================  ====================================

Counters are created at zero for every tag set a process knows at its start (a writer
its own, the coordinator each sink's), so a chart or an alert tells "none happened" from
"not exported". Gauges are set again every half report interval (``_GaugeBook``): Ray's
metrics agent drops a gauge value that was not set within two report intervals.

``rows_committed`` counts the rows of the epochs this coordinator decided; an epoch a
restarted coordinator recovers PENDING commits without adding its rows. A process where
metrics cannot be made records nothing and never fails.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
import warnings
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, get_args

from raysink.reports import SinkState

if TYPE_CHECKING:
    from raysink.coordinator.epochs import CommitOutcome
    from raysink.protocol.messages import CommitRequest
    from raysink.reports import RuntimeStatus, SinkStatus
    from raysink.sinks._maintenance import MaintenanceReport, TableStats

__all__ = ["METRICS", "SINK_STATES", "CoordinatorMetrics", "DriverMetrics", "Metric",
           "WriterMetrics", "spark_pulled"]

log = logging.getLogger(__name__)

Kind = Literal["counter", "gauge", "histogram"]
Role = Literal["coordinator", "writer"]
SINK_STATES: tuple[str, ...] = get_args(SinkState)
"""The values of ``sink_state``'s ``state`` tag, in the order the dashboard numbers them."""

COMMIT_BOUNDARIES = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_KEEP_DECIDED = 1024  # epochs whose rows per sink wait for their commits
_MAINTENANCE_COUNTERS = ("maintenance_passes", "maintenance_failures",
                         "maintenance_files_compacted", "maintenance_files_deleted")
_TABLE_GAUGES = ("maintenance_last_timestamp", "table_data_files", "table_data_bytes",
                 "table_snapshots", "table_metadata_bytes")


@dataclass(frozen=True, kw_only=True, slots=True)
class Metric:
    """One metric of the catalogue."""

    name: str
    kind: Kind
    tags: tuple[str, ...]
    help: str

    @property
    def series(self) -> str:
        """The name Prometheus shows (histograms add ``_bucket``, ``_sum``, ``_count``)."""
        return f"ray_raysink_{self.name}" + ("_total" if self.kind == "counter" else "")


_W = ("runtime", "sink", "writer")
_S = ("runtime", "sink")
_R = ("runtime",)
_A = ("runtime", "role")

METRICS: dict[str, Metric] = {m.name: m for m in (
    Metric(name="rows_written", kind="counter", tags=_W, help="rows applied by writers"),
    Metric(name="bytes_written", kind="counter", tags=_W,
           help="Arrow bytes applied by writers"),
    Metric(name="mailbox_depth", kind="gauge", tags=_W,
           help="early messages waiting in a writer's reorder buffer"),
    Metric(name="mailbox_bytes", kind="gauge", tags=_W,
           help="bytes of early messages waiting in a writer's reorder buffer"),
    Metric(name="mailbox_limit_bytes", kind="gauge", tags=_S,
           help="max_buffer_bytes: the bound of each writer's reorder buffer"),
    Metric(name="backpressure_refusals", kind="counter", tags=_W,
           help="writes a writer refused for now (its reorder buffer full)"),
    Metric(name="epoch_commit_seconds", kind="histogram", tags=_S,
           help="seconds one sink took to commit one epoch"),
    Metric(name="commit_retries", kind="counter", tags=_S,
           help="failed sink commits (retried with backoff)"),
    Metric(name="rows_committed", kind="counter", tags=_S,
           help="rows of the epochs a sink committed"),
    Metric(name="last_committed_epoch", kind="gauge", tags=_S,
           help="the last epoch a sink committed"),
    Metric(name="pending_epochs", kind="gauge", tags=_S,
           help="epochs decided but not yet committed by a sink"),
    Metric(name="sink_state", kind="gauge", tags=(*_S, "state"),
           help="1 for the sink's state, 0 for the others"),
    Metric(name="held_seconds", kind="gauge", tags=_S,
           help="how long a transaction left open on the target has held the sink's "
                "commits back (0: none)"),
    Metric(name="max_pending_epochs", kind="gauge", tags=_R,
           help="the runtime's max_pending_epochs"),
    Metric(name="backpressure_waits", kind="counter", tags=_R,
           help="epoch opens that waited on max_pending_epochs"),
    Metric(name="actor_restarts", kind="counter", tags=_A,
           help="actors Ray restarted after a crash"),
    Metric(name="actor_replacements", kind="counter", tags=_A,
           help="actors the driver replaced (dead, or on a lost node)"),
    Metric(name="epoch_failures", kind="counter", tags=_R,
           help="epoch attempts that failed (each rolled forward, fed again or given up)"),
    Metric(name="stream_rewinds", kind="counter", tags=_R,
           help="rewinds of the runtime's stream after a failed epoch"),
    Metric(name="maintenance_passes", kind="counter", tags=_S,
           help="table maintenance passes a sink ran"),
    Metric(name="maintenance_failures", kind="counter", tags=_S,
           help="maintenance passes that failed (retried with backoff)"),
    Metric(name="maintenance_files_compacted", kind="counter", tags=_S,
           help="small data files compaction rewrote into larger ones"),
    Metric(name="maintenance_files_deleted", kind="counter", tags=_S,
           help="files maintenance removed from storage (data, metadata, log)"),
    Metric(name="maintenance_last_timestamp", kind="gauge", tags=_S,
           help="unix time the sink's last maintenance pass ended"),
    Metric(name="table_data_files", kind="gauge", tags=_S,
           help="live data files in the sink's table"),
    Metric(name="table_data_bytes", kind="gauge", tags=_S,
           help="bytes of the live data files in the sink's table"),
    Metric(name="table_snapshots", kind="gauge", tags=_S,
           help="retained snapshots (Iceberg) or versions in the log (Delta)"),
    Metric(name="table_metadata_bytes", kind="gauge", tags=_S,
           help="bytes of the table's metadata or log on storage"),
    Metric(name="spark_partitions_pulled", kind="counter", tags=_R,
           help="Spark partitions read from RayDP executors"),
    Metric(name="spark_executor_fallbacks", kind="counter", tags=_R,
           help="Spark partitions served by another executor than Spark's choice"),
)}


def _make(name: str) -> Any:
    """The Ray metric ``name`` of the catalogue, or ``None`` where none can be made."""
    spec = METRICS[name]
    try:
        from ray.util import metrics

        name = f"raysink_{spec.name}"
        if spec.kind == "histogram":
            return metrics.Histogram(name, spec.help, boundaries=list(COMMIT_BOUNDARIES),
                                     tag_keys=spec.tags)
        kind = {"counter": metrics.Counter, "gauge": metrics.Gauge}[spec.kind]
        return kind(name, spec.help, tag_keys=spec.tags)
    except Exception as exc:  # metrics are best effort
        log.debug("metric %s unavailable: %s", name, exc)
        return None


def _inc(metric: Any, value: float, tags: Mapping[str, str]) -> None:
    if metric is not None and value:
        try:
            metric.inc(value, tags=dict(tags))
        except Exception as exc:
            log.debug("recording %s: %s", tags, exc)


def _zero(metric: Any, tags: Mapping[str, str]) -> None:
    """Create a counter's series at 0 (``Counter.inc`` refuses 0, so Ray's own record call
    is used)."""
    if metric is not None:
        try:
            metric._record(0, tags=dict(tags))
        except Exception as exc:
            log.debug("creating %s at zero: %s", tags, exc)


def _refresh_seconds() -> float:
    """Half of Ray's metrics report interval (10 s by default), at least 0.5 s."""
    try:
        import ray

        return max(float(ray._config.metrics_report_interval_ms()), 1000.0) / 2000.0
    except Exception:
        return 5.0


class _GaugeBook:
    """The gauge values this process set last, set again every ``_refresh_seconds()``.

    Ray's metrics agent forgets a gauge value that was not set again within two report
    intervals, so a gauge that changes now and then (a sink's state, its last committed
    epoch) would vanish from Prometheus while its actor lives. A daemon thread, started by
    the first value, sets them all again."""

    def __init__(self, *, refreshing: bool = True) -> None:
        self._values: dict[tuple[int, tuple[tuple[str, str], ...]],
                           tuple[Any, float, dict[str, str]]] = {}
        self._lock = threading.Lock()
        self._refreshing = refreshing
        self._thread: threading.Thread | None = None

    def set(self, gauge: Any, value: float, tags: Mapping[str, str]) -> None:
        """Set ``gauge`` now unless it holds ``value`` already (the refresh sets it again:
        a status snapshot sets every gauge of every sink, mostly unchanged)."""
        if gauge is None:
            return
        key = (id(gauge), tuple(sorted(tags.items())))
        with self._lock:
            known = self._values.get(key)
            if known is not None and known[1] == value:
                return
            self._values[key] = (gauge, value, dict(tags))
            if self._thread is None and self._refreshing:
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name="raysink-gauges")
                self._thread.start()
        _set(gauge, value, tags)

    def refresh(self) -> int:
        """Set every gauge again; returns how many values were set."""
        with self._lock:
            values = list(self._values.values())
        for gauge, value, tags in values:
            _set(gauge, value, tags)
        return len(values)

    def _run(self) -> None:
        period = _refresh_seconds()
        while True:
            time.sleep(period)
            self.refresh()


def _set(gauge: Any, value: float, tags: Mapping[str, str]) -> None:
    try:
        gauge.set(value, tags=dict(tags))
    except Exception as exc:
        log.debug("setting gauge %s: %s", tags, exc)


_GAUGES = _GaugeBook()


def _restarted() -> bool:
    """Whether this process is an actor Ray restarted (one call to Ray's control store);
    ``False`` outside an actor, and never starts Ray."""
    try:
        import ray

        if not ray.is_initialized():
            return False
        context = ray.get_runtime_context()
        if context.get_actor_id() is None:
            return False
        with warnings.catch_warnings():  # it reads a deprecated property itself
            warnings.simplefilter("ignore")
            return bool(context.was_current_actor_reconstructed)
    except Exception as exc:
        log.debug("restart check: %s", exc)
        return False


def _note_restart(runtime: str, role: Role) -> None:
    """In an actor's constructor: count it when Ray restarted the actor, else create the
    series at zero."""
    metric = _make("actor_restarts")
    tags = {"runtime": runtime, "role": role}
    if _restarted():
        _inc(metric, 1, tags)
    else:
        _zero(metric, tags)


@functools.cache
def _spark_metrics() -> tuple[Any, Any]:
    return _make("spark_partitions_pulled"), _make("spark_executor_fallbacks")


def _zero_spark(runtime: str) -> None:
    for metric in _spark_metrics():
        _zero(metric, {"runtime": runtime})


def spark_pulled(runtime: str, *, fallback: bool) -> None:
    """A Spark partition was read from a RayDP executor (``fallback``: not the one Spark
    placed it on). Nothing is recorded outside a runtime (``runtime`` empty)."""
    if runtime:
        pulled, fallbacks = _spark_metrics()
        _inc(pulled, 1, {"runtime": runtime})
        if fallback:
            _inc(fallbacks, 1, {"runtime": runtime})


class WriterMetrics:
    """One writer actor: rows, bytes, its mailbox and its refusals."""

    def __init__(self, runtime: str, sink: str, writer: int,
                 max_buffer_bytes: int | None = None) -> None:
        self._tags = {"runtime": runtime, "sink": sink, "writer": str(writer)}
        self._rows = _make("rows_written")
        self._bytes = _make("bytes_written")
        self._refusals = _make("backpressure_refusals")
        self._depth = _make("mailbox_depth")
        self._waiting = _make("mailbox_bytes")
        for metric in (self._rows, self._bytes, self._refusals):
            _zero(metric, self._tags)
        self.mailbox(0, 0)
        if max_buffer_bytes is not None:
            _GAUGES.set(_make("mailbox_limit_bytes"), max_buffer_bytes,
                        {"runtime": runtime, "sink": sink})
        _note_restart(runtime, "writer")
        _zero_spark(runtime)

    def applied(self, rows: int, nbytes: int) -> None:
        _inc(self._rows, rows, self._tags)
        _inc(self._bytes, nbytes, self._tags)

    def mailbox(self, depth: int, nbytes: int) -> None:
        """What waits in the reorder buffer now: messages and their bytes."""
        _GAUGES.set(self._depth, depth, self._tags)
        _GAUGES.set(self._waiting, nbytes, self._tags)

    def refused(self) -> None:
        _inc(self._refusals, 1, self._tags)


class CoordinatorMetrics:
    """The coordinator: commits, retries and rows per sink, the status as gauges,
    backpressure waits."""

    def __init__(self, runtime: str, sinks: Iterable[str] = (),
                 max_pending_epochs: int | None = None) -> None:
        self._runtime = runtime
        self._tags = {"runtime": runtime}
        self._commit = _make("epoch_commit_seconds")
        self._retries = _make("commit_retries")
        self._rows = _make("rows_committed")
        self._waits = _make("backpressure_waits")
        self._gauges = {name: _make(name) for name in
                        ("last_committed_epoch", "pending_epochs", "sink_state",
                         "held_seconds", *_TABLE_GAUGES)}
        self._maint = {name: _make(name) for name in _MAINTENANCE_COUNTERS}
        self._decided: OrderedDict[int, dict[str, int]] = OrderedDict()
        for sink in sinks:
            for metric in (self._retries, self._rows, *self._maint.values()):
                _zero(metric, self._sink(sink))
        _zero(self._waits, self._tags)
        if max_pending_epochs is not None:
            _GAUGES.set(_make("max_pending_epochs"), max_pending_epochs, self._tags)
        _note_restart(runtime, "coordinator")

    def _sink(self, sink: str) -> dict[str, str]:
        return {"runtime": self._runtime, "sink": sink}

    def decided(self, epoch: int, requests: Sequence[CommitRequest]) -> None:
        """The rows of ``epoch`` per sink, from its writers' requests (counted when each
        sink commits it)."""
        rows: dict[str, int] = {}
        for request in requests:
            rows[request.sink] = rows.get(request.sink, 0) + request.rows
        self._decided[epoch] = rows
        while len(self._decided) > _KEEP_DECIDED:
            self._decided.popitem(last=False)

    def committed(self, outcome: CommitOutcome, seconds: float) -> None:
        """One sink committed one epoch (``skipped``: its marker had it already)."""
        tags = self._sink(outcome.sink)
        if self._commit is not None:
            try:
                self._commit.observe(seconds, tags=tags)
            except Exception as exc:
                log.debug("recording commit seconds: %s", exc)
        rows = self._decided.get(outcome.epoch, {})
        added = rows.pop(outcome.sink, 0)
        if not outcome.skipped:
            _inc(self._rows, added, tags)
        if not rows:
            self._decided.pop(outcome.epoch, None)

    def retried(self, sink: str) -> None:
        _inc(self._retries, 1, self._sink(sink))

    def waited(self) -> None:
        _inc(self._waits, 1, self._tags)

    def maintained(self, report: MaintenanceReport, table: TableStats | None) -> None:
        """One maintenance pass ended (its table's size after it: ``status`` sets it)."""
        tags = self._sink(report.sink)
        _inc(self._maint["maintenance_passes"], 1, tags)
        _inc(self._maint["maintenance_files_compacted"], report.files_compacted, tags)
        _inc(self._maint["maintenance_files_deleted"], report.files_deleted, tags)

    def maintenance_failed(self, sink: str) -> None:
        _inc(self._maint["maintenance_failures"], 1, self._sink(sink))

    def status(self, status: RuntimeStatus) -> None:
        """The coordinator's status snapshot as gauges: per sink its state (one-hot), its
        last committed epoch, and the decided epochs it has not committed."""
        pending = status.pending_epochs
        for sink, info in status.sinks.items():
            tags = self._sink(sink)
            last = info.last_committed_epoch
            if last is not None:
                _GAUGES.set(self._gauges["last_committed_epoch"], last, tags)
            behind = sum(1 for epoch in pending if last is None or epoch > last)
            _GAUGES.set(self._gauges["pending_epochs"], behind, tags)
            for state in SINK_STATES:
                _GAUGES.set(self._gauges["sink_state"], float(state == info.state),
                            {**tags, "state": state})
            held = (info.held_by or {}).get("age_seconds")
            _GAUGES.set(self._gauges["held_seconds"], float(held or 0.0), tags)
            self._table(info, tags)

    def _table(self, info: SinkStatus, tags: dict[str, str]) -> None:
        """A maintained sink's table size and its last pass's time, as gauges."""
        if info.maintenance is not None and info.maintenance.last_pass_at is not None:
            _GAUGES.set(self._gauges["maintenance_last_timestamp"],
                        info.maintenance.last_pass_at, tags)
        if info.table is not None:
            for gauge, value in (("table_data_files", info.table.data_files),
                                 ("table_data_bytes", info.table.data_bytes),
                                 ("table_snapshots", info.table.snapshots),
                                 ("table_metadata_bytes", info.table.metadata_bytes)):
                _GAUGES.set(self._gauges[gauge], float(value), tags)


class DriverMetrics:
    """The driver of one runtime: actors it replaced, failed epoch attempts, rewinds."""

    def __init__(self, runtime: str) -> None:
        self._runtime = runtime
        self._tags = {"runtime": runtime}
        self._replacements = _make("actor_replacements")
        self._failures = _make("epoch_failures")
        self._rewinds = _make("stream_rewinds")
        for role in get_args(Role):
            _zero(self._replacements, {**self._tags, "role": role})
        for metric in (self._failures, self._rewinds):
            _zero(metric, self._tags)

    def replaced(self, roles: Iterable[Role]) -> None:
        for role in roles:
            _inc(self._replacements, 1, {**self._tags, "role": role})

    def attempt_failed(self) -> None:
        _inc(self._failures, 1, self._tags)

    def rewound(self) -> None:
        _inc(self._rewinds, 1, self._tags)
