"""raysink: exactly-once sinks for Spark-on-Ray jobs.

``import raysink`` imports neither pyspark, deltalake, pyiceberg nor psycopg: each sink
imports its library when used.
"""

from raysink.actors.placement import Placement
from raysink.errors import (
    BackpressureError,
    ConfigError,
    DataLossError,
    EpochFailedError,
    EpochRegressionError,
    FencedError,
    MetaStoreError,
    RaySinkError,
    RescaleRefusedError,
    RuntimeInUseError,
    RuntimeUnavailableError,
    SchemaMismatchError,
    SinkUnavailableError,
)
from raysink.feeds import Feed
from raysink.handle import EpochHandle
from raysink.reports import EpochReport, RuntimeStatus, SinkStatus
from raysink.runtime import SinkRuntime

__all__ = [
    "BackpressureError",
    "ConfigError",
    "DataLossError",
    "EpochFailedError",
    "EpochHandle",
    "EpochRegressionError",
    "EpochReport",
    "Feed",
    "FencedError",
    "MetaStoreError",
    "Placement",
    "RaySinkError",
    "RescaleRefusedError",
    "RuntimeInUseError",
    "RuntimeStatus",
    "RuntimeUnavailableError",
    "SchemaMismatchError",
    "SinkRuntime",
    "SinkStatus",
    "SinkUnavailableError",
]

__version__ = "0.1.0"
