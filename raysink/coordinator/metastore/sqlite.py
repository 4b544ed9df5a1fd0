"""The embedded meta store: one SQLite file (``sqlite:////abs/path.db``).

The file is opened in WAL mode with ``synchronous=FULL`` (a committed decision survives
power loss), every write runs in a ``BEGIN IMMEDIATE`` transaction (the database's write
lock is taken before the fence is read, so two processes sharing the file serialise), and
a busy timeout makes a writer wait for another instead of failing at once. Several
processes on one machine may share the file; it is not for network filesystems — use
PostgreSQL on a cluster.

The parent directory is created when missing. A path that cannot be created or written
raises ``MetaStoreError`` naming the path when the store is constructed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from raysink.coordinator.metastore import _versions
from raysink.coordinator.metastore._sql import COLUMNS_ADDED, SCHEMA, SqlMetaStore, Tx
from raysink.errors import MetaStoreError

__all__ = ["SqliteMetaStore"]

logger = logging.getLogger(__name__)


class SqliteMetaStore(SqlMetaStore):
    """``MetaStore`` on a SQLite file at ``path``; the connection opens at construction
    (so a bad path fails early), and again on first use after ``close()``."""

    _NOW = "(julianday('now') - 2440587.5) * 86400.0"

    def __init__(self, path: str | os.PathLike[str], *, timeout: float = 30.0) -> None:
        self._path = Path(path).absolute()
        self._timeout = timeout
        self._conn: sqlite3.Connection | None = None
        self._connect()
        logger.info("meta store %s opened", self.url)

    @property
    def path(self) -> Path:
        """The database file."""
        return self._path

    @property
    def url(self) -> str:
        """``sqlite:///`` followed by the absolute path (four slashes in all)."""
        return f"sqlite:///{self._path}"

    def _connect(self) -> sqlite3.Connection:
        if self._conn is not None:
            return self._conn
        self._make_parent()
        try:
            conn = sqlite3.connect(str(self._path), timeout=self._timeout,
                                   isolation_level=None, check_same_thread=False)
        except sqlite3.Error as exc:
            raise self._unusable(exc) from exc
        try:
            self._configure(conn)
        except (sqlite3.Error, MetaStoreError) as exc:
            conn.close()
            if isinstance(exc, MetaStoreError):
                raise
            raise self._unusable(exc) from exc
        self._conn = conn
        return conn

    def _make_parent(self) -> None:
        try:
            self._path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise MetaStoreError(
                f"cannot create the directory {str(self._path.parent)!r} of meta store "
                f"{self.url} ({exc.strerror or exc}); choose a path under a writable "
                "directory (metastore='sqlite:////abs/dir/name.db')") from exc

    def _unusable(self, exc: Exception) -> MetaStoreError:
        return MetaStoreError(
            f"cannot open meta store {self.url} ({exc}); the path must be a SQLite file (or "
            "not exist yet) in a writable directory: fix it or choose another path")

    def _wal_mode(self, conn: sqlite3.Connection) -> str:
        """Switch the file to WAL. Switching takes the file's exclusive lock without the
        busy handler: a second process opening a store not yet in WAL meanwhile (a new
        store, or one made in rollback mode) gets "database is locked" at once, so it is
        asked again until the busy timeout."""
        deadline = time.monotonic() + self._timeout
        while True:
            try:
                return str(conn.execute("PRAGMA journal_mode = WAL").fetchone()[0])
            except sqlite3.OperationalError as exc:
                if "locked" not in str(exc) or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def _configure(self, conn: sqlite3.Connection) -> None:
        """Busy timeout, WAL, ``synchronous=FULL`` and the tables: created, or migrated to
        this raysink's schema version under the write lock (``BEGIN IMMEDIATE``: a second
        process opening the store meanwhile waits, then finds it migrated), or refused
        (``NewerVersionError``) when a newer raysink wrote them."""
        conn.execute(f"PRAGMA busy_timeout = {int(self._timeout * 1000)}")
        mode = self._wal_mode(conn)
        if str(mode).lower() != "wal":
            raise MetaStoreError(f"meta store {self.url} cannot use WAL mode (got "
                                 f"{mode!r}); put it on a local filesystem")
        conn.execute("PRAGMA synchronous = FULL")
        conn.execute("BEGIN IMMEDIATE")
        try:
            found, now = _versions.migrate(_SqliteDdl(conn), self.url, SCHEMA, COLUMNS_ADDED)
            conn.execute("COMMIT")
        except BaseException:
            _rollback(conn)
            raise
        if found != now:
            logger.info("meta store %s migrated from schema version %d to %d", self.url,
                        found, now)

    @contextmanager
    def _transaction(self, *, write: bool, durable: bool = True) -> Iterator[Tx]:
        """One transaction; writes take the write lock first (``BEGIN IMMEDIATE``). A
        write that need not be durable commits with ``synchronous=NORMAL`` (in WAL mode:
        no fsync; the next durable commit syncs it too)."""
        conn = self._connect()
        relaxed = write and not durable
        try:
            if relaxed:
                conn.execute("PRAGMA synchronous = NORMAL")
            conn.execute("BEGIN IMMEDIATE" if write else "BEGIN")
            yield Tx(conn.cursor(), "qmark")
            conn.execute("COMMIT")
        except sqlite3.Error as exc:
            _rollback(conn)
            raise MetaStoreError(
                f"meta store {self.url} failed ({exc}); check that the file and its "
                "directory are writable, the disk is not full and no process holds the "
                f"database locked past the {self._timeout:g} s busy timeout") from exc
        except BaseException:
            _rollback(conn)
            raise
        finally:
            if relaxed:
                with contextlib.suppress(sqlite3.Error):
                    conn.execute("PRAGMA synchronous = FULL")

    def close(self) -> None:
        """Close the connection (idempotent); the next call reopens it."""
        if self._conn is not None:
            self._conn.close()
            self._conn = None


class _SqliteDdl:
    """``_versions.Ddl`` on one connection, inside its open transaction."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn

    def rows(self, sql: str, *params: object) -> list[tuple[object, ...]]:
        return [tuple(row) for row in self._conn.execute(sql, params).fetchall()]

    def has_table(self, table: str) -> bool:
        return bool(self.rows("SELECT 1 FROM sqlite_master WHERE type = 'table' AND "
                              "name = ?", table))

    def has_column(self, table: str, column: str) -> bool:
        return column in {str(row[1]) for row in self.rows(f"PRAGMA table_info({table})")}


def _rollback(conn: sqlite3.Connection) -> None:
    if conn.in_transaction:
        try:
            conn.execute("ROLLBACK")
        except sqlite3.Error:
            logger.debug("rollback failed", exc_info=True)
