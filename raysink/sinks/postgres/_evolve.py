"""``schema_evolution="add_columns"``: rows through the writer's own stage table, the
schema change and the rows in ONE commit transaction.

Why a stage. ``ALTER TABLE … ADD COLUMN`` (and ``ALTER COLUMN … TYPE``) takes an ACCESS
EXCLUSIVE lock on the target. A writer transaction that COPYed into the target holds a
ROW EXCLUSIVE lock on it until it ends, and in ``method="prepared"`` it ends only at the
coordinator's ``COMMIT PREPARED``, after the epochs before it: an ``ALTER`` of epoch N
would wait for a prepared transaction of epoch N+1 that waits for epoch N. So with
``add_columns`` a writer never touches the target: each segment (what it writes between
two pre-commits) goes into its own LOGGED table ``_raysink_ev_<hash>_<token>`` (the
row order in ``_raysink_ord``), created in the writer's transaction with the columns of
its batches (their union, in the types the target holds where those are wider; a new
batch adds columns or widens the stage's own). ``pre_commit`` ends that transaction as
the method does (``PREPARE TRANSACTION`` or ``COMMIT`` with a record in
``_raysink_staged``); the manifest names the stage (``evolving``) and the schema the writer
wrote.

The commit, both methods: after ``COMMIT PREPARED`` of each writer (``prepared``: the
stages become visible, the target is untouched), ONE transaction inserts the epoch's
progress row, applies the change to the target (``ALTER TABLE … ADD COLUMN IF NOT EXISTS``
for new columns, ``ALTER COLUMN … TYPE`` for widened ones: the epoch's schema, the union
of its writers', evolving the table's), moves every stage's rows in (upserts: the last row
per key by ``_raysink_ord``, ``ON CONFLICT DO UPDATE`` of the stage's columns) and drops
the stages. A reader sees the old schema without the epoch's rows or the new schema with
all of them; a crash before the ``COMMIT`` leaves the stages for the re-run. The price:
rows are written twice (as in ``method="staging"``), and, as there, only the checks made
at the write (types, a NOT NULL column left out or holding nulls) refuse bad rows before
the epoch is decided: a unique, check or foreign-key constraint of the target meets the
rows at the commit, which then fails and is retried (the sink stalls, saying why) until
the target is fixed.

Types: a column is stored as ``arrow_to_postgres_type`` says; PostgreSQL widens
``smallint`` to ``integer`` to ``bigint``, ``real`` to ``double precision`` and a
``numeric``'s precision (same scale). A column the table holds in a type this module does
not map to Arrow is accepted where the data's type writes into it (as without evolution)
and refused otherwise, naming the column.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from raysink import _schema
from raysink.errors import DataLossError, MetaStoreError, SchemaMismatchError
from raysink.sinks.base import Manifest
from raysink.sinks.postgres._tables import ORD_COL, Tables, postgres_manifests
from raysink.sinks.postgres._target import Target
from raysink.sinks.postgres._types import (
    arrow_to_postgres_type,
    as_arrow,
    compatible,
    csv_bytes,
    pg_type,
    sql_module,
)

if TYPE_CHECKING:
    import psycopg

__all__ = ["EVOLVE_PREFIX", "Stage", "check_nulls", "commit_epoch", "drop_stages", "is_stage",
           "required_columns", "stage_name", "table_schema"]

EVOLVE_PREFIX = "_raysink_ev_"

# --------------------------------------------------------------------------- types


def table_schema(columns: Mapping[str, str], incoming: pa.Schema, table_rules: _schema.Rules,
                 where: Mapping[str, Any], required: Collection[str] = ()) -> pa.Schema:
    """The table's columns (``format_type`` names) as Arrow types, for ``_schema.evolve``
    against ``incoming``: a column stored as the data's type is the data's type; one of a
    type mapped to Arrow that the data's widens or narrows is that type (``evolve``
    decides); any other is the data's type where the data writes into it as without
    evolution (``compatible``), else a ``SchemaMismatchError`` naming it. The ``required``
    columns (NOT NULL without a default) are not nullable, so leaving one out is refused."""
    fields = []
    for name, existing in columns.items():
        index = incoming.get_field_index(name)
        mapped = as_arrow(existing)
        if index < 0:
            fields.append(pa.field(name, mapped if mapped is not None else pa.null(),
                                   nullable=name not in required))
            continue
        data = incoming.field(index)
        if pg_type(data) == existing:
            fields.append(pa.field(name, data.type))
        elif mapped is not None and (_schema.lossless(mapped, data.type)
                                     or _schema.lossless(data.type, mapped)):
            fields.append(pa.field(name, mapped))
        elif compatible(existing, pg_type(data)):
            fields.append(pa.field(name, data.type))
        else:
            raise SchemaMismatchError(
                f"column {name!r} is {data.type} ({pg_type(data)}) in the data and "
                f"{existing} in {table_rules.target}; that is not a lossless widening, so it "
                f"is refused even with schema_evolution='add_columns'; cast the column to a "
                f"type stored as {existing}", column=name, **where)
    return pa.schema(fields)


def required_columns(conn: psycopg.Connection[Any], t: Tables) -> set[str]:
    """The target's columns that must be set: NOT NULL without a default."""
    rows = conn.execute(
        "SELECT a.attname FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid "
        "JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = %s AND "
        "c.relname = %s AND a.attnum > 0 AND NOT a.attisdropped AND a.attnotnull "
        "AND NOT a.atthasdef AND a.attidentity = '' AND a.attgenerated = ''",
        (t.schema, t.table)).fetchall()
    return {str(r[0]) for r in rows}


