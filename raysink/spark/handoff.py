"""Spark DataFrame -> one Arrow table per partition, through RayDP's recoverable path.

How the data travels (RayDP 1.6.5), two ways after one prepare::

    driver JVM   ObjectStoreWriter.prepareRecoverableRDD(df)   toArrowBatchRdd, persist,
                                                               count(): all computed here
    pulls()      ExecutorPartition items (raysink.spark.partitions), sent to the writers in data
                 messages; each writer asks the executor actor raydp-executor-<id>
                 .getRDDPartition itself (the cached Arrow batches as one IPC stream) and
                 decodes the bytes: no Ray task, no table in the object store
    refs()       one Ray task per partition does the same pull and returns the table into
                 the object store; a consumer ray.get()s it (zero-copy)

``rt.write(df)`` uses ``pulls()``: measured on 5 M rows (bench/spark_write.py), the task
hop and its object-store copy cost more than the writers' own decoding.

Lifecycle of a :class:`SparkPartitions`:

1. ``open(df)`` caches and counts the DataFrame in Spark; nothing moves to Ray yet.
   A DataFrame with zero partitions never reaches RayDP (its conversion throws on one):
   it has an empty partition list and the right schema.
2. ``pulls()`` describes every partition (nothing is fetched); each item can be pulled
   any number of times until ``release()``, so a writer that crashed is re-fed the same
   items. Or ``refs()`` submits one fetch task per partition at once, and
   ``as_ready(window=n)`` keeps at most ``n`` in flight. The refs are owned by the calling
   process, so a consumer actor that crashes loses nothing but its borrow; hand them to
   actors nested in a list (``actor.write.remote([ref])``). The handoff keeps no ref
   itself: a partition's object lives as long as its consumer holds it.
3. ``release()`` (also on ``__exit__``) unpins the cached RDD; call it once the epoch is
   committed. Idempotent. Fetching after it is a :class:`ConfigError`.

An executor that dies is restarted by Ray, but RayDP registers it with Spark under a new
executor id, and sometimes never starts it; a pull then asks the other live executors
(``executor_candidates``), whose block managers read or re-cache the partition.

RayDP's fetch retries forever when the app master is gone (it is not restartable), so
every executor call is bounded (``EXECUTOR_CALL_TIMEOUT``), and ``as_ready`` bounds the
wait for its tasks: no partition finishing within ``fetch_timeout`` seconds is a
:class:`SinkUnavailableError`.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import pyarrow as pa
import ray
from pyspark import StorageLevel
from pyspark.sql import DataFrame

from raysink.errors import ConfigError, SinkUnavailableError
from raysink.protocol.pull import Pull
from raysink.spark.partitions import (
    EXECUTOR_PREFIX,
    ExecutorPartition,
    conform,
    cross_language_calls,
    executor_candidates,
)

__all__ = ["SparkPartitions", "conform", "cross_language_calls", "executor_candidates",
           "normalise_schema"]

logger = logging.getLogger(__name__)

#: Submits the fetch of one partition and returns the ref of its ``pa.Table``.
FetchFn = Callable[[int], "ray.ObjectRef[pa.Table]"]
#: Describes partition ``i`` for a consumer that fetches it itself (``runtime`` labels
#: it; the last argument bounds one pull, in seconds).
PullFn = Callable[[int, str, float], Pull]



class SparkPartitions:
    """The partitions of one cached Spark DataFrame, fetched as Arrow tables on demand.

    Build it with :meth:`open`; the constructor is the seam for tests and other sources:
    ``fetch(i)`` submits the fetch of partition ``i``, ``release()`` unpins the source.
    """

    def __init__(
        self,
        *,
        schema: pa.Schema,
        num_partitions: int,
        fetch: FetchFn,
        release: Callable[[], None] | None = None,
        fetch_timeout: float = 300.0,
        description: str = "DataFrame",
        pull: PullFn | None = None,
    ) -> None:
        if fetch_timeout <= 0:
            raise ConfigError(f"fetch_timeout must be positive seconds, got {fetch_timeout!r}")
        self._schema = schema
        self._num_partitions = num_partitions
        self._fetch = fetch
        self._pull = pull
        self._release = release
        self._fetch_timeout = fetch_timeout
        self._description = description
        self._released = False

    @classmethod
    def open(cls, df: DataFrame, *, fetch_timeout: float = 300.0) -> SparkPartitions:
        """Cache and count ``df`` in Spark and return its partitions, ready to fetch.

        This runs the whole Spark job: when it returns, every partition is computed and
        held by the executors until :meth:`release`.
        """
        schema = normalise_schema(_jvm_arrow_schema(df))
        if _num_partitions(df) == 0:
            return cls(
                schema=schema, num_partitions=0, fetch=_no_partition,
                fetch_timeout=fetch_timeout, description="DataFrame with zero partitions",
            )
        rdd = _RecoverableRdd.prepare(df, schema)
        return cls(
            schema=schema, num_partitions=rdd.num_partitions, fetch=rdd.fetch,
            pull=rdd.pull, release=rdd.release, fetch_timeout=fetch_timeout,
            description=f"Spark RDD {rdd.rdd_id}",
        )

    @property
    def num_partitions(self) -> int:
        """How many partitions (and so tables) the DataFrame has; may be 0."""
        return self._num_partitions

    @property
    def schema(self) -> pa.Schema:
        """The Arrow schema of every partition's table (timestamps with a zone in UTC)."""
        return self._schema

    @property
    def released(self) -> bool:
        """Whether :meth:`release` ran; no fetch is possible after it."""
        return self._released

    def refs(self) -> list[ray.ObjectRef[pa.Table]]:
        """Submit every partition's fetch at once; one ref per partition, in order.

        Each call submits new fetches; the handoff keeps none of the refs.
        """
        self._check_open()
        return [self._fetch(index) for index in range(self._num_partitions)]

    def pulls(self, runtime: str = "") -> list[Pull]:
        """One item per partition, in order, for consumers that fetch it themselves (a
        writer actor reads its partitions straight from the executors: no Ray task and no
        object-store copy per partition). Nothing is fetched here; each item may be pulled
        any number of times while the partitions are not released, and one pull takes at
        most ``fetch_timeout`` seconds. ``runtime`` labels the items in logs and fault
        points."""
        self._check_open()
        if self._pull is None:
            if self._num_partitions == 0:
                return []
            raise ConfigError(f"{self._description} can only be fetched through refs(); "
                              "open a DataFrame with SparkPartitions.open(df) to pull")
        pull, bound = self._pull, self._fetch_timeout
        return [pull(index, runtime, bound) for index in range(self._num_partitions)]

    def as_ready(
        self, timeout: float | None = None, *, window: int | None = None
    ) -> Iterator[tuple[int, ray.ObjectRef[pa.Table]]]:
        """Yield ``(index, ref)`` for each partition as soon as its fetch has finished.

        ``window`` bounds the fetches in flight (default: all at once): a new fetch is
        submitted as each one finishes and the consumer takes it, so a consumer that applies
        backpressure (the runtime's credit window) also bounds what waits in the object
        store, and fetches do not crowd the writers out of the CPUs.

        ``timeout`` (default: ``fetch_timeout``) bounds the wait for the next partition;
        past it the remaining fetches are cancelled and :class:`SinkUnavailableError`
        names the partitions still missing. A fetch that failed is yielded like one that
        succeeded: ``ray.get`` of its ref raises the failure.
        """
        self._check_open()
        bound = self._fetch_timeout if timeout is None else timeout
        size = self._num_partitions if window is None else max(1, window)
        return self._wait_each(iter(range(self._num_partitions)), size, bound)

    def release(self) -> None:
        """Unpin the cached RDD in Spark; idempotent, never raises for a stopped Spark."""
        if self._released:
            return
        self._released = True
        if self._release is None:
            return
        try:
            self._release()
        except Exception as exc:  # Spark already stopped: its cache went with it.
            logger.warning("could not release %s: %s", self._description, exc)

    def __enter__(self) -> SparkPartitions:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "released" if self._released else "open"
        return f"SparkPartitions({self._description}, {self._num_partitions} partitions, {state})"

    def _check_open(self) -> None:
        if self._released:
            raise ConfigError(
                f"the partitions of {self._description} were released; "
                "open the DataFrame again with SparkPartitions.open(df)"
            )

    def _wait_each(
        self, indexes: Iterator[int], window: int, bound: float
    ) -> Iterator[tuple[int, ray.ObjectRef[pa.Table]]]:
        by_ref: dict[ray.ObjectRef[pa.Table], int] = {}

        def refill() -> None:
            while len(by_ref) < window:
                index = next(indexes, None)
                if index is None:
                    return
                by_ref[self._fetch(index)] = index

        refill()
        while by_ref:
            ready, _ = ray.wait(list(by_ref), num_returns=1, timeout=bound, fetch_local=False)
            if not ready:
                _cancel(list(by_ref))
                raise self._timeout_error(sorted(by_ref.values()), bound)
            for ref in ready:
                yield by_ref.pop(ref), ref
            refill()

    def _timeout_error(self, missing: list[int], bound: float) -> SinkUnavailableError:
        others = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        return SinkUnavailableError(
            f"Spark partition {missing[0]}{others} of {self._description} was not fetched "
            f"within {bound:g} s; the Spark app master may be gone (RayDP cannot restart it) "
            "or the executors are overloaded. Restart Spark with init_spark() and write the "
            "epoch again, or raise fetch_timeout"
        )


