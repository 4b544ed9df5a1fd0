"""``PostgresSink.validate()``: read-only checks of privileges, existing tables and
server settings (it runs in a READ ONLY transaction and creates nothing)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from raysink.errors import SchemaMismatchError, SinkUnavailableError
from raysink.sinks.postgres._tables import PROGRESS_TABLE, STAGED_TABLE
from raysink.sinks.postgres._target import Target
from raysink.sinks.postgres._types import compatible

if TYPE_CHECKING:
    import psycopg

__all__ = ["Validator"]


class Validator:
    """Read-only checks of ``validate()``: privileges, existing tables, server settings."""

    def __init__(self, sink: Target, conn: psycopg.Connection[Any]) -> None:
        self.sink = sink
        self.conn = conn
        self.t = sink.tables()

    def run(self) -> None:
        self._check_schema()
        if self.t.regclass(self.conn, self.sink.table):
            self._check_table_privileges(self.sink.table, self._target_privileges())
            self._check_columns()
        elif not self.sink.create_table:
            raise self.sink.err(SinkUnavailableError, f"table {self.sink.schema}."
                                f"{self.sink.table} does not exist and create_table=False")
        else:
            self._require_create("the target table")
        for helper, privileges in self._helpers():
            if self.t.regclass(self.conn, helper):
                self._check_table_privileges(helper, privileges)
            else:
                self._require_create(f"raysink's table {helper}")
        if self.sink.method == "prepared":
            self._check_prepared()
        if self.sink.evolving:
            self._check_evolving()

    def _helpers(self) -> list[tuple[str, tuple[str, ...]]]:
        """raysink's tables next to the target, with the privileges their use needs (for
        upserts in ``prepared``: writer 0's stage stands for every writer's)."""
        helpers: list[tuple[str, tuple[str, ...]]] = [
            (PROGRESS_TABLE, ("SELECT", "INSERT", "DELETE"))]
        if self.sink.method == "staging":
            helpers.append((STAGED_TABLE, ("SELECT", "INSERT", "DELETE")))
            helpers.append((self.t.stage_name, ("SELECT", "INSERT", "DELETE")))
        elif self.sink.key:
            helpers.append((self.t.upsert_stage(0), ("SELECT", "INSERT", "TRUNCATE")))
        return helpers

    def _target_privileges(self) -> tuple[str, ...]:
        return ("INSERT", "SELECT", "UPDATE") if self.sink.key else ("INSERT",)

    def _scalar(self, query: str, params: tuple[Any, ...]) -> Any:
        row = self.conn.execute(query, params).fetchone()
        return row[0] if row else None

    def _check_schema(self) -> None:
        if not self._scalar("SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = %s)",
                            (self.sink.schema,)):
            raise self.sink.err(SinkUnavailableError,
                                f"schema {self.sink.schema!r} does not exist; create it first")
        if not self._scalar("SELECT has_schema_privilege(%s, 'USAGE')", (self.sink.schema,)):
            raise self._denied("USAGE", f"schema {self.sink.schema}")

    def _check_table_privileges(self, table: str, privileges: Sequence[str]) -> None:
        literal = self.t.ident(table).as_string(self.conn)
        for privilege in privileges:
            if not self._scalar("SELECT has_table_privilege(%s, %s)", (literal, privilege)):
                raise self._denied(privilege, f"table {self.sink.schema}.{table}")

    def _require_create(self, what: str) -> None:
        if not self._scalar("SELECT has_schema_privilege(%s, 'CREATE')", (self.sink.schema,)):
            raise self._denied("CREATE", f"schema {self.sink.schema} (to create {what})")

    def _denied(self, privilege: str, on: str) -> Exception:
        user = self._scalar("SELECT current_user", ())
        return self.sink.err(SinkUnavailableError, f"permission denied: role {user!r} lacks "
                             f"the {privilege} privilege on {on}; GRANT {privilege} to it")

    def _check_columns(self) -> None:
        existing = self.t.columns(self.conn)
        wanted = self.sink.pg_types()
        problems = [f"{name} ({pg_type}) is missing" for name, pg_type in wanted.items()
                    if name not in existing and not self.sink.evolving]  # else added
        problems += [f"{name} is {existing[name]}, the batches' {dtype} needs {wanted[name]}"
                     for name, dtype in _arrow_types(self.sink).items()
                     if name in existing and not compatible(existing[name], wanted[name])]
        problems += [f"key column {k} is missing" for k in self.sink.key or ()
                     if k not in existing]
        if problems:
            raise self.sink.err(SchemaMismatchError, f"table {self.sink.schema}."
                                f"{self.sink.table} disagrees with the schema: "
                                + "; ".join(problems))

    def _check_evolving(self) -> None:
        """``add_columns``: writers create their stage tables in the schema, and the commit
        alters the target, which only its owner may do."""
        self._require_create("raysink's stage tables (schema_evolution='add_columns')")
        if not self.t.regclass(self.conn, self.sink.table):
            return
        literal = self.t.ident(self.sink.table).as_string(self.conn)
        if not self._scalar("SELECT pg_has_role(relowner, 'USAGE') FROM pg_class "
                            "WHERE oid = to_regclass(%s)", (literal,)):
            raise self.sink.err(SinkUnavailableError, f"schema_evolution='add_columns' alters "
                                f"table {self.sink.schema}.{self.sink.table}, which only its "
                                "owner may do; make the sink's role a member of the owner "
                                "role, or use schema_evolution='fail'")

    def _check_prepared(self) -> None:
        value = int(self._scalar("SELECT current_setting('max_prepared_transactions')::int", ()))
        if value <= 0:
            raise self.sink.err(SinkUnavailableError,
                                "method='prepared' needs max_prepared_transactions > 0 on the "
                                "server (set it and restart), or use method='staging'")


def _arrow_types(sink: Target) -> dict[str, str]:
    return {f.name: str(f.type) for f in sink.arrow_schema or ()}