def check_nulls(batch: pa.RecordBatch, required: Collection[str],
                where: Mapping[str, Any]) -> None:
    """A null in a NOT NULL column is refused at the write (the commit would fail)."""
    for name in batch.schema.names:
        if name in required and batch.column(name).null_count:
            raise SchemaMismatchError(
                f"column {name!r} holds {batch.column(name).null_count} null values and the "
                "table holds it NOT NULL; set every value", column=name, **where)


# --------------------------------------------------------------------------- stages


def stage_name(t: Tables, token: int) -> str:
    """The stage of one writer segment: ``_raysink_ev_<hash of target and sink>_<token>``."""
    return f"{EVOLVE_PREFIX}{_digest(t)}_{token:x}"


def _digest(t: Tables) -> str:
    return hashlib.sha1(f"{t.schema}.{t.table}|{t.runtime}|{t.sink}".encode()).hexdigest()[:16]


class Stage:
    """One writer segment's stage table, on the writer's connection: created at the
    segment's first batch, its columns widened and added as later batches need."""

    def __init__(self, t: Tables, token: int) -> None:
        self.t = t
        self.name = stage_name(t, token)
        self.schema: pa.Schema | None = None
        self.rows = 0

    def write(self, conn: psycopg.Connection[Any], batch: pa.RecordBatch) -> None:
        """COPY ``batch`` (already in the stage's types where it is narrower) into the
        stage, after creating or altering it for the batch's columns."""
        s = sql_module()
        self._fit(conn, batch.schema)
        assert self.schema is not None
        types = {f.name: arrow_to_postgres_type(f.name, f.type) for f in batch.schema}
        order = pa.array(range(self.rows, self.rows + batch.num_rows), pa.int64())
        columns = [ORD_COL, *batch.schema.names]
        copy = s.SQL("COPY {} ({}) FROM STDIN (FORMAT csv)").format(
            self.t.ident(self.name), s.SQL(", ").join(s.Identifier(c) for c in columns))
        with conn.cursor().copy(copy) as cp:
            cp.write(csv_bytes(batch, types, {ORD_COL: order}))
        self.rows += batch.num_rows

    def _fit(self, conn: psycopg.Connection[Any], schema: pa.Schema) -> None:
        s = sql_module()
        ident = self.t.ident(self.name)
        if self.schema is None:
            columns = [s.SQL("{} bigint NOT NULL").format(s.Identifier(ORD_COL))]
            columns += [s.SQL("{} {}").format(s.Identifier(f.name), s.SQL(pg_type(f)))
                        for f in schema]
            conn.execute(s.SQL("CREATE TABLE {} ({})").format(ident, s.SQL(", ").join(columns)))
            self.schema = schema
            return
        union = _schema.union([self.schema, schema])
        changes = [s.SQL("ADD COLUMN {} {}").format(s.Identifier(f.name), s.SQL(pg_type(f)))
                   for f in union if f.name not in self.schema.names]
        changes += [s.SQL("ALTER COLUMN {} TYPE {}").format(s.Identifier(f.name),
                                                            s.SQL(pg_type(f)))
                    for f in union if f.name in self.schema.names
                    and pg_type(f) != pg_type(self.schema.field(f.name))]
        if changes:
            conn.execute(s.SQL("ALTER TABLE {} {}").format(ident, s.SQL(", ").join(changes)))
        self.schema = union


def stages_of(manifests: Sequence[Manifest], t: Tables, where: Mapping[str, Any]
              ) -> list[tuple[str, int]]:
    """``(stage, rows)`` of every manifest with a stage; a name that is not a stage of this
    sink is refused (``MetaStoreError``), never followed."""
    found = []
    for m in postgres_manifests(manifests):
        name = m.get("evolving")
        if name is None:
            continue
        check_stage(str(name), t, where)
        found.append((str(name), int(m.get("rows") or 0)))
    return found


