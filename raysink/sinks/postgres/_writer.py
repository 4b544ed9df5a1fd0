"""``PostgresWriter``: one writer actor's rows, in one transaction per epoch attempt.

Three ways a batch travels, by the sink's method and key:

===========================  ==================================================================
prepared, no key             COPY straight into the target
prepared, key (upserts)      gathered into chunks; each chunk sorted, deduplicated, COPYed
                             into the writer's UNLOGGED stage and upserted into the target
                             (``_prepared``)
staging (either)             COPY into the shared LOGGED stage under the segment's token,
                             with the row order (``_staging``)
add_columns (either method)  checked against the table, COPYed into the segment's own stage
                             table, created and widened as its batches need (``_evolve``)
===========================  ==================================================================

``pre_commit`` ends the transaction: ``PREPARE TRANSACTION`` (prepared) or a commit of the
staged rows and their token record (staging).
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from raysink import _schema
from raysink.errors import DataLossError, SchemaMismatchError, SinkUnavailableError
from raysink.sinks.base import Manifest, SinkWriter
from raysink.sinks.postgres import _evolve, _prepared, _staging
from raysink.sinks.postgres._tables import ORD_COL, TOKEN_COL, PostgresManifest, gid
from raysink.sinks.postgres._target import Target
from raysink.sinks.postgres._types import csv_bytes, psycopg_module, sql_module

if TYPE_CHECKING:
    import psycopg
    import pyarrow as pa
    from psycopg import sql

__all__ = ["PostgresWriter"]

logger = logging.getLogger("raysink.sinks.postgres")

Path = Literal["append", "upsert", "staging", "evolving"]


@dataclass(slots=True)
class _Segment:
    """What this writer sent since its last pre-commit: one open transaction."""

    token: int = field(default_factory=lambda: secrets.randbits(62))
    rows: int = 0
    columns: tuple[str, ...] = ()
    types: dict[str, str] = field(default_factory=dict)
    # add_columns: the table's columns when the segment began, the union of its batches'
    # schemas, and its stage table (created at its first row)
    target: dict[str, str] | None = None
    required: set[str] = field(default_factory=set)
    schema: pa.Schema | None = None
    stage: _evolve.Stage | None = None


class PostgresWriter(SinkWriter):
    """Writes one writer actor's rows inside one transaction per epoch attempt."""

    def __init__(self, target: Target, writer_id: int) -> None:
        self.target = target
        self.writer_id = writer_id
        self._conn: psycopg.Connection[Any] | None = None
        self._t = target.tables()
        self._types: dict[str, str] = {}
        self._segment = _Segment()
        self._last: tuple[int, int, PostgresManifest] | None = None
        self._chunk: list[pa.RecordBatch] = []
        self._chunk_rows = 0

    @property
    def _path(self) -> Path:
        if self.target.evolving:
            return "evolving"
        if self.target.method == "staging":
            return "staging"
        return "upsert" if self.target.key else "append"

    # -- open / ddl -----------------------------------------------------------------

    def open(self) -> None:
        """Connect (again after a restart) and create missing tables; idempotent."""
        if self._conn is not None and not self._conn.closed and not self._conn.broken:
            return
        self._conn = self.target.connect()
        self._segment = _Segment()
        self._ddl(self.target.pg_types())

    def _ddl(self, wanted: dict[str, str]) -> None:
        """Create the progress table, the target (from ``wanted`` types; a target deleted
        after commits is a ``DataLossError``) and the helpers, under an advisory lock."""
        conn = self._require_conn()
        with self._guard(), conn.transaction():
            self._t.lock(conn)
            had_progress = self._t.has_progress(conn)
            self._t.ensure_progress(conn)
            if self.target.method == "staging":
                self._t.ensure_staged(conn)
            if not self._t.regclass(conn, self.target.table):
                if had_progress:
                    raise self.target.err(DataLossError, f"target table {self.target.schema}."
                                          f"{self.target.table} was deleted after raysink "
                                          "committed to it; restore it (not re-created)")
                if not wanted:
                    return
                if not self.target.create_table:
                    raise self.target.err(SinkUnavailableError, f"table {self.target.schema}."
                                          f"{self.target.table} does not exist and "
                                          "create_table=False")
                self._t.create_target(conn, wanted, self.target.key)
            self._types = self._t.columns(conn)
            if self._path == "staging":
                self._t.ensure_stage(conn)
            elif self._path == "upsert":
                self._t.ensure_upsert_stage(conn, self.writer_id)

    def _require_conn(self) -> psycopg.Connection[Any]:
        if self._conn is None:
            raise RuntimeError("PostgresWriter used before open()")
        return self._conn

    def _live_conn(self) -> psycopg.Connection[Any]:
        """The connection, re-opened when it broke (e.g. a server restart) while no rows
        of the current segment are in it. A segment with rows never reconnects: its rows
        went with the broken transaction, and its attempt fails and is retried."""
        conn = self._conn
        if (conn is None or conn.closed or conn.broken) and not self._segment.rows:
            self.open()
        return self._require_conn()

    @contextmanager
    def _guard(self, epoch: int | None = None) -> Iterator[None]:
        """Map server errors: bad data -> ``SchemaMismatchError``, connection ->
        ``SinkUnavailableError``; the open transaction is rolled back (nothing written)."""
        psycopg = psycopg_module()
        try:
            yield
        except psycopg.Error as exc:
            self._reset()
            refused = psycopg.errors.InsufficientPrivilege | psycopg.errors.UndefinedTable
            if isinstance(exc, refused):
                raise self.target.err(SinkUnavailableError,
                                      f"PostgreSQL refused the write: {exc}", epoch) from None
            if isinstance(exc, psycopg.DataError | psycopg.IntegrityError
                          | psycopg.ProgrammingError):
                raise self.target.err(SchemaMismatchError,
                                      f"PostgreSQL refused the rows: {exc}", epoch) from None
            raise self.target.unavailable(exc) from None

    def _reset(self) -> None:
        """Roll back the open transaction and start a new segment."""
        self._segment = _Segment()
        self._chunk, self._chunk_rows = [], 0
        if self._conn is not None and not self._conn.closed:
            try:
                self._conn.rollback()
            except Exception:  # a broken connection: the server rolled it back
                self._conn.close()

    # -- write ----------------------------------------------------------------------

    def write(self, batch: pa.RecordBatch) -> None:
        """Send ``batch`` into the open transaction (see the module docstring; upserts wait
        for a full chunk or ``pre_commit``). An empty batch only tells the epoch's schema
        (the commit creates a missing table from it)."""
        self._check_batch(batch)
        if self._path == "evolving":
            self._write_evolving(batch)
            return
        types = self.target.pg_types(batch.schema)
        if batch.num_rows == 0:
            if self._types:
                self._check_columns(batch)
            self._segment.columns, self._segment.types = tuple(batch.schema.names), types
            return
        conn = self._live_conn()
        if not self._types:
            self._ddl(types)
        self._check_columns(batch)
        self._segment.types = types
        self._segment.rows += batch.num_rows
        self._segment.columns = tuple(batch.schema.names)
        if self._path == "upsert":
            self._chunk.append(batch)
            self._chunk_rows += batch.num_rows
            if self._chunk_rows >= _prepared.UPSERT_CHUNK_ROWS:
                self._send_chunk()
            return
        prefix = self._prefix(batch.num_rows)
        data = csv_bytes(batch, types, prefix)
        copy_sql = self._copy_sql(list(prefix) + batch.schema.names)
        with self._guard(), conn.cursor().copy(copy_sql) as cp:
            cp.write(data)
        logger.debug("postgres writer %d staged %d rows", self.writer_id, batch.num_rows)

    def _write_evolving(self, batch: pa.RecordBatch) -> None:
        """``add_columns``: check the batch against the table as it was when the segment
        began (refusals name the column; nothing of the segment stays), cast it up to the
        table's wider types and COPY it into the segment's stage (``_evolve``)."""
        conn = self._live_conn()  # (the commit creates a missing table, from the union)
        seg = self._segment
        where = {"runtime": self.target.runtime or None, "sink": self.target.sink or None}
        try:
            with self._guard():
                if seg.target is None:
                    seg.target = self._t.columns(conn)
                    seg.required = _evolve.required_columns(conn, self._t)
                current = _evolve.table_schema(seg.target, batch.schema,
                                               self.target.evolution_rules(), where,
                                               seg.required)
                batch, seg.schema = _schema.admit(batch, current, seg.schema,
                                                  self.target.evolution_rules(), where=where)
                _evolve.check_nulls(batch, seg.required, where)
                if batch.num_rows:
                    seg.stage = seg.stage or _evolve.Stage(self._t, seg.token)
                    seg.stage.write(conn, batch)
        except SchemaMismatchError:
            self._reset()
            raise
        seg.rows += batch.num_rows
        seg.columns = tuple(seg.schema.names)
        seg.types = self.target.pg_types(seg.schema)

    def _send_chunk(self) -> None:
        """Upsert the gathered chunk. Only ``write`` and ``pre_commit`` send one, never a
        periodic ``flush``: a failure there would be logged and dropped by the actor's
        timer, with the transaction's rows gone and the epoch still going on. (Nothing is
        durable before ``PREPARE`` anyway.)"""
        import pyarrow as pa

        chunk = pa.Table.from_batches(self._chunk)
        self._chunk, self._chunk_rows = [], 0
        conn = self._require_conn()
        with self._guard():
            _prepared.upsert_chunk(conn, self._t, self.writer_id, chunk, self._segment.types,
                                   self.target.key or ())
        logger.debug("postgres writer %d upserted %d rows", self.writer_id, chunk.num_rows)

    def _check_batch(self, batch: pa.RecordBatch) -> None:
        for k in self.target.key or ():
            if k not in batch.schema.names:
                self._reset()
                raise self.target.err(SchemaMismatchError, f"key column {k!r} is missing "
                                      f"from the batch (columns {batch.schema.names})")
            if batch.column(k).null_count:
                self._reset()
                raise self.target.err(SchemaMismatchError,
                                      f"key column {k!r} holds {batch.column(k).null_count} "
                                      "null values; upsert keys must be non-null")
        if self._path != "evolving" and self._segment.columns \
                and tuple(batch.schema.names) != self._segment.columns:
            self._reset()
            raise self.target.err(SchemaMismatchError, f"batch columns {batch.schema.names} "
                                  f"differ from the epoch's {list(self._segment.columns)}")

    def _check_columns(self, batch: pa.RecordBatch) -> None:
        unknown = [n for n in batch.schema.names if n not in self._types]
        if unknown:
            self._reset()
            listed = ", ".join(repr(n) for n in unknown)
            raise SchemaMismatchError(
                self.target.redact(
                    f"column {listed} is not in the table {self.target.schema}."
                    f"{self.target.table}; send the columns it holds (drop the others), or give "
                    "the sink schema_evolution='add_columns' to add new columns"),
                column=unknown[0], runtime=self.target.runtime or None,
                sink=self.target.sink or None)

    def _prefix(self, n: int) -> dict[str, Any]:
        """The staging path's token and row-order columns for ``n`` more rows."""
        if self._path != "staging":
            return {}
        import numpy as np
        import pyarrow as pa

        start = self._segment.rows - n
        return {TOKEN_COL: pa.array(np.full(n, self._segment.token, dtype=np.int64)),
                ORD_COL: pa.array(np.arange(start, start + n, dtype=np.int64))}

    def _copy_sql(self, columns: Sequence[str]) -> sql.Composed:
        s = sql_module()
        table = self._t.ident(self._t.stage_name) if self._path == "staging" else self._t.target
        query: sql.Composed = s.SQL("COPY {} ({}) FROM STDIN (FORMAT csv)").format(
            table, s.SQL(", ").join(s.Identifier(c) for c in columns))
        return query

    # -- pre-commit / rollback ----------------------------------------------------------

    def pre_commit(self, epoch: int, attempt: int) -> Manifest:
        """Stage durably (commit the staging rows, or PREPARE the transaction) and describe
        it. A repeated call for the same ``(epoch, attempt)`` returns the same manifest."""
        if self._last and self._last[:2] == (epoch, attempt) and not self._segment.rows:
            return self._last[2]
        conn = self._live_conn()
        seg = self._segment
        manifest: PostgresManifest = {"method": self.target.method, "writer": self.writer_id,
                              "epoch": epoch, "attempt": attempt, "rows": seg.rows,
                              "columns": list(seg.columns), "types": seg.types or None,
                              "token": None, "gid": None}
        if self._path == "evolving":
            manifest["schema"] = None if seg.schema is None else _schema.encode(seg.schema)
            manifest["evolving"] = None if seg.stage is None else seg.stage.name
        with self._guard(epoch):
            if not seg.rows:
                conn.rollback()
            elif self.target.method == "staging":
                stage = self._t.stage_name if seg.stage is None else seg.stage.name
                _staging.record_staged(conn, self._t, epoch, attempt, self.writer_id,
                                       seg.token, seg.rows, stage)
                manifest["token"] = None if seg.stage is not None else seg.token
                conn.commit()
            else:
                if self._chunk:
                    self._send_chunk()
                manifest["gid"] = _prepared.prepare(conn, self._t, epoch, attempt,
                                                    self.writer_id)
        self._segment = _Segment()
        self._last = (epoch, attempt, manifest)
        return manifest

    def rollback(self, epoch: int, attempt: int) -> None:
        """Drop the open transaction and anything this writer staged or prepared for
        ``(epoch, attempt)``; idempotent."""
        self._reset()
        conn = self._live_conn()
        if self._last and self._last[:2] == (epoch, attempt):
            self._last = None
        conn.autocommit = True
        try:
            with self._guard(epoch):
                _prepared.finish_prepared(conn, "ROLLBACK", gid(
                    self.target.runtime, self.target.sink, epoch, attempt, self.writer_id))
                if self.target.method == "staging":
                    _staging.drop_staged(conn, self._t, epoch, attempt, self.writer_id)
        finally:
            conn.autocommit = False

    def close(self) -> None:
        """Roll back any open (unprepared) transaction and disconnect."""
        if self._conn is not None:
            self._reset()
            self._conn.close()
            self._conn = None