def normalise_schema(schema: pa.Schema) -> pa.Schema:
    """Spark's Arrow schema as raysink delivers it: no metadata, zoned timestamps in UTC.

    Spark labels ``TimestampType`` with the session time zone; the instants are UTC
    microseconds whatever the label, so relabelling is free.
    """
    fields = [field.with_type(_normalise_type(field.type)) for field in schema]
    return pa.schema([field.remove_metadata() for field in fields])


def _normalise_type(dtype: pa.DataType) -> pa.DataType:
    if pa.types.is_timestamp(dtype) and dtype.tz is not None:
        return pa.timestamp(dtype.unit, tz="UTC")
    if pa.types.is_map(dtype):
        return pa.map_(
            dtype.key_field.with_type(_normalise_type(dtype.key_type)),
            dtype.item_field.with_type(_normalise_type(dtype.item_type)),
            keys_sorted=dtype.keys_sorted,
        )
    if pa.types.is_list(dtype) or pa.types.is_large_list(dtype):
        item = dtype.value_field.with_type(_normalise_type(dtype.value_type))
        return pa.large_list(item) if pa.types.is_large_list(dtype) else pa.list_(item)
    if pa.types.is_struct(dtype):
        return pa.struct([field.with_type(_normalise_type(field.type)) for field in dtype])
    return dtype