def is_stage(name: str, t: Tables) -> bool:
    """Whether ``name`` is a stage table of this sink (``stage_name``)."""
    return re.fullmatch(f"{EVOLVE_PREFIX}{_digest(t)}_[0-9a-f]+", name) is not None


def check_stage(name: str, t: Tables, where: Mapping[str, Any]) -> None:
    if not is_stage(name, t):
        raise MetaStoreError(f"manifest names {name!r}, which is not a stage table of this "
                             "sink; refused, not followed", **where)


# --------------------------------------------------------------------------- commit


def alter_target(conn: psycopg.Connection[Any], t: Tables, schema: pa.Schema,
                 table_rules: _schema.Rules, where: Mapping[str, Any]) -> _schema.Evolution:
    """Evolve the target to take ``schema`` (the epoch's): one ``ALTER TABLE`` adding the
    new columns and widening the wider ones, in the caller's transaction."""
    current = table_schema(t.columns(conn), schema, table_rules, where)
    evolution = _schema.evolve(current, schema, table_rules, where=where)
    if evolution.changed:
        s = sql_module()
        changes = [s.SQL("ADD COLUMN IF NOT EXISTS {} {}").format(
            s.Identifier(n), s.SQL(pg_type(schema.field(n)))) for n in evolution.added]
        changes += [s.SQL("ALTER COLUMN {} TYPE {}").format(
            s.Identifier(n), s.SQL(pg_type(schema.field(n)))) for n in evolution.widened]
        conn.execute(s.SQL("ALTER TABLE {} {}").format(t.target, s.SQL(", ").join(changes)))
    return evolution


def move_stage(conn: psycopg.Connection[Any], t: Tables, stage: str,
               key: Sequence[str] | None) -> int:
    """Insert a stage's rows into the target (upserts: the last row per key by row order)
    and drop the stage; returns how many rows it held."""
    s = sql_module()
    names = [c for c in _stage_columns(conn, t, stage) if c != ORD_COL]
    cols = s.SQL(", ").join(s.Identifier(c) for c in names)
    ident = t.ident(stage)
    row = conn.execute(s.SQL("SELECT count(*) FROM {}").format(ident)).fetchone()
    held = int(row[0]) if row else 0
    if key:
        keys = s.SQL(", ").join(s.Identifier(k) for k in key)
        rest = [c for c in names if c not in key]
        action = s.SQL("DO NOTHING") if not rest else s.SQL("DO UPDATE SET {}").format(
            s.SQL(", ").join(s.SQL("{0} = EXCLUDED.{0}").format(s.Identifier(c))
                             for c in rest))
        conn.execute(s.SQL(
            "INSERT INTO {target} ({cols}) SELECT DISTINCT ON ({keys}) {cols} FROM {stage} "
            "ORDER BY {keys}, {ord} DESC ON CONFLICT ({keys}) {action}").format(
                target=t.target, cols=cols, keys=keys, stage=ident,
                ord=s.Identifier(ORD_COL), action=action))
    else:
        conn.execute(s.SQL("INSERT INTO {} ({}) SELECT {} FROM {} ORDER BY {}").format(
            t.target, cols, cols, ident, s.Identifier(ORD_COL)))
    conn.execute(s.SQL("DROP TABLE {}").format(ident))
    return held


def _stage_columns(conn: psycopg.Connection[Any], t: Tables, stage: str) -> list[str]:
    rows = conn.execute(
        "SELECT a.attname FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid "
        "JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = %s AND "
        "c.relname = %s AND a.attnum > 0 AND NOT a.attisdropped ORDER BY a.attnum",
        (t.schema, stage)).fetchall()
    return [str(r[0]) for r in rows]


def drop_stages(conn: psycopg.Connection[Any], t: Tables, names: Sequence[str]) -> None:
    """Drop stage tables (gone already is fine)."""
    s = sql_module()
    for name in names:
        conn.execute(s.SQL("DROP TABLE IF EXISTS {}").format(t.ident(name)))


def commit_epoch(target: Target, conn: psycopg.Connection[Any], t: Tables, epoch: int,
                 manifests: Sequence[Manifest]) -> None:
    """Inside the commit transaction, after the epoch's progress row: evolve the target to
    the epoch's schema, then move every writer's stage in (manifest order) and drop it. A
    stage gone, or holding another number of rows than its manifest says, is a
    ``DataLossError``: its rows were deleted outside raysink."""
    where = target.where(epoch)
    schema = _schema.united(manifests, where=where)
    if schema is not None:
        alter_target(conn, t, schema, target.evolution_rules(), where)
    for stage, rows in stages_of(manifests, t, where):
        held = move_stage(conn, t, stage, target.key) if t.regclass(conn, stage) else None
        if held != rows:
            raise target.err(DataLossError, f"stage table {stage} holds "
                             f"{'nothing' if held is None else held} of the {rows} rows "
                             "staged for the epoch; it was changed outside raysink", epoch)
