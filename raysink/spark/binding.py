"""A runtime bound to a Structured Streaming query: epoch = ``batch_id + 1 + offset``.

``rt.foreach_batch(df, batch_id)`` asks ``QueryBinding.offset_for(query_id)`` for the
offset of the query's batches. The binding lives in the meta store (the coordinator's
``epoch_source``): the same query carries on with its offset after a restart; another
query (a new checkpoint location restarts ``batch_id`` at 0) is refused unless
``epoch_offset`` re-binds the runtime on purpose (``source_offset``), since its first
batches would otherwise be skipped as already committed.

No pyspark here: the query's id is read by ``raysink.spark.write.streaming_query_id``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from raysink.errors import ConfigError
from raysink.protocol.clients import Ask, CoordinatorClient
from raysink.protocol.results import EpochSource
from raysink.reports import EpochReport

__all__ = ["QueryBinding", "source_offset"]

log = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True)
class QueryBinding:
    """The runtime's binding to one streaming query, asked of the coordinator once per
    query (``bound``: the query this driver bound last, and its offset)."""

    runtime: str
    epoch_offset: int | None
    bound: tuple[str, int] | None = None

    def offset_for(self, query_id: str, coordinator: CoordinatorClient,
                   ask: Ask) -> int:
        """Bind the runtime to ``query_id``; the epoch offset of its batches. ``ask(what,
        call)`` sends a coordinator call and waits for its answer."""
        if self.bound is not None and self.bound[0] == query_id:
            return self.bound[1]
        current = ask("epoch source", coordinator.epoch_source())
        last = ask("status", coordinator.status()).last_committed_epoch
        offset = source_offset(self.runtime, current, query_id, self.epoch_offset, last)
        source = EpochSource(kind="query", id=query_id, offset=offset)
        if source != current:
            # the targets may hold epochs this meta store does not know (a fresh store):
            # the query's batches would be skipped as committed
            ask("checking the targets' markers",
                coordinator.check_alignment("query", self.epoch_offset))
            ask("binding the epoch source", coordinator.bind_source(source))
            log.info("%s: bound to streaming query %s (epoch = batch_id + 1 + %s)",
                     self.runtime, query_id, offset)
        self.bound = (query_id, offset)
        return offset

    def written(self, batch_id: int, report: EpochReport) -> EpochReport:
        """``report`` of micro-batch ``batch_id``, logged."""
        log.info("%s: micro-batch %s -> epoch %s (%s rows, %s)", self.runtime, batch_id,
                 report.epoch, report.rows,
                 "skipped, already committed" if report.skipped else "committed")
        return report


def source_offset(runtime: str, current: EpochSource | None, query_id: str,
                  epoch_offset: int | None, last_committed: int | None) -> int:
    """The epoch offset for batches of ``query_id``, or ``ConfigError`` when binding to it
    would silently skip data (a new checkpoint location restarts ``batch_id`` at 0)."""
    if current is not None and current.kind == "query" and current.id == query_id:
        bound = current.offset
        if epoch_offset is not None and epoch_offset != bound:
            raise ConfigError(
                f"the runtime is bound to query {query_id} with epoch_offset={bound}; got "
                f"epoch_offset={epoch_offset}. Drop the option or use the bound value",
                runtime=runtime)
        return bound
    if current is None and last_committed is None:
        return epoch_offset or 0
    if epoch_offset is None:
        what = (f"query {current.id}" if current is not None and current.kind == "query"
                else "its own epoch numbering")
        raise ConfigError(
            f"this runtime is bound to {what} (last committed epoch {last_committed}) and is "
            f"now fed by query {query_id}, whose batches would be skipped as already "
            f"committed. Re-bind with SinkRuntime(..., epoch_offset={last_committed or 0}) "
            "or use another runtime name", runtime=runtime)
    if last_committed is not None and epoch_offset < last_committed:
        raise ConfigError(
            f"epoch_offset={epoch_offset} is below the last committed epoch {last_committed}: "
            f"the new query's first batches would be skipped. Use at least {last_committed}",
            runtime=runtime)
    return epoch_offset