@dataclass(frozen=True, slots=True)
class _RecoverableRdd:
    """A DataFrame cached by RayDP's ``prepareRecoverableRDD``, served by its executors."""

    rdd_id: int
    num_partitions: int
    schema_json: str
    driver_agent_url: str
    locations: tuple[str, ...]
    schema: pa.Schema
    writer: Any  # py4j handle of org.apache.spark.sql.raydp.ObjectStoreWriter

    @classmethod
    def prepare(cls, df: DataFrame, schema: pa.Schema) -> _RecoverableRdd:
        context = df.sparkSession.sparkContext
        writer = _jvm(df).org.apache.spark.sql.raydp.ObjectStoreWriter
        level = context._getJavaStorageLevel(StorageLevel.MEMORY_AND_DISK)
        info = _prepare_recoverable(writer, df._jdf, level)
        return cls(
            rdd_id=int(info.rddId()),
            num_partitions=int(info.numPartitions()),
            schema_json=str(info.schemaJson()),
            driver_agent_url=str(info.driverAgentUrl()),
            locations=tuple(str(location) for location in info.locations()),
            schema=schema,
            writer=writer,
        )

    def pull(self, index: int, runtime: str = "", timeout: float = 300.0) -> ExecutorPartition:
        """Partition ``index`` as an item its consumer fetches itself."""
        return ExecutorPartition(
            rdd_id=self.rdd_id, index=index,
            located=EXECUTOR_PREFIX + self.locations[index], schema_json=self.schema_json,
            driver_agent_url=self.driver_agent_url, schema=self.schema, runtime=runtime,
            timeout=timeout)

    def fetch(self, index: int) -> ray.ObjectRef[pa.Table]:
        ref: ray.ObjectRef[pa.Table] = _fetch_partition.remote(self.pull(index, "", math.inf))
        return ref

    def release(self) -> None:
        self.writer.releaseRecoverableRDD(self.rdd_id)


