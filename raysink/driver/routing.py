"""Driver side of one epoch's data: normalise, route to writers, send with credits.

``plan_arrow`` turns what the user passed to ``write_arrow`` into a ``FeedPlan``: for each
writer index, the ordered list of object refs it receives. Every sink has the same number
of writers, so writer ``k`` of every sink receives the same refs (each piece is put into
the object store once). ``send`` delivers a plan for one ``(epoch, attempt)``, keeping at
most ``credits`` unacknowledged writes per writer, then sends each writer its barrier.
"""

from __future__ import annotations

import functools
import logging
import random
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from raysink import _schema
from raysink.driver.sender import Sender
from raysink.errors import ConfigError, SchemaMismatchError
from raysink.protocol.barrier import BarrierFlags, CheckpointBarrier
from raysink.protocol.clients import WriterClient
from raysink.protocol.pull import resolve
from raysink.protocol.vnodes import Bitmap, split_by_writer

__all__ = ["FeedPlan", "around", "plan_arrow", "plan_refs", "send"]

log = logging.getLogger(__name__)

CHUNK_ROWS = 262_144
"""Unkeyed tables are cut into pieces of at most this many rows, spread over writers."""

MIN_PIECE_ROWS = 4_096
"""An unkeyed table of at least ``writers * MIN_PIECE_ROWS`` rows is split so that every
writer gets a piece; a smaller one goes whole to one writer (each message costs a call)."""

DEFAULT_MAX_BATCH_BYTES = 512 * 2**20
"""The largest data message a writer takes (``SinkRuntime(max_batch_bytes=...)``)."""

DEFAULT_MAX_BUFFER_BYTES = 2**30
"""Bytes of early messages a writer's reorder buffer holds (``max_buffer_bytes``)."""


class FeedPlan:
    """The epoch's data as ``(writer index, ref)`` items, produced lazily and kept.

    A retry of the epoch replays the items already produced, then goes on consuming the
    source; so a source that yields partitions as they become fetchable is read once.
    ``owned``: the refs the plan put in the object store itself (``renew`` puts them
    again). ``movable``: no routing key placed the items, so any writer may take any of
    them (``send`` can go around a writer).
    """

    def __init__(self, items: Iterable[tuple[int, Any]], rows: int | None,
                 keep: Sequence[Any] = (), schema: pa.Schema | None = None,
                 owned: Iterable[Any] = (), movable: bool = False) -> None:
        self.rows = rows
        self.movable = movable
        self.schema = schema  # of the local tables, when there were any
        self.keep = list(keep)
        self._seen: list[tuple[int, Any]] = []
        self._source: Iterator[tuple[int, Any]] = iter(items)
        self._owned = set(owned)

    def renew(self) -> None:
        """Before a retry: put the tables this plan put itself again, under new refs.
        A writer that fetched one made a copy on its node; when that node is lost, Ray
        lists the copy until it declares the node dead, and a writer fetching from
        there waits for Ray's pull timeout (10 s). A new ref has one copy, on this
        driver's node (``ray.get`` of the old one here reads it without copying)."""
        if not self._owned:
            return
        import ray

        self._seen.extend(self._source)
        self._source = iter(())
        fresh: dict[Any, Any] = {}
        for index, (writer, ref) in enumerate(self._seen):
            if ref in self._owned:
                if ref not in fresh:
                    fresh[ref] = ray.put(ray.get(ref))
                self._seen[index] = (writer, fresh[ref])
        self._owned = set(fresh.values())

    def __iter__(self) -> Iterator[tuple[int, Any]]:
        yield from list(self._seen)
        for item in self._source:
            self._seen.append(item)
            yield item


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


