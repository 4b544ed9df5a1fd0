"""raysink's tables beside a PostgreSQL target and their names: the progress rows (the
marker), the claims, the token records of ``method="staging"`` and the stage tables
(``Tables``); prepared-transaction ids (``gid``); what a PostgreSQL writer's manifest holds
(``PostgresManifest``).
"""

from __future__ import annotations

import hashlib
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, cast

from raysink.sinks._format import MARKER_FORMAT
from raysink.sinks.base import Manifest
from raysink.sinks.postgres._types import sql_module

if TYPE_CHECKING:
    import psycopg
    from psycopg import sql

__all__ = ["CLAIMS_TABLE", "EPOCH_ROW", "ORD_COL", "PROGRESS_TABLE", "STAGED_TABLE",
           "TOKEN_COL", "Method", "Outcome", "PostgresManifest", "Tables", "claim_epoch",
           "claimed", "dsn_field", "gid", "gid_prefix", "has_epoch_rows", "has_progress_row",
           "insert_progress", "postgres_manifests", "redact_dsn"]

Method = Literal["staging", "prepared"]
Outcome = Literal["committed", "already", "unmarked"]
"""What one commit did: made the epoch visible now, found it there, or found no target
and nothing to create one with (an empty epoch nobody saw a schema for: nothing written)."""

PROGRESS_TABLE = "_raysink_progress"
STAGED_TABLE = "_raysink_staged"
CLAIMS_TABLE = "_raysink_claims"
"""One row per committed (or committing) epoch of a sink: the decision that holds it
(``raysink.sinks.base.decision_id``)."""
EPOCH_ROW = -1
"""``writer`` value of the row that marks a whole epoch committed."""
TOKEN_COL = "_raysink_token"
ORD_COL = "_raysink_ord"


class PostgresManifest(Manifest, total=False):
    """What one PostgreSQL writer staged for one epoch attempt: its commit method, the
    epoch's columns and their types, and what it staged: a token (``staging``) or a
    prepared transaction (``prepared``); with ``schema_evolution="add_columns"`` its own
    stage table holding every row it wrote in the attempt (``evolving``)."""

    method: str
    columns: list[str]
    types: dict[str, str] | None
    token: int | None
    gid: str | None
    evolving: str | None


def postgres_manifests(manifests: Sequence[Manifest] | None) -> Sequence[PostgresManifest]:
    """The manifests the coordinator hands a PostgreSQL sink back, as its writers made them."""
    return cast("Sequence[PostgresManifest]", manifests or ())


# --------------------------------------------------------------------------- names


def _quote_name(value: str) -> str:
    return urllib.parse.quote(value, safe="")


def gid_prefix(runtime: str, sink: str, epoch: int) -> str:
    """Prefix of every prepared-transaction id of one sink's epoch (names percent-encoded,
    so ``:`` inside a name cannot collide with another sink)."""
    names = f"{_quote_name(runtime)}:{_quote_name(sink)}"
    if len(names) > 120:
        names = "h" + hashlib.sha1(names.encode()).hexdigest()
    return f"raysink:{names}:{epoch}:"


def gid(runtime: str, sink: str, epoch: int, attempt: int, writer: int) -> str:
    """The prepared-transaction id ``raysink:<runtime>:<sink>:<epoch>:<attempt>:<writer>``."""
    return f"{gid_prefix(runtime, sink, epoch)}{attempt}:{writer}"


def _stage_table(schema: str, table: str) -> str:
    digest = hashlib.sha1(f"{schema}.{table}".encode()).hexdigest()[:16]
    return f"_raysink_stage_{digest}"


def redact_dsn(dsn: str) -> str:
    """``dsn`` without its password (key=value or URI form)."""
    from psycopg.conninfo import conninfo_to_dict, make_conninfo

    try:
        params = conninfo_to_dict(dsn)
    except Exception:
        return "<unparseable dsn>"
    if "password" in params:
        params["password"] = "***"
    return str(make_conninfo("", **params))


def dsn_field(dsn: str, key: str) -> str | None:
    from psycopg.conninfo import conninfo_to_dict

    try:
        value = conninfo_to_dict(dsn).get(key)
    except Exception:
        return None
    return None if value is None else str(value)


# --------------------------------------------------------------------------- the tables


