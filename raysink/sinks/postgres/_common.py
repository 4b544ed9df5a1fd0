"""What both commit methods share: psycopg, Arrow -> PostgreSQL types and CSV, names,
raysink's tables in the target schema (``_Target``), the progress rows, the target's
creation at commit."""

from __future__ import annotations

import hashlib
import json
import urllib.parse
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from raysink.errors import ConfigError, DataLossError, SchemaMismatchError, SinkUnavailableError
from raysink.sinks.base import Manifest

if TYPE_CHECKING:
    import psycopg
    import pyarrow as pa
    from psycopg import sql

    from raysink.sinks.postgres._sink import PostgresSink

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
CONNECT_TIMEOUT = 5
_TOKEN_COL = "_raysink_token"
_ORD_COL = "_raysink_ord"
_INSTALL = "PostgresSink needs psycopg 3: pip install 'raysink[postgres]'"


def _psycopg() -> Any:
    """Import psycopg lazily; a missing install is a ``ConfigError`` saying what to run."""
    try:
        import psycopg
    except ImportError as exc:
        raise ConfigError(_INSTALL) from exc
    return psycopg


def _sql() -> Any:
    _psycopg()
    from psycopg import sql

    return sql


# --------------------------------------------------------------------------- types


def arrow_to_postgres_type(name: str, dtype: pa.DataType) -> str:
    """The PostgreSQL column type storing Arrow ``dtype``; ``SchemaMismatchError`` if none."""
    import pyarrow as pa

    t = pa.types
    if t.is_dictionary(dtype):
        return arrow_to_postgres_type(name, dtype.value_type)
    simple: list[tuple[Callable[[Any], bool], str]] = [
        (t.is_boolean, "boolean"),
        (t.is_int8, "smallint"), (t.is_int16, "smallint"), (t.is_int32, "integer"),
        (t.is_int64, "bigint"), (t.is_uint8, "smallint"), (t.is_uint16, "integer"),
        (t.is_uint32, "bigint"), (t.is_uint64, "numeric(20,0)"),
        (t.is_float16, "real"), (t.is_float32, "real"), (t.is_float64, "double precision"),
        (t.is_string, "text"), (t.is_large_string, "text"),
        (t.is_binary, "bytea"), (t.is_large_binary, "bytea"), (t.is_fixed_size_binary, "bytea"),
        (t.is_date, "date"), (t.is_time, "time"),
        (t.is_list, "jsonb"), (t.is_large_list, "jsonb"), (t.is_fixed_size_list, "jsonb"),
        (t.is_struct, "jsonb"), (t.is_map, "jsonb"),
    ]
    for test, pg_type in simple:
        if test(dtype):
            return pg_type
    if t.is_decimal(dtype):
        return f"numeric({dtype.precision},{dtype.scale})"
    if t.is_timestamp(dtype):
        return "timestamptz" if dtype.tz is not None else "timestamp"
    if str(dtype) in ("string_view", "binary_view"):
        return "text" if str(dtype) == "string_view" else "bytea"
    raise SchemaMismatchError(
        f"column {name!r} has Arrow type {dtype}, which PostgresSink cannot store; "
        "cast it (e.g. to string or int64) before writing"
    )


def _json_default(value: Any) -> Any:
    if isinstance(value, bytes):
        return "\\x" + value.hex()
    return str(value)


def _encode_column(col: pa.Array | pa.ChunkedArray, pg_type: str) -> pa.Array:
    """One Arrow column in a form pyarrow's CSV writer renders as PostgreSQL input."""
    import pyarrow as pa

    if pa.types.is_dictionary(col.type):
        col = col.cast(col.type.value_type)
    if pg_type == "bytea":
        return pa.array(["\\x" + v.hex() if v is not None else None for v in col.to_pylist()])
    if pg_type == "jsonb":
        return pa.array([
            json.dumps(v, default=_json_default) if v is not None else None
            for v in col.to_pylist()
        ])
    if pa.types.is_float16(col.type):
        return col.cast(pa.float32())
    return col


