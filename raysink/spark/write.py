"""What ``SinkRuntime.write(df)`` and ``SinkRuntime.foreach_batch(df, batch_id)`` ask of
Spark: the checks on the DataFrame, its partitions, the streaming query's id. (The epoch
itself is the runtime's; this module knows nothing of it.)

A DataFrame is one epoch. Its partitions travel through RayDP's recoverable path
(``SparkPartitions``): Spark caches and computes the DataFrame, then each writer is sent
the descriptions of its partitions (``SparkPartitions.pulls``, with the runtime's credit
window) and reads them straight from the executor actors, decoding the Arrow bytes
itself: no Ray task hop and no copy in the object store per partition. The cached RDD
stays pinned until the epoch is decided and visible, so a partition that a crashed writer
had buffered is pulled again for the next attempt; it is released after. A pull that no
executor serves within ``fetch_timeout`` seconds fails the attempt with
``SinkUnavailableError`` (retried up to ``max_attempts``).

Checks made before anything is cached or written:

* ``df`` is a DataFrame of a running Spark session (else ``ConfigError``). The session is
  the DataFrame's own, not the thread's "active" one: ``foreachBatch`` callbacks and other
  Python threads have no active session.
* every column type, nested ones included, converts to Arrow and can be stored by some
  sink (else ``SchemaMismatchError``): Spark's ``CalendarIntervalType`` has no Arrow form,
  ``YearMonthIntervalType`` becomes an Arrow month interval that no file format holds.

With a routing key the rows are split by vnode beside the data (one small Ray task per
partition pulls it from the executors and splits it, see ``raysink.driver.routing``), with the same
hash as ``write_arrow``: a key lands on the same writer whichever way it arrived, and
Spark runs no extra shuffle.

Structured Streaming: micro-batch ``batch_id`` of query ``Q`` is epoch
``batch_id + 1 + offset``. The runtime is bound to ``Q`` (its ``id``, which lives in the
checkpoint, not the ``runId``) in the meta store. A batch from another query — a new
checkpoint location restarts ``batch_id`` at 0 — is a ``ConfigError`` unless the runtime
was opened with ``epoch_offset=`` to re-bind, since every batch would otherwise be skipped
as "already committed". So is a query bound for the first time in a meta store that
knows less than the targets' markers (a fresh default store): its batch ids would number
epochs the targets hold. The query id comes from the Spark local property
``sql.streaming.queryId``, which the stream's execution thread sets and which the
``foreachBatch`` callback sees (PySpark pins each callback to that JVM thread). A batch
Spark replays after a restart whose epoch is already committed is skipped before Spark
computes it again.
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any

from raysink.errors import ConfigError, SchemaMismatchError

if TYPE_CHECKING:
    from raysink.spark.handoff import SparkPartitions

__all__ = ["check_dataframe", "open_partitions", "streaming_query_id"]

log = logging.getLogger(__name__)

_QUERY_ID_PROPERTY = "sql.streaming.queryId"
# Spark types no sink can store, by their JSON names in a schema: no Arrow form, or an
# Arrow form no file format holds.
_NO_ARROW = "Spark cannot convert it to Arrow"
_MONTHS = "its Arrow month interval has no Parquet, Delta or Iceberg form"
_UNSTORABLE = {
    "interval": _NO_ARROW,  # CalendarIntervalType
    "interval year": _MONTHS,  # YearMonthIntervalType, each field range
    "interval year to month": _MONTHS,
    "interval month": _MONTHS,
    "variant": _NO_ARROW,
}


def check_dataframe(runtime: str, df: Any) -> None:
    """``df`` is a DataFrame of a running session and every column can be stored."""
    try:
        from pyspark.sql import DataFrame
    except ImportError as exc:
        raise ConfigError("write(df) needs pyspark: pip install 'raysink[spark]'",
                          runtime=runtime) from exc
    if not isinstance(df, DataFrame):
        raise ConfigError(f"write() takes a Spark DataFrame; got {type(df).__name__}. "
                          "Use write_arrow() for Arrow data", runtime=runtime)
    if not _session_running(df):
        raise ConfigError("the DataFrame's Spark session is stopped (no Spark session): "
                          "start one with raysink.spark.init_spark() and build the DataFrame "
                          "in it before write(df)", runtime=runtime)
    # the JVM's schema as JSON: PySpark cannot even parse some of these types
    schema = json.loads(str(df._jdf.schema().json()))
    for field in schema.get("fields", []):
        reason = _unstorable(field["type"])
        if reason is not None:
            raise SchemaMismatchError(
                f"column {field['name']!r} has a type which no sink can store ({reason}); "
                "cast it (e.g. to a string) before writing", runtime=runtime)


def _session_running(df: Any) -> bool:
    """Whether the session ``df`` belongs to still has a live SparkContext."""
    context = df.sparkSession.sparkContext
    java_context = getattr(context, "_jsc", None)
    if java_context is None:
        return False
    try:
        return not bool(java_context.sc().isStopped())
    except Exception as exc:  # the JVM gateway itself is gone
        log.debug("Spark context check failed: %s", exc)
        return False


def _unstorable(data_type: Any) -> str | None:
    """Why ``data_type`` (a type in Spark's JSON schema form), or a type nested in it,
    cannot be stored; ``None`` when it can."""
    if isinstance(data_type, str):
        reason = _UNSTORABLE.get(data_type)
        return None if reason is None else f"{data_type}: {reason}"
    if not isinstance(data_type, dict):
        return None
    kind = data_type.get("type")
    children: list[Any] = []
    if kind == "array":
        children = [data_type.get("elementType")]
    elif kind == "map":
        children = [data_type.get("keyType"), data_type.get("valueType")]
    elif kind == "struct":
        children = [field.get("type") for field in data_type.get("fields", [])]
    elif kind == "udt":
        children = [data_type.get("sqlType")]
    for child in children:
        reason = _unstorable(child)
        if reason is not None:
            return reason
    return None


def open_partitions(df: Any, fetch_timeout: float = 300.0) -> SparkPartitions:
    """Cache and count ``df`` in Spark (its partitions stay pinned until ``release()``, or
    the end of a ``with`` block): the partitions' schema, count and pulls."""
    from raysink.spark.handoff import SparkPartitions

    return SparkPartitions.open(df, fetch_timeout=fetch_timeout)


def streaming_query_id(runtime: str, df: Any) -> str:
    """The streaming query's ``id`` (stable across restarts from one checkpoint), from a
    ``foreachBatch`` callback's thread; ``ConfigError`` elsewhere."""
    check_dataframe(runtime, df)
    context = df.sparkSession.sparkContext
    query_id = context.getLocalProperty(_QUERY_ID_PROPERTY)
    if not query_id:
        raise ConfigError("foreach_batch must be called by writeStream.foreachBatch: no "
                          "streaming query id on this thread. For a batch DataFrame use "
                          "write(df)", runtime=runtime)
    return str(query_id)