@dataclass(frozen=True, kw_only=True, slots=True)
class Tables:
    """Quoted names of one sink's tables; built from plain strings, composed with Identifier."""

    schema: str
    table: str
    runtime: str
    sink: str

    def ident(self, name: str) -> sql.Composed:
        return sql_module().Identifier(self.schema, name)  # type: ignore[no-any-return]

    @property
    def target(self) -> sql.Composed:
        return self.ident(self.table)

    @property
    def stage_name(self) -> str:
        """The shared LOGGED stage of ``method="staging"``."""
        return _stage_table(self.schema, self.table)

    def upsert_stage(self, writer: int) -> str:
        """Writer ``writer``'s UNLOGGED stage for upserts in ``method="prepared"``; one per
        (target, runtime, sink, writer), so no other writer waits for its lock."""
        digest = hashlib.sha1(
            f"{self.schema}.{self.table}|{self.runtime}|{self.sink}".encode()).hexdigest()[:16]
        return f"_raysink_up_{digest}_{writer}"

    def regclass(self, conn: psycopg.Connection[Any], name: str) -> bool:
        """Whether ``schema.name`` exists (a read-only catalog lookup)."""
        literal = self.ident(name).as_string(conn)
        row = conn.execute("SELECT to_regclass(%s) IS NOT NULL", (literal,)).fetchone()
        return bool(row and row[0])

    def lock(self, conn: psycopg.Connection[Any]) -> None:
        """Serialise DDL on this schema's raysink tables inside the current transaction."""
        conn.execute(
            "SELECT pg_advisory_xact_lock(hashtext(%s))", (f"raysink-ddl:{self.schema}",)
        )

    def ensure_progress(self, conn: psycopg.Connection[Any]) -> None:
        s = sql_module()
        conn.execute(s.SQL(
            "CREATE TABLE IF NOT EXISTS {} (runtime text NOT NULL, sink text NOT NULL, "
            "epoch bigint NOT NULL, writer integer NOT NULL, "
            "committed_at timestamptz NOT NULL DEFAULT now(), "
            f"format integer NOT NULL DEFAULT {int(MARKER_FORMAT)}, "
            "PRIMARY KEY (runtime, sink, epoch, writer))"
        ).format(self.ident(PROGRESS_TABLE)))

    def ensure_claims(self, conn: psycopg.Connection[Any]) -> None:
        conn.execute(sql_module().SQL(
            "CREATE TABLE IF NOT EXISTS {} (runtime text NOT NULL, sink text NOT NULL, "
            "epoch bigint NOT NULL, decision text NOT NULL, "
            "claimed_at timestamptz NOT NULL DEFAULT now(), "
            "PRIMARY KEY (runtime, sink, epoch))"
        ).format(self.ident(CLAIMS_TABLE)))

    def ensure_tables(self, conn: psycopg.Connection[Any]) -> None:
        """The progress and claims tables, created (under the DDL lock) when missing."""
        if not (self.regclass(conn, PROGRESS_TABLE) and self.regclass(conn, CLAIMS_TABLE)):
            self.lock(conn)
            self.ensure_progress(conn)
            self.ensure_claims(conn)

    def ensure_staged(self, conn: psycopg.Connection[Any]) -> None:
        s = sql_module()
        conn.execute(s.SQL(
            "CREATE TABLE IF NOT EXISTS {} (runtime text NOT NULL, sink text NOT NULL, "
            "epoch bigint NOT NULL, attempt integer NOT NULL, writer integer NOT NULL, "
            "stage text NOT NULL, token bigint NOT NULL, nrows bigint NOT NULL, "
            "PRIMARY KEY (runtime, sink, epoch, attempt, writer))"
        ).format(self.ident(STAGED_TABLE)))

    def ensure_stage(self, conn: psycopg.Connection[Any]) -> None:
        """The LOGGED staging table: token, order, then the target's columns and defaults."""
        s = sql_module()
        conn.execute(s.SQL(
            "CREATE TABLE IF NOT EXISTS {} ({} bigint NOT NULL, {} bigint NOT NULL, "
            "LIKE {} INCLUDING DEFAULTS)"
        ).format(self.ident(self.stage_name), s.Identifier(TOKEN_COL),
                 s.Identifier(ORD_COL), self.target))

    def ensure_upsert_stage(self, conn: psycopg.Connection[Any], writer: int) -> None:
        """Writer ``writer``'s UNLOGGED upsert stage: the target's columns and defaults."""
        conn.execute(sql_module().SQL(
            "CREATE UNLOGGED TABLE IF NOT EXISTS {} (LIKE {} INCLUDING DEFAULTS)"
        ).format(self.ident(self.upsert_stage(writer)), self.target))

    def has_progress(self, conn: psycopg.Connection[Any]) -> bool:
        """Whether the progress table records any epoch of this sink."""
        if not self.regclass(conn, PROGRESS_TABLE):
            return False
        row = conn.execute(sql_module().SQL(
            "SELECT EXISTS (SELECT 1 FROM {} WHERE runtime = %s AND sink = %s)"
        ).format(self.ident(PROGRESS_TABLE)), (self.runtime, self.sink)).fetchone()
        return bool(row and row[0])

    def columns(self, conn: psycopg.Connection[Any]) -> dict[str, str]:
        """The target's writable columns and their types (``format_type``)."""
        rows = conn.execute(
            "SELECT a.attname, format_type(a.atttypid, a.atttypmod) FROM pg_attribute a "
            "JOIN pg_class c ON c.oid = a.attrelid JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE n.nspname = %s AND c.relname = %s AND a.attnum > 0 AND NOT a.attisdropped "
            "AND a.attgenerated = '' ORDER BY a.attnum",
            (self.schema, self.table),
        ).fetchall()
        return {str(name): str(pg_type) for name, pg_type in rows}

    def create_target(
        self, conn: psycopg.Connection[Any], types: dict[str, str], key: Sequence[str] | None
    ) -> None:
        s = sql_module()
        cols = [s.SQL("{} {}").format(s.Identifier(n), s.SQL(t)) for n, t in types.items()]
        if key:
            cols.append(s.SQL("PRIMARY KEY ({})").format(
                s.SQL(", ").join(s.Identifier(k) for k in key)))
        conn.execute(s.SQL("CREATE TABLE IF NOT EXISTS {} ({})").format(
            self.target, s.SQL(", ").join(cols)))


