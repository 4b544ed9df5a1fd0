"""``Target``: one bound ``PostgresSink`` as the layers below the sink see it (the writer,
the two commit methods, evolution, validation): its options, its connections, its errors
(the DSN's password redacted) and the target's creation at commit.

``PostgresSink.target()`` builds one from the bound sink, in the process that needs it
(the sink travels pickled, its connection left behind).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from raysink import _schema
from raysink.errors import DataLossError, RaySinkError, SinkUnavailableError
from raysink.sinks.base import Manifest
from raysink.sinks.postgres._tables import (
    Method,
    Tables,
    dsn_field,
    has_epoch_rows,
    postgres_manifests,
    redact_dsn,
)
from raysink.sinks.postgres._types import arrow_to_postgres_type, psycopg_module, rules

if TYPE_CHECKING:
    import psycopg
    import pyarrow as pa

__all__ = ["Target"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Target:
    """The table ``schema.table`` reached through ``dsn`` (never shown: ``repr`` leaves it
    out, messages redact its password), written by the sink ``sink`` of ``runtime``."""

    dsn: str = field(repr=False)
    schema: str
    table: str
    key: tuple[str, ...] | None
    method: Method
    create_table: bool
    schema_evolution: _schema.SchemaEvolution
    arrow_schema: pa.Schema | None
    connect_timeout: int
    runtime: str
    sink: str

    @property
    def evolving(self) -> bool:
        return self.schema_evolution == "add_columns"

    @property
    def qualified(self) -> str:
        """``schema.table``, for messages."""
        return f"{self.schema}.{self.table}"

    def tables(self) -> Tables:
        return Tables(schema=self.schema, table=self.table, runtime=self.runtime,
                      sink=self.sink)

    def where(self, epoch: int | None = None) -> dict[str, Any]:
        """The fields every error of this sink carries."""
        return {"runtime": self.runtime or None, "sink": self.sink or None, "epoch": epoch}

    def evolution_rules(self) -> _schema.Rules:
        return rules(self.qualified)

    def pg_types(self, arrow_schema: pa.Schema | None = None) -> dict[str, str]:
        """PostgreSQL types for the columns of ``arrow_schema`` (default: the sink's)."""
        schema = arrow_schema if arrow_schema is not None else self.arrow_schema
        if schema is None:
            return {}
        return {f.name: arrow_to_postgres_type(f.name, f.type) for f in schema}

    # -- errors -----------------------------------------------------------------------

    def redact(self, text: str) -> str:
        """``text`` with the DSN's password replaced by ``***``."""
        password = dsn_field(self.dsn, "password")
        return text.replace(password, "***") if password else text

    def err(self, cls: type[RaySinkError], message: str,
            epoch: int | None = None) -> RaySinkError:
        """A ``cls`` error of this sink, its message redacted."""
        return cls(self.redact(message), **self.where(epoch))

    def unavailable(self, exc: Exception) -> RaySinkError:
        """A refused or lost connection as a ``SinkUnavailableError`` saying what to check."""
        text = str(exc).strip()
        user = dsn_field(self.dsn, "user") or "(default user)"
        if "authentication failed" in text or "no password supplied" in text:
            return self.err(SinkUnavailableError,
                            f"authentication failed for user {user!r}: check the DSN's user "
                            f"and password ({redact_dsn(self.dsn)})")
        return self.err(SinkUnavailableError,
                        f"PostgreSQL unreachable at {redact_dsn(self.dsn)}: {text}")

    # -- connections ------------------------------------------------------------------

    def connect(self, *, autocommit: bool = False) -> psycopg.Connection[Any]:
        """A new connection; refusals become ``SinkUnavailableError`` (password redacted)."""
        psycopg = psycopg_module()
        try:
            conn = psycopg.connect(self.dsn, autocommit=autocommit,
                                   connect_timeout=self.connect_timeout)
        except psycopg.OperationalError as exc:
            raise self.unavailable(exc) from None
        return conn  # type: ignore[no-any-return]

    # -- the target, at commit ----------------------------------------------------------

    def ensure(self, conn: psycopg.Connection[Any], t: Tables,
               manifests: Sequence[Manifest]) -> bool:
        """The target exists, or is created now from the column types a writer saw (an
        empty epoch's; with ``add_columns``, of the union of the writers' schemas);
        ``False`` when it is missing and no writer saw a schema. With ``add_columns`` a
        target missing after an epoch was committed to it is a ``DataLossError`` (its
        writers never create it)."""
        if t.regclass(conn, self.table):
            return True
        types = _creation_types(manifests)
        if types is None:
            return False
        if not self.create_table:
            raise self.err(SinkUnavailableError, f"table {self.qualified} does not exist and "
                           "create_table=False")
        if self.evolving and has_epoch_rows(conn, t):
            raise self.err(DataLossError, f"target table {self.qualified} was deleted after "
                           "raysink committed to it; restore it (not re-created)")
        t.lock(conn)
        t.create_target(conn, types, self.key)
        return True


def _creation_types(manifests: Sequence[Manifest]) -> dict[str, str] | None:
    """The column types to create a missing target with: the union of the writers'
    schemas where they reported one (``add_columns``), else the first writer's types."""
    schema = _schema.united(manifests)
    if schema is not None:
        return {f.name: arrow_to_postgres_type(f.name, f.type) for f in schema}
    return next((dict(found) for m in postgres_manifests(manifests)
                 if (found := m.get("types"))), None)
