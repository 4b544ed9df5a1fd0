"""Driver side of one epoch's data: normalise, route to writers, send with credits.

``plan_arrow`` turns what the user passed to ``write_arrow`` into a ``FeedPlan``: for each
writer index, the ordered list of object refs it receives. Every sink has the same number
of writers, so writer ``k`` of every sink receives the same refs (each piece is put into
the object store once). ``send`` delivers a plan for one ``(epoch, attempt)``, keeping at
most ``credits`` unacknowledged writes per writer, then sends each writer its barrier.
"""

from __future__ import annotations

import logging
import random
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from raysink.coordinator.barrier import BarrierFlags, CheckpointBarrier
from raysink.coordinator.vnodes import Bitmap, split_by_writer
from raysink.errors import BackpressureError, ConfigError, SchemaMismatchError

__all__ = ["FeedPlan", "plan_arrow", "plan_refs", "send"]

log = logging.getLogger(__name__)

CHUNK_ROWS = 262_144
"""Unkeyed tables are cut into pieces of at most this many rows, spread over writers."""


@dataclass(kw_only=True, slots=True)
class FeedPlan:
    """Refs per writer index, in send (``seq``) order, and the epoch's row count."""

    per_writer: list[list[Any]]
    rows: int | None
    keep: list[Any] = field(default_factory=list)

    def counts(self) -> list[int]:
        return [len(refs) for refs in self.per_writer]


def _tables(data: Any) -> list[Any]:
    items = list(data) if isinstance(data, (list, tuple)) else [data]
    if not items:
        return []
    import ray

    out: list[Any] = []
    for item in items:
        if isinstance(item, pa.RecordBatch):
            out.append(pa.Table.from_batches([item]))
        elif isinstance(item, (pa.Table, ray.ObjectRef)):
            out.append(item)
        else:
            raise ConfigError(
                "write_arrow takes a pyarrow Table, RecordBatch or ObjectRef, or a list of "
                f"them; got {type(item).__name__}")
    return out


def check_schemas(tables: Sequence[pa.Table]) -> None:
    """All local tables of one epoch share one schema, else ``SchemaMismatchError``."""
    if not tables:
        return
    first = tables[0].schema
    for index, table in enumerate(tables[1:], start=1):
        if not table.schema.equals(first, check_metadata=False):
            raise SchemaMismatchError(
                f"table {index} of this epoch has schema {table.schema.to_string()!r}, "
                f"table 0 has {first.to_string()!r}; an epoch has one schema")


def check_keys(table: pa.Table, key: Sequence[str]) -> None:
    """Key columns exist and hold no nulls, else ``SchemaMismatchError``."""
    for column in key:
        if column not in table.column_names:
            raise SchemaMismatchError(
                f"routing key column {column!r} is not in the data (columns: "
                f"{table.column_names}); pass key= with existing columns")
        nulls = table.column(column).null_count
        if nulls:
            raise SchemaMismatchError(
                f"key column {column!r} holds {nulls} null values; keys must not be null")


def plan_arrow(data: Any, *, writers: int, key: Sequence[str] | None,
               bitmaps: Sequence[Bitmap]) -> FeedPlan:
    """Route local tables (split by key, or chunked round-robin) and refs to writers."""
    import ray

    items = _tables(data)
    local = [t for t in items if isinstance(t, pa.Table)]
    check_schemas(local)
    for table in local:
        if key:
            check_keys(table, key)
    per_writer: list[list[Any]] = [[] for _ in range(writers)]
    rows: int | None = sum(t.num_rows for t in local)
    turn = 0
    for item in items:
        if isinstance(item, pa.Table):
            turn = _place_table(item, per_writer, key, bitmaps, turn, ray.put)
        else:
            rows = None
            turn = _place_ref(item, per_writer, key, bitmaps, turn)
    return FeedPlan(per_writer=per_writer, rows=rows)


def plan_refs(refs: Sequence[Any], *, writers: int, key: Sequence[str] | None,
              bitmaps: Sequence[Bitmap]) -> FeedPlan:
    """Route remote tables (e.g. Spark partitions) to writers without fetching them here."""
    per_writer: list[list[Any]] = [[] for _ in range(writers)]
    turn = 0
    for ref in refs:
        turn = _place_ref(ref, per_writer, key, bitmaps, turn)
    return FeedPlan(per_writer=per_writer, rows=None, keep=list(refs))


