"""``SinkRuntime.write(df)`` and ``SinkRuntime.foreach_batch(df, batch_id)``.

A DataFrame is one epoch. Its partitions travel through RayDP's recoverable path
(``SparkPartitions``): Spark caches and computes the DataFrame, then each partition is
handed to a writer as soon as its fetch finishes. The cached RDD stays pinned until the
epoch is decided and visible, so a partition that a crashed writer had buffered can be
fetched again for the next attempt; it is released after.

Structured Streaming: micro-batch ``batch_id`` of query ``Q`` is epoch
``batch_id + 1 + offset``. The runtime is bound to ``Q`` (its ``id``, which lives in the
checkpoint, not the ``runId``) in the meta store. A batch from another query — a new
checkpoint location restarts ``batch_id`` at 0 — is a ``ConfigError`` unless the runtime
was opened with ``epoch_offset=`` to re-bind, since every batch would otherwise be skipped
as "already committed".
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from raysink.errors import ConfigError, SchemaMismatchError

if TYPE_CHECKING:
    from raysink.runtime import EpochReport, SinkRuntime

__all__ = ["write_dataframe", "write_micro_batch"]

log = logging.getLogger(__name__)

_QUERY_ID_PROPERTY = "sql.streaming.queryId"
_UNSTORABLE = ("CalendarIntervalType", "ObjectType", "VariantType")


def _check_dataframe(runtime: str, df: Any) -> None:
    try:
        from pyspark.sql import DataFrame
    except ImportError as exc:
        raise ConfigError("write(df) needs pyspark: pip install 'raysink[spark]'",
                          runtime=runtime) from exc
    if not isinstance(df, DataFrame):
        raise ConfigError(f"write() takes a Spark DataFrame; got {type(df).__name__}. "
                          "Use write_arrow() for Arrow data", runtime=runtime)
    from pyspark.sql import SparkSession

    if SparkSession.getActiveSession() is None:
        raise ConfigError("no active Spark session: start one with "
                          "raysink.spark.init_spark() before write(df)", runtime=runtime)
    for field in df.schema.fields:
        kind = type(field.dataType).__name__
        if kind in _UNSTORABLE or "CalendarInterval" in field.dataType.simpleString():
            raise SchemaMismatchError(
                f"column {field.name!r} has type {field.dataType.simpleString()}, which no "
                "sink can store; cast it (e.g. to a string) before writing", runtime=runtime)


def write_dataframe(rt: SinkRuntime, df: Any, *, epoch: int | None = None,
                    fetch_timeout: float = 300.0) -> EpochReport:
    """Write ``df`` as one epoch; partitions go to writers as soon as they are fetched."""
    from raysink.spark.handoff import SparkPartitions

    _check_dataframe(rt.name, df)
    with SparkPartitions.open(df, fetch_timeout=fetch_timeout) as parts:
        if parts.num_partitions == 0:
            return rt.write_arrow(parts.schema.empty_table(), epoch=epoch)
        ready = (ref for _, ref in parts.as_ready(window=2 * rt.writers))
        return rt._run_refs(ready, epoch)


def write_micro_batch(rt: SinkRuntime, df: Any, batch_id: int) -> EpochReport:
    """``foreachBatch`` entry: bind to the query, then write the batch as its epoch.
    Returns the epoch's report (``SinkRuntime.foreach_batch`` drops it)."""
    offset = rt._bind_source(_query_id(df))
    report = write_dataframe(rt, df, epoch=int(batch_id) + 1 + offset)
    log.info("%s: micro-batch %s -> epoch %s (%s rows, %s)", rt.name, batch_id, report.epoch,
             report.rows, "skipped, already committed" if report.skipped else "committed")
    return report


def _query_id(df: Any) -> str:
    """The streaming query's ``id`` (stable across restarts from one checkpoint)."""
    context = df.sparkSession.sparkContext
    query_id = context.getLocalProperty(_QUERY_ID_PROPERTY)
    if not query_id:
        raise ConfigError("foreach_batch must be called by writeStream.foreachBatch: no "
                          "streaming query id on this thread. For a batch DataFrame use "
                          "write(df)")
    return str(query_id)
