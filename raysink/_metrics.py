"""``ray.util.metrics`` of the actors, tagged by runtime, sink and writer; best effort.

=================================  =========  ==============================================
metric                             kind       what
=================================  =========  ==============================================
raysink_rows_written               counter    rows applied by writers
raysink_bytes_written              counter    Arrow bytes applied by writers
raysink_mailbox_depth              gauge      out-of-order messages waiting in a writer
raysink_epoch_commit_seconds       histogram  one sink's commit of one epoch
raysink_commit_retries             counter    failed sink commits, retried with backoff
raysink_backpressure_waits         counter    epoch opens that waited on max_pending_epochs
=================================  =========  ==============================================

Exported with Ray's other metrics (Prometheus through ``ray[default]``). A process where
metrics cannot be made (no Ray worker, say) records nothing and never fails.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

__all__ = ["CoordinatorMetrics", "WriterMetrics"]

log = logging.getLogger(__name__)

_COMMIT_BOUNDARIES = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]


def _make(kind: str, name: str, description: str, keys: tuple[str, ...],
          **extra: Any) -> Any:
    try:
        from ray.util import metrics

        return getattr(metrics, kind)(name, description, tag_keys=keys, **extra)
    except Exception as exc:  # metrics are best effort
        log.debug("metric %s unavailable: %s", name, exc)
        return None


class _Tagged:
    def __init__(self, tags: Mapping[str, str]) -> None:
        self._tags = dict(tags)
        self._keys = tuple(self._tags)

    def _inc(self, metric: Any, value: float, **more: str) -> None:
        if metric is not None and value:
            metric.inc(value, tags={**self._tags, **more})


class WriterMetrics(_Tagged):
    """Rows, bytes and mailbox depth of one writer actor."""

    def __init__(self, runtime: str, sink: str, writer: int) -> None:
        super().__init__({"runtime": runtime, "sink": sink, "writer": str(writer)})
        self._rows = _make("Counter", "raysink_rows_written", "rows applied by writers",
                           self._keys)
        self._bytes = _make("Counter", "raysink_bytes_written",
                            "Arrow bytes applied by writers", self._keys)
        self._depth = _make("Gauge", "raysink_mailbox_depth",
                            "out-of-order messages waiting in a writer's reorder buffer",
                            self._keys)

    def applied(self, rows: int, nbytes: int) -> None:
        self._inc(self._rows, rows)
        self._inc(self._bytes, nbytes)

    def depth(self, n: int) -> None:
        if self._depth is not None:
            self._depth.set(n, tags=self._tags)


class CoordinatorMetrics(_Tagged):
    """Commit latency and retries per sink, backpressure waits of one runtime."""

    def __init__(self, runtime: str) -> None:
        super().__init__({"runtime": runtime})
        keys = (*self._keys, "sink")
        self._commit = _make("Histogram", "raysink_epoch_commit_seconds",
                             "seconds one sink took to commit one epoch", keys,
                             boundaries=_COMMIT_BOUNDARIES)
        self._retries = _make("Counter", "raysink_commit_retries",
                              "failed sink commits (retried with backoff)", keys)
        self._waits = _make("Counter", "raysink_backpressure_waits",
                            "epoch opens that waited on max_pending_epochs", self._keys)

    def committed(self, sink: str, seconds: float) -> None:
        if self._commit is not None:
            self._commit.observe(seconds, tags={**self._tags, "sink": sink})

    def retried(self, sink: str) -> None:
        self._inc(self._retries, 1, sink=sink)

    def waited(self) -> None:
        self._inc(self._waits, 1)
