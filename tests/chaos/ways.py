"""The ways one epoch reaches a runtime in a chaos trial (``TrialSpec.via``), the stream
aside (``tests.chaos.streams``): one ``WayIn.write(rt, epoch, parts)`` call is one
driver call for the epoch, as a user makes it.

* ``arrow``: ``rt.write_arrow(parts, epoch=N)``;
* ``spark``: ``rt.write(df, epoch=N)``, the rows as a DataFrame in as many partitions as
  there are parts;
* ``foreach_batch``: ``rt.foreach_batch(df, N - 1)`` in a thread whose Spark local
  property ``sql.streaming.queryId`` holds the trial's query id, which is what the
  callback of ``writeStream.foreachBatch`` sees (the query's id stays the same across
  its restarts; a restarted query hands the same batch id again: the driver's retry);
* ``feeds``: ``rt.open_epoch(N)``: a Ray task per part but the last, which the
  trial's long-lived ``FeedProducer`` actor feeds; then ``ep.commit()``;
* ``datasink``: ``ray.data.from_arrow(parts).write_datasink(rt.datasink(epoch=N))``.

A producer-kill trial arms a ``Hold`` for one epoch (``hold_next``): one producer of
that epoch (``victim``: ``feed_task``, ``feed_actor``, ``write_task``) announces its pid
mid-feed and pauses for the killer. A producer that fails fails the attempt: the user's
next step is the commit (feeds), or Ray Data's own error (datasink), and the driver
feeds the epoch again; ``ProducerFailed`` carries that to the trial's retry loop.
"""

from __future__ import annotations

import functools
import logging
import uuid
from pathlib import Path
from typing import Any

import pyarrow as pa

from raysink import EpochReport, RaySinkError, SinkRuntime
from raysink.errors import SinkUnavailableError
from tests.chaos.producers import FeedProducer, Hold, feed_task, hold_block

__all__ = ["ProducerFailed", "WayIn"]

log = logging.getLogger(__name__)

_SPARK_SCHEMA = "id long, epoch long, feed int, payload string"
_QUERY_ID = "sql.streaming.queryId"
_PRODUCERS_SECONDS = 180.0


class ProducerFailed(Exception):
    """A producer of the epoch died or failed and the way in reports it as the user's
    own job failing (not a ``RaySinkError``): feed the epoch again."""


class WayIn:
    """One trial's way in, with what it keeps between epochs (the producer actor)."""

    def __init__(self, spec: Any, env: Any, directory: Path) -> None:
        self.via: str = spec.via
        self.spec, self.env, self.dir = spec, env, directory
        self.query_id = str(uuid.uuid4())
        self.hold: tuple[str, Hold] | None = None  # (victim, hold) for the next epoch
        self.producer_errors: list[str] = []
        self._actor: Any = None

    def hold_next(self, victim: str, marker: Path, seconds: float = 10.0) -> Hold:
        hold = Hold(marker=str(marker), seconds=seconds)
        self.hold = (victim, hold)
        return hold

    def write(self, rt: SinkRuntime, epoch: int, parts: list[pa.Table]) -> EpochReport:
        hold, self.hold = self.hold, None
        if self.via == "arrow":
            return rt.write_arrow(parts, epoch=epoch)
        if self.via in ("spark", "foreach_batch"):
            return self._spark(rt, epoch, parts)
        if self.via == "feeds":
            return self._feeds(rt, epoch, parts, hold)
        if self.via == "datasink":
            return self._datasink(rt, epoch, parts, hold)
        raise ValueError(f"no epoch-by-epoch way in {self.via!r}")

    def close(self) -> None:
        import ray

        if self._actor is not None:
            ray.kill(self._actor)
            self._actor = None

    # ------------------------------------------------------------------ Spark

    def _spark(self, rt: SinkRuntime, epoch: int, parts: list[pa.Table]) -> EpochReport:
        table = pa.concat_tables(parts)
        df = self.env.spark.createDataFrame(table.to_pandas(), schema=_SPARK_SCHEMA)
        df = df.repartition(max(1, len(parts)))
        try:
            if self.via == "spark":
                return rt.write(df, epoch=epoch)
            return self._foreach_batch(rt, df, epoch - 1)
        except SinkUnavailableError:
            # what the error tells a user after an executor died for good: restart Spark
            if self.spec.fault == "executor_kill" and self.env.restart_spark is not None:
                self.env.spark = self.env.restart_spark()
            raise

    def _foreach_batch(self, rt: SinkRuntime, df: Any, batch_id: int) -> EpochReport:
        """Called as ``foreachBatch`` calls it: this thread carries the query's id."""
        context = df.sparkSession.sparkContext
        context.setLocalProperty(_QUERY_ID, self.query_id)
        try:
            return rt.foreach_batch(df, batch_id)
        finally:
            context.setLocalProperty(_QUERY_ID, None)

    # ------------------------------------------------------------------ feeds

    def _producer(self) -> Any:
        if self._actor is None:
            self._actor = FeedProducer.remote()  # type: ignore[attr-defined]
        return self._actor

    def _feeds(self, rt: SinkRuntime, epoch: int, parts: list[pa.Table],
               hold: tuple[str, Hold] | None) -> EpochReport:
        """Tasks feed every part but the last, the producer actor the last."""

        if len(parts) == 1:
            half = parts[0].num_rows // 2
            parts = [parts[0].slice(0, half), parts[0].slice(half)]
        victim, held = hold if hold is not None else (None, None)
        retries = int(self.spec.extra.get("task_retries", 0))
        ep = rt.open_epoch(epoch)
        try:
            refs = [feed_task.options(max_retries=retries).remote(
                        ep.feed(), part, held if victim == "feed_task" and k == 0 else None)
                    for k, part in enumerate(parts[:-1])]
            refs.append(self._producer().feed.remote(
                ep.feed(), parts[-1], held if victim == "feed_actor" else None))
            failed = self._wait_producers(refs)
        except BaseException:
            ep.abort()
            raise
        report = ep.commit()
        if failed and report.committed and not report.skipped:
            log.warning("epoch %s committed although producers failed: %s", epoch, failed)
        return report

    def _wait_producers(self, refs: list[Any]) -> list[str]:
        """Each producer's outcome; the failures' names (the commit then fails)."""
        import ray

        failed: list[str] = []
        for ref in refs:
            try:
                ray.get(ref, timeout=_PRODUCERS_SECONDS)
            except ray.exceptions.GetTimeoutError:
                raise AssertionError(f"a producer did not finish within "
                                     f"{_PRODUCERS_SECONDS:g} s") from None
            except Exception as exc:
                failed.append(_describe(exc))
        self.producer_errors.extend(failed)
        return failed

    # ------------------------------------------------------------------ Ray Data

    def _datasink(self, rt: SinkRuntime, epoch: int, parts: list[pa.Table],
                  hold: tuple[str, Hold] | None) -> EpochReport:
        import ray

        dataset = ray.data.from_arrow(parts)
        if hold is not None and parts[0].num_rows:
            first = int(parts[0].column("id")[0].as_py())
            dataset = dataset.map_batches(
                functools.partial(hold_block, first_id=first, hold=hold[1]),
                batch_format="pyarrow", batch_size=None, zero_copy_batch=True)
        sink = rt.datasink(epoch=epoch)
        try:
            dataset.write_datasink(sink)
        except RaySinkError:
            raise
        except Exception as exc:
            self.producer_errors.append(_describe(exc))
            if hold is None:
                raise
            raise ProducerFailed(_describe(exc)) from exc
        assert sink.report is not None, "write_datasink returned without a report"
        return sink.report


def _describe(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200] if text else ''}"
