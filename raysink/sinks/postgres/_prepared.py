"""``method="prepared"`` (the default): one transaction per writer and epoch attempt,
prepared for two-phase commit.

Writer side. Appends COPY straight into the target. Upserts go through the writer's own
UNLOGGED stage table ``_raysink_up_<hash>_<writer>``, a chunk at a time
(``UPSERT_CHUNK_ROWS``): the chunk is sorted by key in Arrow and only the last row of
each key kept (by row index: the writer applies batches in ``seq`` order, so the last
``(seq, row index)`` wins), then ``TRUNCATE`` the stage, ``COPY`` the chunk into it and
``INSERT … SELECT … ON CONFLICT (key) DO UPDATE`` into the target; a later chunk of the
epoch overwrites an earlier one. ``pre_commit`` inserts the writer's progress row
``(runtime, sink, epoch, writer)`` and runs ``PREPARE TRANSACTION
'raysink:<runtime>:<sink>:<epoch>:<attempt>:<writer>'``. Each row reaches the target once
(the stage costs no WAL), and the work happens while the data arrives, spread over the
writers' connections.

Why these choices: a TEMPORARY stage is not possible (PostgreSQL refuses to PREPARE a
transaction that touched a temporary table). UNLOGGED is safe here, unlike for the
``staging`` method: the stage only carries a chunk from COPY to the upsert inside one
transaction; a crash restart empties it, while the prepared transaction's changes to the
target are in the WAL and survive. ``TRUNCATE`` per chunk (a new empty file) rather than
``DELETE``: the rows a still-open transaction deleted stay in the heap until it ends, and
every later chunk would scan them again. Sorting by key makes the index and heap accesses
of the upsert local (about a third less server CPU per row, measured); deduplicating in
Arrow (keys compared as PostgreSQL compares them: floats' NaN = NaN, nested values as
their JSON text) keeps ``ON CONFLICT DO UPDATE`` from meeting one key twice in one
statement. Only keys of a non-deterministic collation (e.g. case-insensitive ICU), which
Arrow tells apart and PostgreSQL does not, make PostgreSQL refuse the chunk:
``SchemaMismatchError``, nothing written.

Locks, between prepared transactions and the next epoch. A prepared upsert holds its row
locks and its new index entries until ``COMMIT``/``ROLLBACK PREPARED``, and its
``TRUNCATE`` holds the writer's stage table (ACCESS EXCLUSIVE). All rows of a key reach
one writer (the routing key is within the upsert key), so the writers of one epoch never
wait for each other. A writer's next epoch waits, at its first chunk, until its previous
epoch's transaction is committed; the coordinator commits that epoch without waiting for
any writer, so this cannot deadlock, and the next epoch then sees (and overwrites) the
previous one's rows: later epochs win. After a rescale a key's new writer waits the same
way for the old one. A prepared transaction of an attempt that failed would block its
keys for good: the writer rolls it back before it takes the next attempt
(``rollback``), and the coordinator's ``abort`` and ``commit`` roll back every other
prepared transaction of the epoch (by gid prefix).

Crash points. A writer dying before ``PREPARE``: the server rolls its transaction back
(stage and target alike). After ``PREPARE``: the transaction survives the writer and a
server crash restart; the coordinator commits it (epoch PENDING) or rolls it back (attempt
aborted). The coordinator's ``commit`` first claims the epoch for its decision (a row of
``_raysink_claims``, committed on its own), then runs ``COMMIT PREPARED`` per writer (a gid
already gone with its progress row present means done), then inserts the epoch row
``(…, writer=-1)``; after a crash in between it runs again, finds its own claim and
finishes. A commit that finds another decision's claim (another driver of the runtime,
with a meta store of its own, committing the same epoch) rolls its own transactions back:
the ``COMMIT PREPARED`` calls are not one atomic step, so without the claim both
decisions' rows could land. A replayed epoch is a new attempt with new gids; the old ones
were rolled back first.

With ``schema_evolution="add_columns"`` the writers' transactions hold only their own
stage tables, never the target; after the ``COMMIT PREPARED`` calls ONE transaction
inserts the epoch row, alters the target and moves the stages in (``_evolve``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from raysink._faults import hit
from raysink.errors import DataLossError
from raysink.sinks.base import Manifest, decision_id
from raysink.sinks.postgres._evolve import commit_epoch
from raysink.sinks.postgres._tables import (
    EPOCH_ROW,
    Outcome,
    Tables,
    claim_epoch,
    gid,
    gid_prefix,
    has_progress_row,
    insert_progress,
    postgres_manifests,
)
from raysink.sinks.postgres._target import Target
from raysink.sinks.postgres._types import csv_bytes, encode_column, psycopg_module, sql_module

if TYPE_CHECKING:
    import psycopg
    import pyarrow as pa

__all__ = ["UPSERT_CHUNK_ROWS", "abort_prepared", "commit_prepared", "finish_prepared",
           "last_per_key", "prepare", "sweep_prepared", "upsert_chunk"]

UPSERT_CHUNK_ROWS = 131_072
"""Rows an upserting writer gathers before it sends them (the rest at ``pre_commit``)."""


# --------------------------------------------------------------------------- writer side


def last_per_key(table: pa.Table, key: Sequence[str], types: dict[str, str]) -> pa.Table:
    """``table`` sorted by ``key``, keeping only the last row (by index) of each key.

    Keys are compared in the form PostgreSQL receives them (``encode_column``: nested
    values as JSON text, binary as hex) and with its equality for floats (NaN = NaN), so
    two rows of one key never reach one statement."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    rows = table.num_rows
    keys = {f"k{i}": encode_column(table.column(k), types[k]) for i, k in enumerate(key)}
    keys["ord"] = pa.array(np.arange(rows, dtype=np.int64))
    order = pc.sort_indices(pa.table(keys), sort_keys=[
        *((name, "ascending") for name in keys if name != "ord"), ("ord", "descending")])
    ordered = table.take(order)
    if rows < 2:
        return ordered
    starts = np.zeros(rows, dtype=bool)
    starts[0] = True
    for name, column in keys.items():
        if name == "ord":
            continue
        starts[1:] |= _changed(column.take(order))
    if starts.all():
        return ordered
    return ordered.filter(pa.array(starts))


