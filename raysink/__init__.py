"""raysink: exactly-once sinks for Spark-on-Ray jobs.

``import raysink`` imports neither pyspark, deltalake, pyiceberg nor psycopg: each sink
imports its library when used.
"""

from raysink.driver.feed import Feed
from raysink.driver.handle import EpochHandle
from raysink.driver.placement import Placement
from raysink.driver.stream_feed import StreamFeed
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
    StreamRewind,
)
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
    "StreamFeed",
    "StreamRewind",
]

__version__ = "0.1.0"
