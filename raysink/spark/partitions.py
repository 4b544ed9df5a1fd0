"""A cached Spark partition, read straight from the RayDP executors by whoever needs it.

No pyspark here: this module runs in writer actors and split tasks, which unpickle
:class:`ExecutorPartition` items out of data messages.

How one partition travels (RayDP 1.6.5)::

    consumer   ExecutorPartition.pull()
                 -> executor actor raydp-executor-<id>.getRDDPartition(rdd, index, ...)
                    (the cached Arrow batches as one IPC stream, a Java byte[])
                 -> pa.Table (a zero-copy view of those bytes), schema normalised

Which executor: first the one Spark placed the partition on, then every other live one
(:func:`executor_candidates`); any started executor serves any partition (its block
manager reads the block remotely, or has Spark re-cache the RDD). Each executor gets
``EXECUTOR_CALL_TIMEOUT`` seconds; when none serves the partition the pull raises
:class:`SinkUnavailableError` (the writer poisons the epoch with it and the runtime
retries the attempt, up to ``max_attempts``). Each partition served counts in the
runtime's ``spark_partitions_pulled`` metric, and one another executor served in
``spark_executor_fallbacks`` (``raysink._metrics``).

The ``spark.mid_pull`` fault point fires after the executor is chosen and before it is
asked (context: ``executor``, ``rdd``, ``partition``), so a test can kill that executor
while a writer pulls from it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from raysink import _faults
from raysink._metrics import spark_pulled
from raysink.errors import SinkUnavailableError
from raysink.protocol.pull import Pull

__all__ = ["EXECUTORS_BACK_SECONDS", "EXECUTOR_CALL_TIMEOUT", "UNAVAILABLE_SECONDS",
           "ExecutorPartition", "conform", "cross_language_calls", "decode",
           "executor_candidates", "fetch_ipc"]

logger = logging.getLogger(__name__)

EXECUTOR_PREFIX = "raydp-executor-"
#: Seconds one executor may take to serve a partition (re-caching included) before the
#: next live executor is asked.
EXECUTOR_CALL_TIMEOUT = 60.0

_cross_language_lock = threading.Lock()


@dataclass(frozen=True, slots=True)
class ExecutorPartition(Pull):
    """Partition ``index`` of the Arrow RDD ``rdd_id`` that RayDP's recoverable path cached.

    ``located`` is the actor name of the executor Spark placed it on; ``schema`` the
    normalised Arrow schema every partition is delivered in; ``runtime`` names the runtime
    for logs and fault points (empty outside one); ``timeout`` bounds one pull, all
    executors asked included.
    """

    rdd_id: int
    index: int
    located: str
    schema_json: str
    driver_agent_url: str
    schema: pa.Schema
    runtime: str = ""
    timeout: float = 300.0

    def pull(self) -> pa.Table:
        return decode(self.fetch_ipc(), self.schema)

    def fetch_ipc(self) -> Any:
        """The partition's Arrow IPC stream (bytes), not decoded."""
        return fetch_ipc(self.located, self.rdd_id, self.index, self.schema_json,
                         self.driver_agent_url, runtime=self.runtime, timeout=self.timeout)

    def __repr__(self) -> str:
        return f"ExecutorPartition(rdd {self.rdd_id}, partition {self.index}, {self.located})"


EXECUTORS_BACK_SECONDS = 30.0
"""How long a pull that no executor served keeps asking again, a round a second: after
a node loss RayDP starts the lost executors' replacements, and the survivors may be
unavailable for a moment (seen: every executor failing one round, 13 s after the loss)."""


def fetch_ipc(located: str, rdd_id: int, index: int, schema_json: str,
              driver_agent_url: str, *, runtime: str = "", timeout: float = 300.0) -> Any:
    """Ask the executors for a cached partition's Arrow IPC stream, in order; when none
    served it, ask them all again for up to ``EXECUTORS_BACK_SECONDS``."""
    started = time.monotonic()
    deadline = started + timeout
    again_until = min(deadline, started + EXECUTORS_BACK_SECONDS)
    while True:
        problems: list[str] = []
        for name in _candidates(located, index):
            left = deadline - time.monotonic()
            if left <= 0:
                problems.append(f"no time left for the others after {timeout:g} s")
                break
            ipc = _ask(name, rdd_id, index, schema_json, driver_agent_url, runtime,
                       problems, min(EXECUTOR_CALL_TIMEOUT, left))
            if ipc is not None:
                spark_pulled(runtime, fallback=name != located)
                return ipc
        if time.monotonic() + 1.0 > again_until:
            break
        logger.warning("no executor served partition %s of RDD %s (%s); asking again",
                       index, rdd_id, "; ".join(problems) or "no executor actor alive")
        time.sleep(1.0)
    raise SinkUnavailableError(
        f"no RayDP executor served partition {index} of Spark RDD {rdd_id} "
        f"({'; '.join(problems) or 'no executor actor alive'}); the Spark app master may "
        "be gone (RayDP cannot restart it). Restart Spark with init_spark() and write the "
        "epoch again", runtime=runtime or None)


