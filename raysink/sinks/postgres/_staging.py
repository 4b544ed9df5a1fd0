"""``method="staging"``: rows staged in a LOGGED table, moved at commit in one transaction.

Writers COPY into ``_raysink_stage_<hash>`` (never UNLOGGED: a crash restart empties
those, and a staged epoch may already be PENDING) under a random token; ``pre_commit``
records the token in ``_raysink_staged`` and commits. The coordinator's ``commit`` is ONE
transaction: the epoch's claim for this decision and its progress row first (a second
committer, another decision from another driver or a re-run of this one, blocks on them,
then sees the conflict and stops), then the staged rows moved with ``DELETE … RETURNING`` into
``INSERT`` (for upserts deduplicated per key, last ``(token order, _raysink_ord)`` wins,
and ``ON CONFLICT DO UPDATE``), then the token records dropped. Works on any server;
readers see each epoch at once; rows are written twice.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from raysink._faults import hit
from raysink.errors import DataLossError, SchemaMismatchError
from raysink.sinks.base import Manifest, decision_id
from raysink.sinks.postgres._evolve import commit_epoch, drop_stages, is_stage
from raysink.sinks.postgres._tables import (
    EPOCH_ROW,
    ORD_COL,
    STAGED_TABLE,
    TOKEN_COL,
    Outcome,
    PostgresManifest,
    Tables,
    claim_epoch,
    insert_progress,
    postgres_manifests,
)
from raysink.sinks.postgres._target import Target
from raysink.sinks.postgres._types import sql_module

if TYPE_CHECKING:
    import psycopg
    from psycopg import sql

__all__ = ["abort_staged", "commit_staging", "drop_staged", "record_staged"]


# --------------------------------------------------------------------------- coordinator


def _move_sql(t: Tables, columns: Sequence[str], key: Sequence[str] | None) -> sql.Composed:
    """``DELETE`` the tokens' staged rows and ``INSERT`` them (deduplicated per key, last
    ``_raysink_ord`` wins, ``ON CONFLICT DO UPDATE`` for upserts); returns the moved count."""
    s = sql_module()
    cols = s.SQL(", ").join(s.Identifier(c) for c in columns)
    ord_col = s.Identifier(ORD_COL)
    source = s.SQL("SELECT {} FROM moved").format(cols)
    conflict = s.SQL("")
    if key:
        keys = s.SQL(", ").join(s.Identifier(k) for k in key)
        source = s.SQL("SELECT DISTINCT ON ({keys}) {cols} FROM moved "
                       "ORDER BY {keys}, {token}, {ord} DESC").format(
            keys=keys, cols=cols, token=s.Identifier(TOKEN_COL), ord=ord_col)
        rest = [c for c in columns if c not in key]
        action = s.SQL("DO NOTHING") if not rest else s.SQL("DO UPDATE SET {}").format(
            s.SQL(", ").join(s.SQL("{0} = EXCLUDED.{0}").format(s.Identifier(c)) for c in rest))
        conflict = s.SQL(" ON CONFLICT ({}) {}").format(keys, action)
    query: sql.Composed = s.SQL(
        "WITH moved AS (DELETE FROM {stage} WHERE {token} = ANY(%s) RETURNING *), "
        "ins AS (INSERT INTO {target} ({cols}) {source}{conflict}) "
        "SELECT count(*) FROM moved"
    ).format(stage=t.ident(t.stage_name), token=s.Identifier(TOKEN_COL), target=t.target,
             cols=cols, source=source, conflict=conflict)
    return query


def _manifest_columns(target: Target, epoch: int,
                      manifests: Sequence[PostgresManifest]) -> list[str]:
    column_sets = {tuple(m["columns"]) for m in manifests if m.get("rows")}
    if len(column_sets) > 1:
        raise target.err(SchemaMismatchError,
                         f"writers staged different column sets: {sorted(column_sets)}", epoch)
    return list(column_sets.pop()) if column_sets else []


def commit_staging(
    target: Target, conn: psycopg.Connection[Any], epoch: int, manifests: Sequence[Manifest]
) -> Outcome:
    """One transaction: progress row first (fences a concurrent committer), the schema
    change and the writers' own stages (``add_columns``), the shared stage's rows, unstage."""
    t = target.tables()
    listed = postgres_manifests(manifests)
    staged = [m for m in listed if m.get("rows") and not m.get("evolving")]
    evolving = target.evolving or any(m.get("evolving") for m in listed)
    with conn.transaction():
        t.ensure_tables(conn)
        if not staged and not target.ensure(conn, t, manifests):
            return "unmarked"
        decision = decision_id(epoch, manifests)
        if claim_epoch(conn, t, epoch, decision) != decision:
            return "already"  # another decision holds the epoch
        if not insert_progress(conn, t, epoch, EPOCH_ROW):
            return "already"
        if evolving:
            commit_epoch(target, conn, t, epoch, manifests)
        tokens = [int(m.get("token") or 0) for m in staged]
        if staged:
            _check_target(target, conn, t, epoch)
            expected = sum(int(m["rows"]) for m in staged)
            row = conn.execute(_move_sql(t, _manifest_columns(target, epoch, staged), target.key),
                               (tokens,)).fetchone()
            moved = int(row[0]) if row else 0
            if moved != expected:
                raise target.err(DataLossError, f"staging holds {moved} of the epoch's "
                                 f"{expected} staged rows; staged data was deleted", epoch)
        _forget_staged(conn, t, epoch, tokens)
        hit("sink.mid_commit", runtime=target.runtime, sink=target.sink, epoch=epoch)
    return "committed"


def _check_target(
    target: Target, conn: psycopg.Connection[Any], t: Tables, epoch: int
) -> None:
    if t.regclass(conn, target.table):
        return
    raise target.err(DataLossError, f"target table {target.schema}.{target.table} is gone "
                     "while an epoch staged for it is being committed; restore it", epoch)


def _forget_staged(conn: psycopg.Connection[Any], t: Tables, epoch: int,
                   moved: Sequence[int]) -> None:
    """Drop the epoch's token records, and what any other attempt left staged (the
    ``moved`` tokens' rows are gone already)."""
    if t.regclass(conn, STAGED_TABLE):
        records = conn.execute(sql_module().SQL(
            "DELETE FROM {} WHERE runtime = %s AND sink = %s AND epoch = %s "
            "RETURNING stage, token").format(t.ident(STAGED_TABLE)),
            (t.runtime, t.sink, epoch)).fetchall()
        _unstage(conn, t, [r for r in records if int(r[1]) not in moved], ())