# --------------------------------------------------------------------------- progress rows


def insert_progress(conn: psycopg.Connection[Any], t: Tables, epoch: int, writer: int) -> bool:
    """Insert one progress row; ``False`` when it was already there (after waiting for a
    concurrent inserter to finish)."""
    row = conn.execute(sql_module().SQL(
        "INSERT INTO {} (runtime, sink, epoch, writer) VALUES (%s, %s, %s, %s) "
        "ON CONFLICT DO NOTHING RETURNING 1"
    ).format(t.ident(PROGRESS_TABLE)), (t.runtime, t.sink, epoch, writer)).fetchone()
    return row is not None


def claim_epoch(conn: psycopg.Connection[Any], t: Tables, epoch: int, decision: str) -> str:
    """Claim ``epoch`` for ``decision`` (the claims table must exist); returns the decision
    that holds it now: ``decision``, or the one that claimed it first (a concurrent claim
    waits for the first to end)."""
    s = sql_module()
    conn.execute(s.SQL(
        "INSERT INTO {} (runtime, sink, epoch, decision) VALUES (%s, %s, %s, %s) "
        "ON CONFLICT DO NOTHING").format(t.ident(CLAIMS_TABLE)),
        (t.runtime, t.sink, epoch, decision))
    holder = claimed(conn, t, epoch)
    assert holder is not None
    return holder


def claimed(conn: psycopg.Connection[Any], t: Tables, epoch: int) -> str | None:
    """The decision that claimed ``epoch``, or ``None``."""
    if not t.regclass(conn, CLAIMS_TABLE):
        return None
    row = conn.execute(sql_module().SQL(
        "SELECT decision FROM {} WHERE runtime = %s AND sink = %s AND epoch = %s"
    ).format(t.ident(CLAIMS_TABLE)), (t.runtime, t.sink, epoch)).fetchone()
    return None if row is None else str(row[0])


def has_progress_row(conn: psycopg.Connection[Any], t: Tables, epoch: int, writer: int) -> bool:
    if not t.regclass(conn, PROGRESS_TABLE):
        return False
    row = conn.execute(sql_module().SQL(
        "SELECT EXISTS (SELECT 1 FROM {} WHERE runtime = %s AND sink = %s AND epoch = %s "
        "AND writer = %s)"
    ).format(t.ident(PROGRESS_TABLE)), (t.runtime, t.sink, epoch, writer)).fetchone()
    return bool(row and row[0])


def has_epoch_rows(conn: psycopg.Connection[Any], t: Tables) -> bool:
    """Whether this sink committed any epoch here (its rows ``writer=-1``)."""
    if not t.regclass(conn, PROGRESS_TABLE):
        return False
    row = conn.execute(sql_module().SQL(
        "SELECT EXISTS (SELECT 1 FROM {} WHERE runtime = %s AND sink = %s AND writer = %s)"
    ).format(t.ident(PROGRESS_TABLE)), (t.runtime, t.sink, EPOCH_ROW)).fetchone()
    return bool(row and row[0])