def check_schemas(tables: Sequence[pa.Table], *, evolve: bool = False) -> pa.Schema | None:
    """All local tables of one epoch share one schema, else ``SchemaMismatchError``; with
    ``evolve`` (every sink has ``schema_evolution="add_columns"``) their schemas need a
    union (``raysink._schema.union``) instead. Returns the schema (the union)."""
    if not tables:
        return None
    if evolve:
        return _schema.union([t.schema for t in tables])
    first = tables[0].schema
    for index, table in enumerate(tables[1:], start=1):
        if not table.schema.equals(first, check_metadata=False):
            raise SchemaMismatchError(
                f"table {index} of this epoch has schema {table.schema.to_string()!r}, "
                f"table 0 has {first.to_string()!r}; an epoch has one schema")
    return first


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
               bitmaps: Sequence[Bitmap], max_batch_bytes: int | None = None,
               first_writer: int = 0, evolve: bool = False) -> FeedPlan:
    """Route local tables (split by key, or chunked round-robin from ``first_writer``) and
    refs to writers.

    Local tables are cut so that no piece is over ``max_batch_bytes``; a ref is checked by
    the writer that fetches it. The caller rotates ``first_writer`` between epochs, so
    epochs of one small table do not all land on writer 0. ``evolve``: the tables may
    differ in schema where every sink evolves (``check_schemas``)."""
    import ray

    items = _tables(data)
    local = [t for t in items if isinstance(t, pa.Table)]
    schema = check_schemas(local, evolve=evolve)
    for table in local:
        if key:
            check_keys(table, key)
    placed: list[tuple[int, Any]] = []
    owned: list[Any] = []

    def put(table: pa.Table) -> Any:
        owned.append(ray.put(table))
        return owned[-1]

    rows: int | None = sum(t.num_rows for t in local)
    turn = first_writer
    for item in items:
        if isinstance(item, pa.Table):
            turn = _place_table(item, placed, writers, key, bitmaps, turn, put,
                                max_batch_bytes)
        else:
            rows = None
            turn = _place_ref(item, placed, writers, key, bitmaps, turn)
    return FeedPlan(placed, rows, schema=schema, owned=owned, movable=not key)


def plan_refs(refs: Iterable[Any], *, writers: int, key: Sequence[str] | None,
              bitmaps: Sequence[Bitmap], rows: int | None = None,
              first_writer: int = 0) -> FeedPlan:
    """Route remote tables (refs, or pulls such as Spark partitions) to writers without
    fetching them here, round-robin from ``first_writer``; with a key, one split task per
    item fetches it and cuts it by writer."""

    def items() -> Iterator[tuple[int, Any]]:
        turn = first_writer
        for ref in refs:
            placed: list[tuple[int, Any]] = []
            turn = _place_ref(ref, placed, writers, key, bitmaps, turn)
            yield from placed

    return FeedPlan(items(), rows, movable=not key)