def _csv_bytes(batch: pa.RecordBatch | pa.Table, types: dict[str, str],
               prefix: dict[str, Any]) -> bytes:
    """``batch`` as CSV for ``COPY … (FORMAT csv)``: nulls unquoted empty, strings quoted."""
    import io

    import pyarrow as pa
    import pyarrow.csv as pcsv

    arrays = dict(prefix)
    for name in batch.schema.names:
        arrays[name] = _encode_column(batch.column(name), types[name])
    table = pa.table(arrays)
    buf = io.BytesIO()
    pcsv.write_csv(table, buf, write_options=pcsv.WriteOptions(include_header=False))
    return buf.getvalue()


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


def _dsn_field(dsn: str, key: str) -> str | None:
    from psycopg.conninfo import conninfo_to_dict

    try:
        value = conninfo_to_dict(dsn).get(key)
    except Exception:
        return None
    return None if value is None else str(value)


# --------------------------------------------------------------------------- the tables



@dataclass(frozen=True, kw_only=True, slots=True)
class _Target:
    """Quoted names of one sink's tables; built from plain strings, composed with Identifier."""

    schema: str
    table: str
    runtime: str
    sink: str

    def ident(self, name: str) -> sql.Composed:
        return _sql().Identifier(self.schema, name)  # type: ignore[no-any-return]

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
        s = _sql()
        conn.execute(s.SQL(
            "CREATE TABLE IF NOT EXISTS {} (runtime text NOT NULL, sink text NOT NULL, "
            "epoch bigint NOT NULL, writer integer NOT NULL, "
            "committed_at timestamptz NOT NULL DEFAULT now(), "
            "PRIMARY KEY (runtime, sink, epoch, writer))"
        ).format(self.ident(PROGRESS_TABLE)))

    def ensure_claims(self, conn: psycopg.Connection[Any]) -> None:
        conn.execute(_sql().SQL(
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
        s = _sql()
        conn.execute(s.SQL(
            "CREATE TABLE IF NOT EXISTS {} (runtime text NOT NULL, sink text NOT NULL, "
            "epoch bigint NOT NULL, attempt integer NOT NULL, writer integer NOT NULL, "
            "stage text NOT NULL, token bigint NOT NULL, nrows bigint NOT NULL, "
            "PRIMARY KEY (runtime, sink, epoch, attempt, writer))"
        ).format(self.ident(STAGED_TABLE)))

    def ensure_stage(self, conn: psycopg.Connection[Any]) -> None:
        """The LOGGED staging table: token, order, then the target's columns and defaults."""
        s = _sql()
        conn.execute(s.SQL(
            "CREATE TABLE IF NOT EXISTS {} ({} bigint NOT NULL, {} bigint NOT NULL, "
            "LIKE {} INCLUDING DEFAULTS)"
        ).format(self.ident(self.stage_name), s.Identifier(_TOKEN_COL),
                 s.Identifier(_ORD_COL), self.target))

    def ensure_upsert_stage(self, conn: psycopg.Connection[Any], writer: int) -> None:
        """Writer ``writer``'s UNLOGGED upsert stage: the target's columns and defaults."""
        conn.execute(_sql().SQL(
            "CREATE UNLOGGED TABLE IF NOT EXISTS {} (LIKE {} INCLUDING DEFAULTS)"
        ).format(self.ident(self.upsert_stage(writer)), self.target))

    def has_progress(self, conn: psycopg.Connection[Any]) -> bool:
        """Whether the progress table records any epoch of this sink."""
        if not self.regclass(conn, PROGRESS_TABLE):
            return False
        row = conn.execute(_sql().SQL(
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
        s = _sql()
        cols = [s.SQL("{} {}").format(s.Identifier(n), s.SQL(t)) for n, t in types.items()]
        if key:
            cols.append(s.SQL("PRIMARY KEY ({})").format(
                s.SQL(", ").join(s.Identifier(k) for k in key)))
        conn.execute(s.SQL("CREATE TABLE IF NOT EXISTS {} ({})").format(
            self.target, s.SQL(", ").join(cols)))


# --------------------------------------------------------------------------- progress rows


def _insert_progress(conn: psycopg.Connection[Any], t: _Target, epoch: int, writer: int) -> bool:
    """Insert one progress row; ``False`` when it was already there (after waiting for a
    concurrent inserter to finish)."""
    row = conn.execute(_sql().SQL(
        "INSERT INTO {} (runtime, sink, epoch, writer) VALUES (%s, %s, %s, %s) "
        "ON CONFLICT DO NOTHING RETURNING 1"
    ).format(t.ident(PROGRESS_TABLE)), (t.runtime, t.sink, epoch, writer)).fetchone()
    return row is not None


def claim_epoch(conn: psycopg.Connection[Any], t: _Target, epoch: int, decision: str) -> str:
    """Claim ``epoch`` for ``decision`` (the claims table must exist); returns the decision
    that holds it now: ``decision``, or the one that claimed it first (a concurrent claim
    waits for the first to end)."""
    s = _sql()
    conn.execute(s.SQL(
        "INSERT INTO {} (runtime, sink, epoch, decision) VALUES (%s, %s, %s, %s) "
        "ON CONFLICT DO NOTHING").format(t.ident(CLAIMS_TABLE)),
        (t.runtime, t.sink, epoch, decision))
    holder = claimed(conn, t, epoch)
    assert holder is not None
    return holder


def claimed(conn: psycopg.Connection[Any], t: _Target, epoch: int) -> str | None:
    """The decision that claimed ``epoch``, or ``None``."""
    if not t.regclass(conn, CLAIMS_TABLE):
        return None
    row = conn.execute(_sql().SQL(
        "SELECT decision FROM {} WHERE runtime = %s AND sink = %s AND epoch = %s"
    ).format(t.ident(CLAIMS_TABLE)), (t.runtime, t.sink, epoch)).fetchone()
    return None if row is None else str(row[0])


def _has_progress_row(conn: psycopg.Connection[Any], t: _Target, epoch: int, writer: int) -> bool:
    if not t.regclass(conn, PROGRESS_TABLE):
        return False
    row = conn.execute(_sql().SQL(
        "SELECT EXISTS (SELECT 1 FROM {} WHERE runtime = %s AND sink = %s AND epoch = %s "
        "AND writer = %s)"
    ).format(t.ident(PROGRESS_TABLE)), (t.runtime, t.sink, epoch, writer)).fetchone()
    return bool(row and row[0])




def _ensure_target(sink: PostgresSink, conn: psycopg.Connection[Any], t: _Target,
                   manifests: Sequence[Manifest]) -> bool:
    """The target exists, or is created now from the column types a writer saw (an
    empty epoch's; with ``add_columns``, of the union of the writers' schemas); ``False``
    when it is missing and no writer saw a schema. With ``add_columns`` a target missing
    after an epoch was committed to it is a ``DataLossError`` (its writers never create
    it)."""
    if t.regclass(conn, sink.table):
        return True
    types = _target_types(manifests)
    if types is None:
        return False
    if not sink.create_table:
        raise sink._err(SinkUnavailableError, f"table {sink.schema}.{sink.table} does not "
                        "exist and create_table=False")
    if sink.evolving and _has_epoch_rows(conn, t):
        raise sink._err(DataLossError, f"target table {sink.schema}.{sink.table} was deleted "
                        "after raysink committed to it; restore it (not re-created)")
    t.lock(conn)
    t.create_target(conn, types, sink.key)
    return True


def _target_types(manifests: Sequence[Manifest]) -> dict[str, str] | None:
    """The column types to create a missing target with: the union of the writers'
    schemas where they reported one (``add_columns``), else the first writer's types."""
    from raysink import _schema

    schemas = [_schema.decode(text) for m in manifests
               if isinstance(text := m.get("schema"), str)]
    if schemas:
        return {f.name: arrow_to_postgres_type(f.name, f.type) for f in _schema.union(schemas)}
    return next((dict(found) for m in manifests if (found := m.get("types"))), None)


def _has_epoch_rows(conn: psycopg.Connection[Any], t: _Target) -> bool:
    """Whether this sink committed any epoch here (its rows ``writer=-1``)."""
    if not t.regclass(conn, PROGRESS_TABLE):
        return False
    row = conn.execute(_sql().SQL(
        "SELECT EXISTS (SELECT 1 FROM {} WHERE runtime = %s AND sink = %s AND writer = %s)"
    ).format(t.ident(PROGRESS_TABLE)), (t.runtime, t.sink, EPOCH_ROW)).fetchone()
    return bool(row and row[0])