def _changed(column: Any) -> Any:
    """Where each value of a sorted key column differs from the one before, in
    PostgreSQL's sense of equal (a NaN equals a NaN; -0.0 equals 0.0, as in Arrow)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    rows = len(column)
    after, before = column.slice(1), column.slice(0, rows - 1)
    changed = pc.not_equal(after, before)
    if pa.types.is_floating(column.type):
        both_nan = pc.and_(pc.is_nan(after), pc.is_nan(before))
        changed = pc.and_(changed, pc.invert(both_nan))
    return np.asarray(changed.to_numpy(zero_copy_only=False), dtype=bool)


def upsert_chunk(conn: psycopg.Connection[Any], t: Tables, writer: int, chunk: pa.Table,
                 types: dict[str, str], key: Sequence[str]) -> None:
    """Upsert one chunk through the writer's stage, inside the open transaction."""
    s = sql_module()
    rows = last_per_key(chunk, key, types)
    columns = list(rows.schema.names)
    stage = t.ident(t.upsert_stage(writer))
    cols = s.SQL(", ").join(s.Identifier(c) for c in columns)
    conn.execute(s.SQL("TRUNCATE {}").format(stage))
    with conn.cursor().copy(s.SQL("COPY {} ({}) FROM STDIN (FORMAT csv)").format(
            stage, cols)) as copy:
        copy.write(csv_bytes(rows, types, {}))
    conn.execute(_upsert_sql(t, stage, columns, key))


def _upsert_sql(t: Tables, stage: Any, columns: Sequence[str],
                key: Sequence[str]) -> Any:
    s = sql_module()
    cols = s.SQL(", ").join(s.Identifier(c) for c in columns)
    keys = s.SQL(", ").join(s.Identifier(k) for k in key)
    rest = [c for c in columns if c not in key]
    action = s.SQL("DO NOTHING") if not rest else s.SQL("DO UPDATE SET {}").format(
        s.SQL(", ").join(s.SQL("{0} = EXCLUDED.{0}").format(s.Identifier(c)) for c in rest))
    return s.SQL("INSERT INTO {target} ({cols}) SELECT {cols} FROM {stage} "
                 "ON CONFLICT ({keys}) {action}").format(
        target=t.target, cols=cols, stage=stage, keys=keys, action=action)