# --------------------------------------------------------------------------- writer side


def record_staged(conn: psycopg.Connection[Any], t: Tables, epoch: int, attempt: int,
                  writer: int, token: int, rows: int, stage: str) -> None:
    """Record this writer's token and stage table for ``(epoch, attempt)`` (in its staging
    transaction): the shared stage, or with ``add_columns`` its own (``_evolve``)."""
    conn.execute(sql_module().SQL(
        "INSERT INTO {} (runtime, sink, epoch, attempt, writer, stage, token, nrows) "
        "VALUES (%s, %s, %s, %s, %s, %s, %s, %s) ON CONFLICT (runtime, sink, epoch, "
        "attempt, writer) DO UPDATE SET token = EXCLUDED.token, nrows = EXCLUDED.nrows, "
        "stage = EXCLUDED.stage"
    ).format(t.ident(STAGED_TABLE)), (
        t.runtime, t.sink, epoch, attempt, writer, stage, token, rows))


def drop_staged(conn: psycopg.Connection[Any], t: Tables, epoch: int, attempt: int,
                writer: int) -> None:
    """Delete what ``writer`` staged for ``(epoch, attempt)`` and its token record."""
    if not t.regclass(conn, STAGED_TABLE):
        return
    s = sql_module()
    with conn.transaction():
        rows = conn.execute(s.SQL(
            "DELETE FROM {} WHERE runtime = %s AND sink = %s AND epoch = %s AND attempt = "
            "%s AND writer = %s RETURNING stage, token").format(t.ident(STAGED_TABLE)),
            (t.runtime, t.sink, epoch, attempt, writer)).fetchall()
        _unstage(conn, t, rows, ())


def abort_staged(conn: psycopg.Connection[Any], t: Tables, epoch: int,
                 manifests: Sequence[Manifest] | None) -> None:
    """Delete every staged row and token record of ``epoch`` (the coordinator's abort)."""
    if not t.regclass(conn, STAGED_TABLE):
        return
    with conn.transaction():
        rows = conn.execute(sql_module().SQL(
            "DELETE FROM {} WHERE runtime = %s AND sink = %s AND epoch = %s "
            "RETURNING stage, token").format(t.ident(STAGED_TABLE)),
            (t.runtime, t.sink, epoch)).fetchall()
        _unstage(conn, t, rows, postgres_manifests(manifests))


def _unstage(conn: psycopg.Connection[Any], t: Tables, records: Sequence[Any],
             manifests: Sequence[PostgresManifest]) -> None:
    """Delete the shared stage's rows of the records' (and manifests') tokens and drop
    their own stage tables (``add_columns``; names not of this sink are left alone)."""
    s = sql_module()
    own = {str(stage) for stage, _ in records if str(stage) != t.stage_name}
    own |= {str(m["evolving"]) for m in manifests if m.get("evolving")}
    drop_stages(conn, t, [name for name in sorted(own) if is_stage(name, t)])
    tokens = {int(tok) for stage, tok in records if str(stage) == t.stage_name} | {
        int(token) for m in manifests if (token := m.get("token")) is not None}
    if tokens and t.regclass(conn, t.stage_name):
        conn.execute(s.SQL("DELETE FROM {} WHERE {} = ANY(%s)").format(
            t.ident(t.stage_name), s.Identifier(TOKEN_COL)), (sorted(tokens),))
