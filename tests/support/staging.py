"""Staging an epoch on a sink by hand, as its writers would: for the sink tests."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

import pyarrow as pa

from raysink.protocol.messages import CommitRequest
from raysink.sinks.base import Manifest, Sink

__all__ = ["stage_writers", "writer_request"]


def stage_writers(sink: Sink, epoch: int,
                  per_writer: Mapping[int, Sequence[pa.RecordBatch]]
                  | Sequence[Sequence[pa.RecordBatch]],
                  attempt: int = 1) -> list[Manifest]:
    """Writer ``k`` writes its batches (``per_writer[k]``, or the k-th entry) and
    pre-commits ``(epoch, attempt)``; returns the manifests, checked to be JSON (the meta
    store keeps them so)."""
    items = per_writer.items() if isinstance(per_writer, Mapping) else enumerate(per_writer)
    manifests = []
    for writer_id, batches in items:
        writer = sink.create_writer(writer_id)
        writer.open()
        for batch in batches:
            writer.write(batch)
        manifests.append(writer.pre_commit(epoch, attempt))
        writer.close()
    json.dumps(manifests)
    return manifests


def writer_request(epoch: int, attempt: int, rows: int, *, sink: str = "main",
                   writer: int = 0) -> CommitRequest:
    """What writer ``writer`` sends the coordinator at its pre-commit of ``rows`` rows:
    for coordinator tests that play the writers (a ``MemorySink`` holding the rows)."""
    return CommitRequest(sink=sink, writer=writer, epoch=epoch, attempt=attempt,
                         manifest={"epoch": epoch, "attempt": attempt, "writer": writer,
                                   "rows": rows}, rows=rows)