def _place_table(table: pa.Table, placed: list[tuple[int, Any]], writers: int,
                 key: Sequence[str] | None, bitmaps: Sequence[Bitmap], turn: int,
                 put: Callable[[Any], Any], max_batch_bytes: int | None) -> int:
    if key:
        for index, piece in enumerate(split_by_writer(table, key, bitmaps)):
            if piece is not None and piece.num_rows:
                for chunk in _chunks(_to_table(piece), max_batch_bytes):
                    placed.append((index, put(chunk)))
        return turn
    if table.num_rows == 0:
        placed.append((turn % writers, put(table)))
        return turn + 1
    pieces = min(writers, max(1, table.num_rows // MIN_PIECE_ROWS))
    for chunk in _chunks(table, max_batch_bytes, pieces):
        placed.append((turn % writers, put(chunk)))
        turn += 1
    return turn


def _chunks(table: pa.Table, max_batch_bytes: int | None,
            pieces: int = 1) -> Iterator[pa.Table]:
    """``table`` in at least ``pieces`` slices of at most ``CHUNK_ROWS`` rows and, by its
    average row size, at most ``max_batch_bytes`` bytes (zero-copy)."""
    rows = min(CHUNK_ROWS, -(-table.num_rows // max(pieces, 1)))
    if max_batch_bytes is not None and table.nbytes > max_batch_bytes:
        per_row = table.nbytes / max(table.num_rows, 1)
        rows = max(1, min(rows, int(max_batch_bytes / per_row)))
    for offset in range(0, table.num_rows, rows):
        yield table.slice(offset, rows)


def _place_ref(ref: Any, placed: list[tuple[int, Any]], writers: int,
               key: Sequence[str] | None, bitmaps: Sequence[Bitmap], turn: int) -> int:
    if not key:
        placed.append((turn % writers, ref))
        return turn + 1
    pieces = _split_remote(ref, list(key), [b.to_hex() for b in bitmaps])
    placed.extend(enumerate(pieces))
    return turn


def _split_remote(ref: Any, key: list[str], bitmaps_hex: list[str]) -> list[Any]:
    """One task fetches ``ref`` (or pulls it) and cuts it by writer. A pull whose source
    failed (``SinkUnavailableError``) is tried again by the task: the epoch's retries
    re-send these same pieces, so a failure kept in them would fail every attempt."""
    from raysink.errors import SinkUnavailableError

    task = _split_task_remote().options(num_returns=len(bitmaps_hex), num_cpus=0,
                                        max_retries=3,
                                        retry_exceptions=[SinkUnavailableError])
    result: Any = task.remote([ref], key, bitmaps_hex)
    return [result] if len(bitmaps_hex) == 1 else list(result)


@functools.cache
def _split_task_remote() -> Any:
    """``_split_task`` as a Ray remote function, made once per process (Ray disassembles a
    function again for each new ``ray.remote`` of it)."""
    import ray

    return ray.remote(_split_task)


def _split_task(refs: list[Any], key: list[str], bitmaps_hex: list[str]) -> Any:
    table = _to_table(resolve(refs[0]))
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
    on_rows: Callable[[int], None] | None = None,
    avoid: frozenset[int] = frozenset(),
    committed_through: int | None = None,
) -> Barriers:
    """Send the plan's writes (feed 0, the driver) with a credit window, then every
    writer's barrier.

    Returns the barriers: a ref per writer that received data (each resolves to its
    ``BarrierAck`` once it pre-committed), and the writers that received nothing.
    With ``shuffle`` the writes go in a random order (tests prove the writer's reordering).
    ``avoid``: writer indexes that get nothing (a movable plan only: their items go to the
    other writers in turn); they are idle in the attempt. ``committed_through``: an
    epoch the driver knows every sink committed, with every epoch before it (the
    barrier tells the writers, so a sink holding transactions pre-commits without asking
    the coordinator); ``None`` when it does not know.
    """
    sender = Sender(writers, epoch=epoch, attempt=attempt, credits=credits, on_rows=on_rows)
    items = around(plan, avoid, len(sender.seqs)) if plan.movable else iter(plan)
    if shuffle is None:
        for k, ref in items:
            sender.send(k, ref)
    else:
        numbered = [(sink, k, seq, ref) for k, ref in items
                    for seq in [sender.number(k)] for sink in writers]
        shuffle.shuffle(numbered)
        for sink, k, seq, ref in numbered:
            sender.send_numbered(sink, k, seq, ref)
    sender.finish()
    seqs = sender.seqs
    barrier = CheckpointBarrier(checkpoint_id, epoch, BarrierFlags.NONE)
    return Barriers(
        refs=[WriterClient(handle).barrier(barrier, attempt, seqs[k],
                                           committed_through).send()
              for handles in writers.values() for k, handle in enumerate(handles)
              if seqs[k]],
        idle=[(sink, k) for sink, handles in writers.items() for k in range(len(handles))
              if not seqs[k]])


def around(items: Iterable[tuple[int, Any]], avoid: frozenset[int],
           writers: int) -> Iterator[tuple[int, Any]]:
    """The items, those for a writer in ``avoid`` given to the other writers in turn
    (unchanged when every writer is in ``avoid``)."""
    others = [k for k in range(writers) if k not in avoid]
    turn = 0
    for k, ref in items:
        if k in avoid and others:
            k, turn = others[turn % len(others)], turn + 1
        yield k, ref


@dataclass(frozen=True, slots=True)
class Barriers:
    """The barriers sent (``refs``, one per writer that received data), and the writers
    that received nothing in the attempt (``idle``, as ``(sink, index)``): they staged
    nothing and get no barrier; the driver answers for them."""

    refs: list[Any]
    idle: list[tuple[str, int]]
