"""``PostgresSink``: the picklable description, its connection, and the coordinator's
calls (``commit``/``abort``/``committed_epoch``), each dispatched to its commit method
(``_prepared``, ``_staging``), on a ``Target`` it builds from itself.

The top of the package: no other module of it imports this one."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from raysink import _schema
from raysink.errors import ConfigError
from raysink.sinks._format import check_marker
from raysink.sinks.base import CommitResult, Manifest, Sink, decision_id
from raysink.sinks.postgres._prepared import abort_prepared, commit_prepared
from raysink.sinks.postgres._staging import abort_staged, commit_staging
from raysink.sinks.postgres._tables import (
    EPOCH_ROW,
    PROGRESS_TABLE,
    Method,
    claimed,
    has_progress_row,
    insert_progress,
    redact_dsn,
)
from raysink.sinks.postgres._target import Target
from raysink.sinks.postgres._types import psycopg_module, sql_module
from raysink.sinks.postgres._validate import Validator
from raysink.sinks.postgres._writer import PostgresWriter

if TYPE_CHECKING:
    import psycopg
    import pyarrow as pa

__all__ = ["PostgresSink"]

logger = logging.getLogger("raysink.sinks.postgres")

T = TypeVar("T")

CONNECT_TIMEOUT = 5


_RESULTS = {"committed": CommitResult.COMMITTED, "already": CommitResult.ALREADY,
            "unmarked": CommitResult.NO_TARGET}


class PostgresSink(Sink):
    """Exactly-once sink into the PostgreSQL table ``schema.table``.

    ``dsn`` is a libpq connection string or URI; its password never appears in ``repr``,
    ``describe()``, logs, errors or manifests. ``key`` turns inserts into upserts (the table
    needs a primary key or unique index on exactly those columns; a created table gets one).
    ``arrow_schema``, when given, lets ``validate()`` compare an existing table's columns and
    lets ``open()`` create the table before the first batch.
    ``schema_evolution="add_columns"`` adds new columns and widens integer, float and
    numeric columns with the epoch's own commit (``_evolve``: rows then go through each
    writer's own stage table, in both methods); any other change is a
    ``SchemaMismatchError`` naming the column.
    """

    kind = "postgres"

    def __init__(
        self,
        dsn: str,
        table: str,
        *,
        key: Sequence[str] | None = None,
        create_table: bool = True,
        schema: str = "public",
        method: Method = "prepared",
        arrow_schema: pa.Schema | None = None,
        connect_timeout: int = CONNECT_TIMEOUT,
        schema_evolution: _schema.SchemaEvolution = "fail",
    ) -> None:
        psycopg_module()
        self.schema_evolution = _schema.check_evolution_option("PostgresSink",
                                                               schema_evolution)
        if not table or not schema:
            raise ConfigError(f"table and schema must be non-empty, got {schema!r}.{table!r}")
        if method not in ("staging", "prepared"):
            raise ConfigError(f"method must be 'staging' or 'prepared', got {method!r}")
        if key is not None and (isinstance(key, str) or not list(key)):
            raise ConfigError(f"key must be a non-empty sequence of column names, got {key!r}")
        self._dsn = dsn
        self.table = table
        self.schema = schema
        self.method: Method = method
        self.create_table = create_table
        self._key = tuple(key) if key is not None else None
        self.arrow_schema = arrow_schema
        self.connect_timeout = connect_timeout
        self._conn: psycopg.Connection[Any] | None = None
        if arrow_schema is not None:
            self.pg_types()

    # -- description ----------------------------------------------------------------

    @property
    def key(self) -> Sequence[str] | None:
        return self._key

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "dsn": redact_dsn(self._dsn), "schema": self.schema,
                "table": self.table, "key": list(self._key) if self._key else None,
                "method": self.method, "schema_evolution": self.schema_evolution}

    @property
    def evolving(self) -> bool:
        return self.schema_evolution == "add_columns"

    def evolution_rules(self) -> _schema.Rules:
        return self.target().evolution_rules()

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_conn"] = None
        return state

    def pg_types(self, arrow_schema: pa.Schema | None = None) -> dict[str, str]:
        """PostgreSQL types for the columns of ``arrow_schema`` (default: the sink's)."""
        return self.target().pg_types(arrow_schema)

    def target(self) -> Target:
        """This sink as its writer, commit methods and checks use it (bound: its runtime
        and name as they are now)."""
        return Target(dsn=self._dsn, schema=self.schema, table=self.table, key=self._key,
                      method=self.method, create_table=self.create_table,
                      schema_evolution=self.schema_evolution, arrow_schema=self.arrow_schema,
                      connect_timeout=self.connect_timeout, runtime=self.runtime,
                      sink=self.name)

    # -- connections ----------------------------------------------------------------

    def connect(self, *, autocommit: bool = False) -> psycopg.Connection[Any]:
        """A new connection; refusals become ``SinkUnavailableError`` (password redacted)."""
        return self.target().connect(autocommit=autocommit)

    def _run(self, fn: Callable[[psycopg.Connection[Any]], T]) -> T:
        """Run ``fn`` on the cached coordinator connection, reconnecting once if it broke
        (e.g. after a server restart); ``fn`` must be idempotent."""
        psycopg = psycopg_module()
        for attempt in (0, 1):
            if self._conn is None or self._conn.closed or self._conn.broken:
                self._conn = self.connect(autocommit=True)
            try:
                return fn(self._conn)
            except psycopg.OperationalError as exc:
                self._conn.close()
                self._conn = None
                if attempt:
                    raise self.target().unavailable(exc) from exc
        raise AssertionError("unreachable")

    def close(self) -> None:
        """Close the coordinator-side connection, if any."""
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    # -- validate -------------------------------------------------------------------

    def validate(self) -> None:
        """Reachable, authenticated, permitted and schema-compatible; creates nothing (runs in
        a READ ONLY transaction)."""
        conn = self.connect()
        try:
            conn.read_only = True
            with conn.transaction():
                Validator(self.target(), conn).run()
        finally:
            conn.close()

    # -- writers --------------------------------------------------------------------

    def create_writer(self, writer_id: int) -> PostgresWriter:
        return PostgresWriter(self.target(), writer_id)

    # -- commit ---------------------------------------------------------------------

    def commit(self, epoch: int, manifests: Sequence[Manifest]) -> CommitResult:
        """Make ``epoch`` visible with its progress row; idempotent, safe after a crash.
        A missing table is created from the epoch's schema (an empty epoch's too);
        ``NO_TARGET`` when there is none and no writer saw a schema: nothing is written."""
        started = time.perf_counter()
        commit = commit_prepared if self.method == "prepared" else commit_staging
        target = self.target()
        outcome = self._run(lambda conn: commit(target, conn, epoch, manifests))
        if outcome == "committed":
            logger.info("postgres sink %s/%s committed epoch %d (%d rows) in %.3fs",
                        self.runtime, self.name, epoch,
                        sum(int(m.get("rows", 0)) for m in manifests),
                        time.perf_counter() - started)
        return _RESULTS[outcome]

    def abort(self, epoch: int, manifests: Sequence[Manifest] | None) -> None:
        """Drop what was staged or prepared for ``epoch``; ``None`` sweeps by epoch."""
        self._run(lambda conn: self._abort(conn, epoch, manifests))

    def committed_epoch(self) -> int | None:
        """Highest committed epoch; ``None`` if the progress table is missing or empty."""
        return self._run(self._committed_epoch)

    def _committed_epoch(self, conn: psycopg.Connection[Any]) -> int | None:
        t = self.target().tables()
        if not t.regclass(conn, PROGRESS_TABLE):
            return None
        # ``format``: none in a progress table raysink 0.1.0 made (format 1)
        row = conn.execute(sql_module().SQL(
            "SELECT max(epoch), max((to_jsonb(p) ->> 'format')::integer) FROM {} p "
            "WHERE runtime = %s AND sink = %s AND writer = %s"
        ).format(t.ident(PROGRESS_TABLE)), (self.runtime, self.name, EPOCH_ROW)).fetchone()
        if row is not None and row[1] is not None:
            check_marker({"format": int(row[1])}, runtime=self.runtime or None,
                         sink=self.name or None, where=f"table {PROGRESS_TABLE} of {t.schema}")
        return None if row is None or row[0] is None else int(row[0])

    def holds_decision(self, epoch: int, manifests: Sequence[Manifest]) -> bool | None:
        """Whether ``epoch``'s claim names the decision ``manifests`` (``None``: no claim,
        as for an epoch committed by an older raysink)."""
        holder = self._run(lambda conn: claimed(conn, self.target().tables(), epoch))
        return None if holder is None else holder == decision_id(epoch, manifests)

    def target_exists(self) -> bool:
        """Whether the data table exists (the coordinator tells a deleted one apart)."""
        return self._run(lambda conn: self.target().tables().regclass(conn, self.table))

    def recreate_marker(self, epoch: int) -> None:
        """Re-create the progress table and this sink's marker at ``epoch`` (only when no
        epoch is pending: the coordinator decides)."""
        def run(conn: psycopg.Connection[Any]) -> None:
            t = self.target().tables()
            with conn.transaction():
                t.lock(conn)
                t.ensure_progress(conn)
                insert_progress(conn, t, epoch, EPOCH_ROW)
        self._run(run)
        logger.info("postgres sink %s/%s: progress marker re-created at epoch %d",
                    self.runtime, self.name, epoch)

    def _abort(self, conn: psycopg.Connection[Any], epoch: int,
               manifests: Sequence[Manifest] | None) -> None:
        """Remove what was prepared or staged for ``epoch``; a committed epoch is left
        alone."""
        t = self.target().tables()
        if has_progress_row(conn, t, epoch, EPOCH_ROW):
            return
        abort_prepared(conn, t, epoch, manifests)
        abort_staged(conn, t, epoch, manifests)
