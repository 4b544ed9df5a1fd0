"""The meta store's schema version, and the migrations that bring an older store forward.

A store records its version in ``raysink_schema`` (one row: ``version``, the raysink
release that last wrote the schema, when). A store without that table was made by raysink
0.1.0 (or a build before it): version 1. Opening a store:

* a new one (no ``raysink_runtimes`` table) is created at ``SCHEMA_VERSION``;
* an older one is migrated forward, step by step, in the caller's one transaction, which
  holds the store's write lock (SQLite ``BEGIN IMMEDIATE``, PostgreSQL an advisory lock):
  two drivers opening it at once migrate it once, the second finds it done;
* a newer one is refused with ``NewerVersionError`` naming both versions: an older raysink
  cannot know what a newer one's tables mean, and a store is never migrated backwards.

A step is data (``Step``): tables to create and columns to add, each only where missing,
so a store a pre-release build left half-way is brought up to the same shape.

Versions::

    1  raysink 0.1.0: raysink_runtimes, raysink_epochs, raysink_sink_status, raysink_leases
    2  raysink 0.2.0: raysink_schema; raysink_epochs.written_by, the raysink release that
       recorded the epoch (an error about a decided epoch names who decided it)
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from raysink.errors import NewerVersionError

__all__ = ["SCHEMA_TABLE", "SCHEMA_VERSION", "STEPS", "Ddl", "Step", "check_not_newer",
           "migrate", "raysink_version", "stored_version"]

SCHEMA_TABLE = "raysink_schema"

SCHEMA_TABLE_DDL = f"""CREATE TABLE IF NOT EXISTS {SCHEMA_TABLE} (
        id INTEGER PRIMARY KEY CHECK (id = 1),
        version INTEGER NOT NULL,
        raysink TEXT NOT NULL,
        updated_at DOUBLE PRECISION NOT NULL)"""


@dataclass(frozen=True)
class Step:
    """What the schema of version ``to`` has that version ``to - 1`` lacks."""

    to: int
    why: str
    tables: tuple[str, ...] = ()
    columns: tuple[tuple[str, str, str], ...] = ()  # (table, column, definition)


STEPS: tuple[Step, ...] = (
    Step(to=2, why="the schema version itself, and who recorded each epoch",
         tables=(SCHEMA_TABLE_DDL,),
         columns=(("raysink_epochs", "written_by", "TEXT"),)),
)
"""Every migration, oldest first; ``SCHEMA_VERSION`` is the last one's ``to``."""

SCHEMA_VERSION = max(step.to for step in STEPS)


class Ddl(Protocol):
    """What a backend gives ``migrate``, inside its locked transaction."""

    def rows(self, sql: str, *params: Any) -> list[tuple[Any, ...]]:
        """Run a statement (``?`` placeholders); its rows, if any."""
        ...

    def has_table(self, table: str) -> bool:
        ...

    def has_column(self, table: str, column: str) -> bool:
        ...


def raysink_version() -> str:
    """This raysink's release (read when needed: the package finishes importing first)."""
    import raysink

    return str(getattr(raysink, "__version__", "unknown"))


def stored_version(ddl: Ddl) -> tuple[int, str] | None:
    """``(version, raysink release that wrote it)``; ``None`` when the store has no version
    table (a new store, or one of version 1)."""
    if not ddl.has_table(SCHEMA_TABLE):
        return None
    rows = ddl.rows(f"SELECT version, raysink FROM {SCHEMA_TABLE} WHERE id = 1")
    return (int(rows[0][0]), str(rows[0][1])) if rows else None


def check_not_newer(found: tuple[int, str] | None, url: str) -> None:
    """``NewerVersionError`` when the store's schema is newer than this raysink reads."""
    if found is None or found[0] <= SCHEMA_VERSION:
        return
    version, writer = found
    raise NewerVersionError(
        f"meta store {url} has schema version {version}, written by raysink {writer}; this "
        f"raysink {raysink_version()} reads schema versions up to {SCHEMA_VERSION}. Run "
        f"raysink {writer} or newer on every driver that opens this store (a store is never "
        "migrated backwards), or give this runtime another metastore=",
        what="meta store schema", found=version, supported=SCHEMA_VERSION)


def migrate(ddl: Ddl, url: str, baseline: Sequence[str],
            baseline_columns: Sequence[tuple[str, str, str]]) -> tuple[int, int]:
    """Bring the store to ``SCHEMA_VERSION``; returns ``(version found, version now)``.

    Runs inside the caller's transaction, which holds the store's write lock.
    ``baseline``: the current ``CREATE TABLE IF NOT EXISTS`` statements (a new store gets
    them all; an older one the tables it lacks); ``baseline_columns``: columns added
    before versions were recorded (``ALTER TABLE ... ADD COLUMN`` where missing)."""
    found = stored_version(ddl)
    check_not_newer(found, url)
    fresh = found is None and not ddl.has_table("raysink_runtimes")
    start = SCHEMA_VERSION if fresh else (1 if found is None else found[0])
    if found is not None and start == SCHEMA_VERSION:
        return start, start
    for statement in baseline:
        ddl.rows(statement)
    _add_columns(ddl, baseline_columns)
    for step in STEPS:
        if step.to > start:
            for statement in step.tables:
                ddl.rows(statement)
            _add_columns(ddl, step.columns)
    ddl.rows(SCHEMA_TABLE_DDL)
    ddl.rows(f"INSERT INTO {SCHEMA_TABLE} (id, version, raysink, updated_at) "
             "VALUES (1, ?, ?, ?) ON CONFLICT (id) DO UPDATE SET version = excluded.version, "
             "raysink = excluded.raysink, updated_at = excluded.updated_at",
             SCHEMA_VERSION, raysink_version(), time.time())
    return start, SCHEMA_VERSION


def _add_columns(ddl: Ddl, columns: Sequence[tuple[str, str, str]]) -> None:
    for table, column, definition in columns:
        if not ddl.has_column(table, column):
            ddl.rows(f"ALTER TABLE {table} ADD COLUMN {column} {definition}")