UNAVAILABLE_SECONDS = 30.0
"""How long an executor whose actor did not answer (its node lost, its process
restarting) is asked last by this process."""

_unavailable: dict[str, float] = {}


def _candidates(located: str, index: int) -> Iterator[str]:
    """The located executor first; the others are listed only when it failed.

    Executors whose actor failed a call of this process lately (``_unavailable``) come
    last: after a first call to an executor on a lost node failed, Ray queues the next
    calls to it until it declares the node dead (15-20 s), so asking it first again, for
    each of its partitions, would wait for that."""
    import ray

    _forget_unavailable(time.monotonic())
    first = located not in _unavailable  # decided now: asking it may change it
    if first:
        yield located
    later = [] if first else [located]
    for name in executor_candidates(located, index, ray.util.list_named_actors())[1:]:
        if name in _unavailable:
            later.append(name)
        else:
            yield name
    yield from later


def _forget_unavailable(now: float) -> None:
    for name, since in list(_unavailable.items()):
        if now - since > UNAVAILABLE_SECONDS:
            _unavailable.pop(name, None)


def _ask(name: str, rdd_id: int, index: int, schema_json: str, driver_agent_url: str,
         runtime: str, problems: list[str], timeout: float) -> Any:
    """One executor's answer (the IPC bytes), or ``None`` with the problem recorded.

    Any failure of the call means "ask the next one": the actor is gone (``ValueError``
    from the lookup, ``RayActorError``), slow (``GetTimeoutError``), or raised in Java (a
    restarted executor that never started has no Spark environment and throws). A gone
    or slow one is also asked last for ``UNAVAILABLE_SECONDS``: an executor SIGKILLed
    while a writer pulled from it was restarted by Ray and then left each call waiting
    for the whole ``EXECUTOR_CALL_TIMEOUT``, and asking it first again for each of the
    partitions located on it stretched one epoch to 433 s (a clean-clone run). The
    handle is looked up on every pull (one GCS call): a cached one would outlive a Spark
    session restarted under the same executor names."""
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError, RayError

    try:
        actor = ray.get_actor(name)
        if runtime:
            _faults.hit("spark.mid_pull", runtime=runtime, executor=name, rdd=rdd_id,
                        partition=index)
        with cross_language_calls():
            ref: Any = actor.getRDDPartition.remote(rdd_id, index, schema_json,
                                                    driver_agent_url)
        ipc = ray.get(ref, timeout=timeout)
        _unavailable.pop(name, None)
        return ipc
    except (ValueError, RayError) as exc:
        if isinstance(exc, (RayActorError, GetTimeoutError)):
            _unavailable[name] = time.monotonic()
        problems.append(f"{name}: {type(exc).__name__}")
        logger.warning("executor %s did not serve partition %s of RDD %s (%s: %s); asking "
                       "the next", name, index, rdd_id, type(exc).__name__,
                       _first_line(exc))
        return None


def _first_line(exc: BaseException) -> str:
    lines = [line for line in str(exc).splitlines() if line.strip()]
    cause = next((line for line in lines if "Caused by" in line), None)
    return (cause or (lines[0] if lines else "")).strip()[:300]


def decode(ipc: Any, schema: pa.Schema) -> pa.Table:
    """An executor's IPC stream as a table in ``schema`` (zero-copy over the bytes)."""
    table = pa.ipc.open_stream(pa.py_buffer(ipc)).read_all()
    return conform(table, schema)


def conform(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """``table`` with exactly ``schema`` (a relabelling; no data is copied when equal)."""
    table = table.replace_schema_metadata()
    if table.schema.equals(schema):
        return table
    return table.cast(schema)


def executor_candidates(located: str, index: int, named_actors: list[str]) -> list[str]:
    """The executor actors to ask for partition ``index``, in order.

    First the actor of the executor Spark placed the partition on, then every other
    live executor, rotated by ``index`` to spread the load. Why others: a RayDP executor
    that Ray restarted keeps its actor name but registers with Spark under a new executor
    id (so later block locations name an actor that does not exist), and sometimes never
    starts at all (a call to it waits forever). Any started executor serves any
    partition: its block manager reads the block from the executor holding it, or has
    Spark re-cache the RDD when no executor does.
    """
    others = sorted(name for name in named_actors
                    if name.startswith(EXECUTOR_PREFIX) and name != located)
    if others:
        turn = index % len(others)
        others = others[turn:] + others[:turn]
    return [located, *others]


@contextmanager
def cross_language_calls() -> Iterator[None]:
    """Let this process call a Java actor's method (Ray's internal load-code-from-local).

    The flag also stops the process exporting its own remote functions to Ray (other
    workers then wait forever for their definition), so it is set only around the
    ``.remote()`` of the Java call and restored at once, under a lock: the threads of a
    writer actor pull concurrently. RayDP's own fetch task leaves it set in the pooled
    worker.
    """
    from ray._private.worker import global_worker

    worker: Any = global_worker
    with _cross_language_lock:
        before = bool(worker.load_code_from_local)
        worker.set_load_code_from_local(True)
        try:
            yield
        finally:
            worker.set_load_code_from_local(before)