def _prepare_recoverable(writer: Any, jdf: Any, level: Any, attempts: int = 3,
                         pause: float = 2.0) -> Any:
    """RayDP's ``prepareRecoverableRDD``, tried again while an executor comes back.

    It asks an executor for the block locations, which fails (a Java
    ``NullPointerException``) while that executor restarts, or for good when RayDP never
    starts the restarted one: then a :class:`SinkUnavailableError` says to restart Spark.
    """
    from py4j.protocol import Py4JJavaError

    last: Py4JJavaError | None = None
    for attempt in range(1, attempts + 1):
        try:
            return writer.prepareRecoverableRDD(jdf, level)
        except Py4JJavaError as exc:
            last = exc
            logger.warning("caching the DataFrame failed (try %d of %d): %s", attempt,
                           attempts, _java_cause(exc))
            if attempt < attempts:
                time.sleep(pause)
    raise SinkUnavailableError(
        f"Spark could not cache the DataFrame and locate its partitions "
        f"({_java_cause(last)}); a RayDP executor may have died without coming back (RayDP "
        "does not always start an executor Ray restarted). Restart Spark with stop_spark() "
        "and init_spark(), then write the epoch again"
    ) from last


def _java_cause(exc: Any) -> str:
    """The Java exception behind a py4j error, in one line."""
    try:
        return str(exc.java_exception.toString())
    except Exception:  # not a Java error, or the gateway is gone
        return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


@ray.remote(num_cpus=0, max_retries=3, retry_exceptions=True)
def _fetch_partition(item: ExecutorPartition) -> pa.Table:
    """``item.pull()`` in a Ray task, its table returned into the object store (the
    ``refs``/``as_ready`` path). Retried up to 3 times on any failure, and re-run by Ray's
    lineage when the returned object is lost."""
    return item.pull()


def _cancel(refs: list[ray.ObjectRef[pa.Table]]) -> None:
    """Stop fetches nobody waits for any more (RayDP's would retry forever).

    Forced: a fetch blocks inside a call (the executor actor's) that a polite cancel does
    not interrupt; killing its worker does not retry it.
    """
    for ref in refs:
        try:
            ray.cancel(ref, force=True)
        except Exception as exc:  # already finished, or its owner is gone
            logger.debug("could not cancel fetch %s: %s", ref, exc)


def _jvm(df: DataFrame) -> Any:
    """The py4j view of the driver JVM behind ``df``."""
    jvm = df.sparkSession.sparkContext._jvm
    if jvm is None:
        raise ConfigError(
            "the DataFrame's Spark session is stopped; start one with raysink.spark.init_spark()"
        )
    return jvm


def _no_partition(index: int) -> ray.ObjectRef[pa.Table]:
    raise ConfigError(f"a DataFrame with zero partitions has no partition {index!r}")


def _num_partitions(df: DataFrame) -> int:
    """Partitions of the executed plan RayDP converts (its Arrow RDD maps it 1:1)."""
    return int(df._jdf.queryExecution().toRdd().getNumPartitions())


def _jvm_arrow_schema(df: DataFrame) -> pa.Schema:
    """The Arrow schema Spark's own conversion writes for ``df``, read back in Python.

    Taken from the JVM (RayDP's ``ObjectStoreWriter.toArrowSchema``, serialised as an
    Arrow IPC schema message), so it is exactly what the executors send, even for a
    DataFrame that has no partition to look at.
    """
    jvm = _jvm(df)
    arrow_schema = jvm.org.apache.spark.sql.raydp.ObjectStoreWriter.toArrowSchema(df._jdf)
    out = jvm.java.io.ByteArrayOutputStream()
    channel = jvm.org.apache.arrow.vector.ipc.WriteChannel(
        jvm.java.nio.channels.Channels.newChannel(out)
    )
    jvm.org.apache.arrow.vector.ipc.message.MessageSerializer.serialize(channel, arrow_schema)
    schema: pa.Schema = pa.ipc.read_schema(pa.py_buffer(bytes(out.toByteArray())))
    return schema
