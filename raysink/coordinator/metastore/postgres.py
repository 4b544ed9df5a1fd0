"""The cluster meta store: PostgreSQL through psycopg 3 (``postgresql://user:pw@host/db``).

Tables ``raysink_runtimes``, ``raysink_epochs``, ``raysink_sink_status``,
``raysink_leases`` and ``raysink_schema`` are created in the connection's default schema
when missing, or migrated from an older raysink's schema version (``_versions``), in one
transaction under an advisory lock, so processes opening the store together do not race:
the second finds the work done. A store at this raysink's version is only read (a role
that may not CREATE can use it); one a newer raysink wrote is refused
(``NewerVersionError``). Every write locks the runtime's
row with ``SELECT ... FOR UPDATE`` and checks its generation before changing anything; a
lock held longer than ``lock_timeout`` fails the write with ``MetaStoreError`` instead of
hanging. Lease times are the server's clock (``clock_timestamp()``).

The password never appears in ``url``, in error messages or in logs. A connection that
breaks (server restart, network) fails the call in flight with ``MetaStoreError``; the next
call reconnects. psycopg is imported when a store is constructed, not on import.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any
from urllib.parse import quote

from raysink.coordinator.metastore import _versions
from raysink.coordinator.metastore._sql import (
    COLUMNS_ADDED,
    SCHEMA,
    SqlMetaStore,
    Tx,
    redact_url,
)
from raysink.errors import ConfigError, MetaStoreError
from raysink.protocol.requirements import check_extra

__all__ = ["PostgresMetaStore"]

logger = logging.getLogger(__name__)

_DDL_LOCK = 0x72617973696E6B  # "raysink": serialises creation and migration across processes

_MIN_SCRUBBED = 4

_HINTS = {
    "42501": "grant the role CREATE on its schema and rights on the raysink_* tables, or "
             "connect as the role that owns them",
    "55P03": "another process held the runtime's row locked past lock_timeout; retry",
    "28P01": "check the user name and password",
    "28000": "check the user name, password and pg_hba.conf",
    "3D000": "create the database or correct its name",
}
_DEFAULT_HINT = ("check that the server is up and reachable and that the user name, password "
                 "and database are right")


def _import_psycopg() -> Any:
    try:
        import psycopg
    except ImportError as exc:
        raise ConfigError("the PostgreSQL meta store needs psycopg 3: "
                          "pip install 'raysink[postgres]'") from exc
    check_extra("postgres")
    return psycopg


class PostgresMetaStore(SqlMetaStore):
    """``MetaStore`` on PostgreSQL at ``dsn`` (a URL or a libpq key/value string).

    Connects at construction (so a bad address fails early) and creates the tables.
    """

    _LOCK = " FOR UPDATE"
    _NOW = "EXTRACT(EPOCH FROM clock_timestamp())::double precision"

    def __init__(self, dsn: str, *, connect_timeout: int = 10,
                 lock_timeout: float = 30.0) -> None:
        self._pg = _import_psycopg()
        self._dsn = dsn
        self._url = redact_url(dsn)
        self._secrets = self._find_secrets(dsn)
        self._connect_timeout = connect_timeout
        self._lock_timeout_ms = int(lock_timeout * 1000)
        self._conn: Any = None
        self._connect()
        logger.info("meta store %s opened", self._url)

    @property
    def url(self) -> str:
        """The DSN with its password replaced by ``***``."""
        return self._url

    def _find_secrets(self, dsn: str) -> tuple[str, ...]:
        """The password (raw and URL-quoted) to scrub from server messages, which libpq
        never fills with it anyway; one under 4 characters would garble every message."""
        try:
            password = self._pg.conninfo.conninfo_to_dict(dsn).get("password")
        except self._pg.Error:
            return ()
        if not password or len(str(password)) < _MIN_SCRUBBED:
            return ()
        return tuple({str(password), quote(str(password), safe="")})

    def _scrub(self, text: str) -> str:
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text

    def _failure(self, action: str, exc: Exception) -> MetaStoreError:
        detail = self._scrub(" ".join(str(exc).split()))
        hint = _HINTS.get(getattr(exc, "sqlstate", None) or "", _DEFAULT_HINT)
        return MetaStoreError(f"{action} meta store {self._url} failed: {detail}; {hint}")

    def _cause(self, exc: Exception) -> Exception | None:
        """``exc`` for chaining, unless its text would leak the password."""
        return None if self._scrub(str(exc)) != str(exc) else exc

    def _connect(self) -> Any:
        if self._conn is not None and not (self._conn.closed or self._conn.broken):
            return self._conn
        self._discard()
        try:
            conn = self._pg.connect(self._dsn, autocommit=True,
                                    connect_timeout=self._connect_timeout)
        except self._pg.Error as exc:
            raise self._failure("connecting to", exc) from self._cause(exc)
        try:
            conn.execute(f"SET lock_timeout = {self._lock_timeout_ms}")
            self._create_schema(conn)
        except self._pg.Error as exc:
            conn.close()
            raise self._failure("preparing", exc) from self._cause(exc)
        except BaseException:
            conn.close()
            raise
        self._conn = conn
        return conn

    def _create_schema(self, conn: Any) -> None:
        """Create or migrate the tables; a store at this version is only read (a role that
        may only use existing tables needs no CREATE), a newer one refused."""
        ddl = _PostgresDdl(conn)
        found = _versions.stored_version(ddl)
        _versions.check_not_newer(found, self._url)
        if found is not None and found[0] == _versions.SCHEMA_VERSION:
            return
        with conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (_DDL_LOCK,))
            before, now = _versions.migrate(ddl, self._url, SCHEMA, COLUMNS_ADDED)
        if before != now:
            logger.info("meta store %s migrated from schema version %d to %d", self._url,
                        before, now)

    @contextmanager
    def _transaction(self, *, write: bool, durable: bool = True) -> Iterator[Tx]:
        """One transaction (``write`` needs nothing more: the fence locks the row); one
        that need not be durable does not wait for its WAL flush."""
        conn = self._connect()
        try:
            with conn.transaction(), conn.cursor() as cursor:
                if write and not durable:
                    cursor.execute("SET LOCAL synchronous_commit = off")
                yield Tx(cursor, "format")
        except self._pg.Error as exc:
            if conn.closed or conn.broken:
                self._discard()
            raise self._failure("a transaction on", exc) from self._cause(exc)

    def _discard(self) -> None:
        if self._conn is not None:
            with suppress(Exception):
                self._conn.close()
            self._conn = None

    def close(self) -> None:
        """Close the connection (idempotent); the next call reconnects."""
        self._discard()


class _PostgresDdl:
    """``_versions.Ddl`` on one connection (inside its transaction, when one is open)."""

    def __init__(self, conn: Any) -> None:
        self._conn = conn

    def rows(self, sql: str, *params: Any) -> list[tuple[Any, ...]]:
        cursor = self._conn.execute(sql.replace("?", "%s"), params)
        return [tuple(row) for row in cursor.fetchall()] if cursor.description else []

    def has_table(self, table: str) -> bool:
        return bool(self.rows("SELECT to_regclass(?) IS NOT NULL", table)[0][0])

    def has_column(self, table: str, column: str) -> bool:
        return bool(self.rows("SELECT EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = "
                              "to_regclass(?) AND attname = ? AND NOT attisdropped)",
                              table, column)[0][0])