def _place_table(table: pa.Table, per_writer: list[list[Any]], key: Sequence[str] | None,
                 bitmaps: Sequence[Bitmap], turn: int, put: Callable[[Any], Any]) -> int:
    if key:
        for index, piece in enumerate(split_by_writer(table, key, bitmaps)):
            if piece is not None and piece.num_rows:
                per_writer[index].append(put(_to_table(piece)))
        return turn
    if table.num_rows == 0:
        per_writer[turn % len(per_writer)].append(put(table))
        return turn + 1
    for offset in range(0, table.num_rows, CHUNK_ROWS):
        per_writer[turn % len(per_writer)].append(put(table.slice(offset, CHUNK_ROWS)))
        turn += 1
    return turn


def _place_ref(ref: Any, per_writer: list[list[Any]], key: Sequence[str] | None,
               bitmaps: Sequence[Bitmap], turn: int) -> int:
    if not key:
        per_writer[turn % len(per_writer)].append(ref)
        return turn + 1
    pieces = _split_remote(ref, list(key), [b.to_hex() for b in bitmaps])
    for index, piece in enumerate(pieces):
        per_writer[index].append(piece)
    return turn


def _split_remote(ref: Any, key: list[str], bitmaps_hex: list[str]) -> list[Any]:
    import ray

    task = ray.remote(_split_task).options(num_returns=len(bitmaps_hex), num_cpus=0)
    result = task.remote([ref], key, bitmaps_hex)
    return [result] if len(bitmaps_hex) == 1 else list(result)


def _split_task(refs: list[Any], key: list[str], bitmaps_hex: list[str]) -> Any:
    import ray

    table = _to_table(ray.get(refs[0]))
    check_keys(table, key)
    bitmaps = [Bitmap.from_hex(h) for h in bitmaps_hex]
    pieces = [_to_table(p) if p is not None else table.schema.empty_table()
              for p in split_by_writer(table, key, bitmaps)]
    return pieces[0] if len(pieces) == 1 else tuple(pieces)


def _to_table(piece: Any) -> pa.Table:
    if isinstance(piece, pa.RecordBatch):
        return pa.Table.from_batches([piece])
    table: pa.Table = piece
    return table


def send(
    *,
    epoch: int,
    attempt: int,
    plan: FeedPlan,
    writers: Mapping[str, Sequence[Any]],
    credits: int,
    checkpoint_id: int,
    shuffle: random.Random | None = None,
) -> list[Any]:
    """Send the plan's writes with a credit window, then every writer's barrier.

    Returns the barrier refs (each resolves once its writer got the coordinator's ack).
    Raises what a write raised (a dead actor, poisoned data) as soon as it is seen.
    """
    from ray.exceptions import PendingCallsLimitExceeded

    windows: dict[tuple[str, int], deque[Any]] = {}
    try:
        for sink, k, seq, ref in _send_order(plan, writers, shuffle):
            window = windows.setdefault((sink, k), deque())
            while len(window) >= credits:
                _settle(window.popleft())
            window.append(writers[sink][k].write.remote(epoch, attempt, seq, [ref]))
    except PendingCallsLimitExceeded as exc:
        raise BackpressureError("a writer's mailbox is full; slow down or raise credits",
                                retry_after=0.5, epoch=epoch) from exc
    for window in windows.values():
        while window:
            _settle(window.popleft())
    barrier = CheckpointBarrier(checkpoint_id, epoch, BarrierFlags.NONE)
    counts = plan.counts()
    return [handle.barrier.remote(barrier, attempt, counts[k])
            for sink, handles in writers.items() for k, handle in enumerate(handles)]


def _send_order(plan: FeedPlan, writers: Mapping[str, Sequence[Any]],
                shuffle: random.Random | None) -> list[tuple[str, int, int, Any]]:
    order = [(sink, k, seq, ref)
             for seq in range(max(plan.counts(), default=0))
             for k, refs in enumerate(plan.per_writer) if seq < len(refs)
             for sink in writers
             for ref in (refs[seq],)]
    if shuffle is not None:
        shuffle.shuffle(order)
    return order


def _settle(ref: Any) -> None:
    import ray

    ray.get(ref)
