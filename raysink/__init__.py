"""raysink: exactly-once sinks for Spark-on-Ray jobs.

``import raysink`` imports neither pyspark, deltalake, pyiceberg nor psycopg: each sink
imports its library when used.

Which package runs where (``docs/architecture.md`` has the whole map)::

    raysink.runtime      SinkRuntime, the user's facade                 driver
    raysink.driver       epochs, feeds, routing, sending, actors' life  driver, producers
                         (start, close, rescale, what runs where)
    raysink.writer       SinkWriterActor and its mailbox                each writer actor
    raysink.coordinator  CoordinatorActor, two-phase commit, metastore  the coordinator actor
    raysink.protocol     messages, typed actor clients, barriers,       every process
                         alignment, vnodes
    raysink.sinks        Parquet, Delta, Iceberg, PostgreSQL, Kafka     writers, coordinator
    raysink.spark        Spark sessions, DataFrame handoff, query binding  driver, writers
    raysink.testing      fake sinks, in-memory meta store, fault arming  tests
    raysink.dashboards   Grafana dashboard, Prometheus alert rules      the CLI, operators
    (top level: errors, reports, progress, cli, demo, and the shared _metrics, _faults,
    _schema, _options)

One epoch::

    driver   open_epoch            -> coordinator: OPEN(E) in the meta store
    driver   data messages         -> writers' mailboxes (in sequence order) -> SinkWriter.write
    driver   barrier               -> writers: flush, pre_commit -> commit request
    driver   commit_epoch(requests)-> coordinator: PENDING(E) in the meta store (the decision)
    coordinator                       Sink.commit(E) per sink -> COMMITTED(E)
    driver   <- CommitWait(committed) -> EpochReport

The core dependencies' releases (Ray, pyarrow, numpy) are checked here, before any module
that uses them is imported: one outside raysink's range (``raysink.protocol.requirements``)
is a ``DependencyVersionError`` naming it, not an ``ImportError`` from deep inside.
"""

# ruff: noqa: E402  (the check below runs before the submodules import Ray)
__version__ = "0.2.0"
"""This release; the only place it is written (pyproject.toml reads it from here)."""

from raysink.protocol.requirements import check_extra

check_extra(None)

from raysink.driver.feed import Feed
from raysink.driver.handle import EpochHandle
from raysink.driver.placement import Placement
from raysink.driver.stream_feed import StreamFeed
from raysink.errors import (
    BackpressureError,
    ConfigError,
    DataLossError,
    DependencyVersionError,
    EpochFailedError,
    EpochRegressionError,
    FencedError,
    MaintenanceError,
    MetaStoreError,
    RaySinkError,
    RescaleRefusedError,
    RuntimeInUseError,
    RuntimeUnavailableError,
    SchemaMismatchError,
    SinkUnavailableError,
    StreamRewind,
)
from raysink.reports import ActorProcess, EpochReport, RuntimeStatus, SinkStatus
from raysink.runtime import RuntimeOptions, SinkRuntime
from raysink.sinks._maintenance import Maintenance

__all__ = [
    "ActorProcess",
    "BackpressureError",
    "ConfigError",
    "DataLossError",
    "DependencyVersionError",
    "EpochFailedError",
    "EpochHandle",
    "EpochRegressionError",
    "EpochReport",
    "Feed",
    "FencedError",
    "Maintenance",
    "MaintenanceError",
    "MetaStoreError",
    "Placement",
    "RaySinkError",
    "RescaleRefusedError",
    "RuntimeInUseError",
    "RuntimeOptions",
    "RuntimeStatus",
    "RuntimeUnavailableError",
    "SchemaMismatchError",
    "SinkRuntime",
    "SinkStatus",
    "SinkUnavailableError",
    "StreamFeed",
    "StreamRewind",
]