def prepare(conn: psycopg.Connection[Any], t: Tables, epoch: int, attempt: int,
            writer: int) -> str:
    """Add this writer's progress row and ``PREPARE TRANSACTION``; the transaction
    survives crashes until the coordinator's ``COMMIT PREPARED``. Returns the gid."""
    s = sql_module()
    insert_progress(conn, t, epoch, writer)
    txid = gid(t.runtime, t.sink, epoch, attempt, writer)
    conn.execute(s.SQL("PREPARE TRANSACTION {}").format(s.Literal(txid)))
    return txid


# --------------------------------------------------------------------------- coordinator


def _prepared_gids(conn: psycopg.Connection[Any], prefix: str) -> list[str]:
    rows = conn.execute(
        "SELECT gid FROM pg_prepared_xacts WHERE starts_with(gid, %s) AND database = "
        "current_database()", (prefix,)).fetchall()
    return [str(r[0]) for r in rows]


def finish_prepared(conn: psycopg.Connection[Any], verb: str, txid: str) -> bool:
    """``COMMIT PREPARED`` / ``ROLLBACK PREPARED``; ``False`` when the gid no longer exists
    (another committer finished it, or it was never prepared). Waits while it is busy."""
    psycopg = psycopg_module()
    s = sql_module()
    for _ in range(600):
        try:
            conn.execute(s.SQL(verb + " PREPARED {}").format(s.Literal(txid)))
            return True
        except psycopg.errors.UndefinedObject:
            return False
        except psycopg.errors.ObjectInUse:
            time.sleep(0.05)
    raise TimeoutError(f"prepared transaction {txid!r} stayed busy")


def commit_prepared(
    target: Target, conn: psycopg.Connection[Any], epoch: int, manifests: Sequence[Manifest]
) -> Outcome:
    """Claim the epoch, ``COMMIT PREPARED`` per writer, then the epoch row; stale attempts
    are rolled back. Another decision's claim: this one's transactions are rolled back."""
    t = target.tables()
    listed = postgres_manifests(manifests)
    if has_progress_row(conn, t, epoch, EPOCH_ROW):
        sweep_prepared(conn, t, epoch, keep=())
        return "already"
    decision = decision_id(epoch, manifests)
    with conn.transaction():
        # not waiting for its WAL flush: the first COMMIT PREPARED (or the epoch row)
        # flushes the WAL past it; a crash before that loses the claim, but nothing moved
        conn.execute("SET LOCAL synchronous_commit = off")
        t.ensure_tables(conn)
        holder = claim_epoch(conn, t, epoch, decision)
    if holder != decision:
        abort_prepared(conn, t, epoch, manifests)  # only this decision's: the other's
        return "already"                           # may not be committed yet
    for m in listed:
        if m.get("gid") and not finish_prepared(conn, "COMMIT", str(m["gid"])) \
                and not has_progress_row(conn, t, epoch, int(m["writer"])):
            raise target.err(DataLossError, f"prepared transaction {m['gid']!r} is gone and "
                             "its rows were never committed (rolled back outside raysink?)",
                             epoch)
    hit("sink.mid_commit", runtime=target.runtime, sink=target.sink, epoch=epoch)
    with conn.transaction():
        if not target.ensure(conn, t, manifests):
            return "unmarked"
        inserted = insert_progress(conn, t, epoch, EPOCH_ROW)
        if inserted and (target.evolving or any(m.get("evolving") for m in listed)):
            commit_epoch(target, conn, t, epoch, manifests)
    sweep_prepared(conn, t, epoch, keep=())
    return "committed" if inserted else "already"


def sweep_prepared(conn: psycopg.Connection[Any], t: Tables, epoch: int,
                   keep: Sequence[str]) -> None:
    """Roll back this sink's prepared transactions of ``epoch`` not in ``keep`` (stale
    attempts, zombie writers): after a commit they can only hold locks."""
    for txid in _prepared_gids(conn, gid_prefix(t.runtime, t.sink, epoch)):
        if txid not in keep:
            finish_prepared(conn, "ROLLBACK", txid)


def abort_prepared(conn: psycopg.Connection[Any], t: Tables, epoch: int,
                   manifests: Sequence[Manifest] | None) -> None:
    """Roll back the epoch's prepared transactions: the manifests' gids, or (``None``)
    every one of this sink's epoch."""
    if manifests is None:
        sweep_prepared(conn, t, epoch, keep=())
        return
    for m in postgres_manifests(manifests):
        if m.get("gid"):
            finish_prepared(conn, "ROLLBACK", str(m["gid"]))
