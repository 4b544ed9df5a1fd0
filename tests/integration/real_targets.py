"""Real targets for the sink tests: build the sink, read the target back.

Each target reads what a reader of the real table sees (``pyarrow.dataset``,
``deltalake``, ``pyiceberg``, SQL, ``ListSink.read``), lists the commits that carry a
sink's marker, one entry per commit, so a second commit of an epoch shows as a repeated
epoch, and names what of a set of manifests is still staged (neither committed nor
removed).
"""

from __future__ import annotations

import json
import shutil
import uuid
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.dataset as ds
import pytest
from psycopg import sql

from raysink.sinks.base import Manifest, Sink
from raysink.sinks.delta import DeltaSink
from raysink.sinks.iceberg import IcebergSink
from raysink.sinks.parquet import ParquetSink
from raysink.sinks.postgres import PostgresSink
from raysink.testing import ListSink
from tests.support.postgres import PostgresServer

__all__ = [
    "DeltaTarget",
    "IcebergTarget",
    "ListTarget",
    "ParquetTarget",
    "PostgresTarget",
    "Target",
    "assert_ids_exact",
    "expected_ids",
    "make_target",
    "pg_schema",
]


def expected_ids(epochs: Sequence[int], rows: int) -> Counter[int]:
    """The ids ``tests.integration.helpers.epoch_table`` puts in ``epochs``."""
    return Counter(e * 1_000_000 + i for e in epochs for i in range(rows))


def assert_ids_exact(seen: Sequence[int], epochs: Sequence[int], rows: int, *,
                     before: Sequence[int] = ()) -> None:
    """Every row of ``epochs`` exactly once, the ids seen ``before`` (a runtime shared by a
    module's tests) as they were, nothing else."""
    got, want = Counter(seen), Counter(before) + expected_ids(epochs, rows)
    doubled = sorted(k for k, v in got.items() if v > max(want[k], 1))
    missing = sorted(k for k, v in want.items() if got[k] < v)
    extra = sorted(set(got) - set(want))
    assert not doubled, f"rows written twice: {doubled[:10]} ({len(doubled)} in all)"
    assert not missing, f"rows lost: {missing[:10]} ({len(missing)} in all)"
    assert not extra, f"rows from nowhere: {extra[:10]} ({len(extra)} in all)"


class Target:
    """One real table: ``sink()`` builds a fresh (unbound) sink description for it."""

    kind = "abstract"

    def sink(self, **options: Any) -> Sink:
        raise NotImplementedError

    def table(self) -> pa.Table | None:
        """Everything a reader sees, or ``None`` when the table does not exist."""
        raise NotImplementedError

    def commit_epochs(self, runtime: str, sink: str = "main") -> list[int]:
        """The epoch of every commit carrying ``raysink:<runtime>:<sink>``, in order."""
        raise NotImplementedError

    def delete(self) -> None:
        """Delete the table, as a user would."""
        raise NotImplementedError

    def staged(self, manifests: Sequence[Manifest]) -> list[str]:
        """What ``manifests`` staged that is still there and not part of the table."""
        raise NotImplementedError

    def ids(self) -> list[int]:
        table = self.table()
        if table is None or "id" not in table.column_names:
            return []
        return [int(v) for v in table.column("id").to_pylist()]

    def values(self, column: str = "value") -> dict[int, Any]:
        """``id -> column`` (ids must be unique, as in an upsert table)."""
        table = self.table()
        if table is None:
            return {}
        ids = table.column("id").to_pylist()
        assert len(ids) == len(set(ids)), "an upsert table holds a key twice"
        return dict(zip(ids, table.column(column).to_pylist(), strict=True))


class _DirectoryTarget(Target):
    """A target that is one directory, deleted as a whole."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def delete(self) -> None:
        shutil.rmtree(self.path)


class DeltaTarget(_DirectoryTarget):
    kind = "delta"

    def sink(self, **options: Any) -> Sink:
        return DeltaSink(str(self.path), **options)

    def table(self) -> pa.Table | None:
        from deltalake import DeltaTable

        if not (self.path / "_delta_log").is_dir():
            return None
        return DeltaTable(str(self.path)).to_pyarrow_table()

    def commit_epochs(self, runtime: str, sink: str = "main") -> list[int]:
        app_id = f"raysink:{runtime}:{sink}"
        found: list[int] = []
        log_dir = self.path / "_delta_log"
        for entry in sorted(log_dir.glob("*.json")) if log_dir.is_dir() else []:
            for line in entry.read_text().splitlines():
                txn = json.loads(line).get("txn") if line.strip() else None
                if txn and txn.get("appId") == app_id:
                    found.append(int(txn["version"]))
        return found

    def versions(self) -> int:
        return len(list((self.path / "_delta_log").glob("*.json")))

    def staged(self, manifests: Sequence[Manifest]) -> list[str]:
        from deltalake import DeltaTable

        added: set[str] = set()
        if (self.path / "_delta_log").is_dir():
            actions = DeltaTable(str(self.path)).get_add_actions(flatten=False)
            added = set(actions.column("path").to_pylist())
        return [f["path"] for m in manifests for f in m["files"]
                if (self.path / f["path"]).exists() and f["path"] not in added]


class IcebergTarget(Target):
    """An Iceberg table in the default catalog under ``cwd`` (the test chdirs there)."""

    kind = "iceberg"

    def __init__(self, cwd: Path, identifier: str = "ns.events") -> None:
        from raysink.sinks.iceberg import default_catalog

        self.identifier = identifier
        self.props = default_catalog(str(cwd))

    def sink(self, **options: Any) -> Sink:
        return IcebergSink(self.identifier, **options)

    def _catalog(self) -> Any:
        from pyiceberg.catalog import load_catalog

        return load_catalog("raysink", **self.props)

    def _load(self) -> Any | None:
        from pyiceberg.exceptions import NoSuchNamespaceError, NoSuchTableError

        catalog_file = Path(self.props["uri"].removeprefix("sqlite:///"))
        if not catalog_file.exists():
            return None
        try:
            return self._catalog().load_table(self.identifier)
        except (NoSuchTableError, NoSuchNamespaceError):
            return None

    def table(self) -> pa.Table | None:
        table = self._load()
        return None if table is None else table.scan().to_arrow()

    def commit_epochs(self, runtime: str, sink: str = "main") -> list[int]:
        table = self._load()
        if table is None:
            return []
        marker = f"raysink:{runtime}:{sink}"
        snapshots = sorted(table.snapshots(), key=lambda s: s.sequence_number)
        return [int(s.summary["raysink.epoch"]) for s in snapshots
                if s.summary is not None and s.summary.get("raysink.sink") == marker]

    def staged(self, manifests: Sequence[Manifest]) -> list[str]:
        table = self._load()
        data = set() if table is None else set(
            table.inspect.files().column("file_path").to_pylist())
        return [f["path"] for m in manifests for f in m["files"]
                if Path(f["path"].removeprefix("file://")).exists() and f["path"] not in data]

    def delete(self) -> None:
        self._catalog().drop_table(self.identifier)


class ParquetTarget(_DirectoryTarget):
    """A ``ParquetSink`` directory, read with ``pyarrow.dataset`` (which skips
    ``_raysink``)."""

    kind = "parquet"

    def sink(self, **options: Any) -> Sink:
        return ParquetSink(str(self.path), **options)

    def table(self) -> pa.Table | None:
        """Read in the directory's schema (its newest commit log entry's): files written
        before a column was added read as nulls there."""
        if not self.path.is_dir():
            return None
        schema = ParquetSink(str(self.path)).table_schema()
        return ds.dataset(str(self.path), schema=schema, format="parquet").to_table()

    def commit_epochs(self, runtime: str, sink: str = "main") -> list[int]:
        entries = [json.loads(p.read_text())
                   for p in sorted((self.path / "_raysink" / "commits").glob("*.json"))]
        return [int(e["epoch"]) for e in entries
                if (e["runtime"], e["sink"]) == (runtime, sink)]

    def staged(self, manifests: Sequence[Manifest]) -> list[str]:
        return [f["path"] for m in manifests for f in m["files"]
                if (self.path / f["path"]).exists()]


class ListTarget(_DirectoryTarget):
    """A ``raysink.testing.ListSink`` directory (one sink's: its markers carry no name)."""

    kind = "list"

    def sink(self, **options: Any) -> Sink:
        return ListSink(self.path, **options)

    def table(self) -> pa.Table | None:
        return ListSink(self.path).read() if self.path.is_dir() else None

    def commit_epochs(self, runtime: str, sink: str = "main") -> list[int]:
        return ListSink(self.path).committed_epochs()

    def staged(self, manifests: Sequence[Manifest]) -> list[str]:
        return [f["path"] for m in manifests for f in m["files"]
                if (self.path / f["path"]).exists()]


class PostgresTarget(Target):
    """A table in its own schema of the test server's ``raysink`` database."""

    kind = "postgres"

    def __init__(self, pg: PostgresServer, schema: str, table: str = "events") -> None:
        self.pg = pg
        self.schema = schema
        self.name = table

    def sink(self, **options: Any) -> Sink:
        options.setdefault("schema", self.schema)
        dsn = options.pop("dsn", self.pg.dsn())
        return PostgresSink(dsn, self.name, **options)

    def _query(self, query: sql.Composable, params: Any = None) -> list[tuple[Any, ...]]:
        return self.pg.execute(query.as_string(None), params, dbname="raysink")

    def exists(self, table: str | None = None) -> bool:
        found = self._query(sql.SQL("SELECT to_regclass({})").format(
            sql.Literal(f'"{self.schema}"."{table or self.name}"')))
        return found[0][0] is not None

    def table(self) -> pa.Table | None:
        if not self.exists():
            return None
        cursor_rows = self._query(sql.SQL("SELECT * FROM {}").format(
            sql.Identifier(self.schema, self.name)))
        columns = self._query(sql.SQL(
            "SELECT column_name FROM information_schema.columns WHERE table_schema = {} "
            "AND table_name = {} ORDER BY ordinal_position").format(
                sql.Literal(self.schema), sql.Literal(self.name)))
        names = [c[0] for c in columns]
        return pa.table({n: [r[i] for r in cursor_rows] for i, n in enumerate(names)})

    def commit_epochs(self, runtime: str, sink: str = "main") -> list[int]:
        if not self.exists("_raysink_progress"):
            return []
        found = self._query(sql.SQL(
            "SELECT epoch FROM {} WHERE runtime = %s AND sink = %s AND writer = -1 "
            "ORDER BY epoch").format(sql.Identifier(self.schema, "_raysink_progress")),
            (runtime, sink))
        return [int(r[0]) for r in found]

    def delete(self) -> None:
        self._query(sql.SQL("DROP TABLE {}").format(sql.Identifier(self.schema, self.name)))

    def staged(self, manifests: Sequence[Manifest]) -> list[str]:
        """Prepared transactions of ``manifests`` still open, and staging rows of their
        tokens still in a ``_raysink_stage_*`` table."""
        gids = [m["gid"] for m in manifests if m.get("gid")]
        left = [f"gid {g}" for (g,) in self.pg.execute(
            "SELECT gid FROM pg_prepared_xacts WHERE gid = ANY(%s)", (gids,))]
        tokens = [int(m["token"]) for m in manifests if m.get("token") is not None]
        stages = self._query(sql.SQL(
            "SELECT relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE nspname = {} AND relname LIKE '\\_raysink\\_stage\\_%'").format(
                sql.Literal(self.schema)))
        for (stage,) in stages:
            left += [f"token {t} in {stage}" for (t,) in self._query(sql.SQL(
                "SELECT DISTINCT _raysink_token FROM {} WHERE _raysink_token = ANY(%s)").format(
                    sql.Identifier(self.schema, stage)), (tokens,))]
        return left

    def delete_marker(self) -> None:
        """Drop the progress table (every marker of the schema)."""
        self._query(sql.SQL("DROP TABLE {}").format(
            sql.Identifier(self.schema, "_raysink_progress")))


def pg_schema(pg: PostgresServer) -> Iterator[str]:
    """A fresh schema owned by ``raysink`` (for a fixture); dropped afterwards, with any
    prepared transaction left in the database rolled back first."""
    name = f"s_{uuid.uuid4().hex[:10]}"
    pg.execute(f'CREATE SCHEMA "{name}" AUTHORIZATION raysink', dbname="raysink")
    yield name
    for (gid,) in pg.execute("SELECT gid FROM pg_prepared_xacts WHERE database = 'raysink'"):
        pg.execute(sql.SQL("ROLLBACK PREPARED {}").format(sql.Literal(gid)).as_string(None),
                   dbname="raysink")
    pg.execute(f'DROP SCHEMA "{name}" CASCADE', dbname="raysink")


def make_target(kind: str, root: Path, request: pytest.FixtureRequest,
                monkeypatch: pytest.MonkeyPatch) -> Target:
    """A real target of ``kind`` (``parquet``, ``delta``, ``iceberg``, ``list``, or
    ``postgres``/``postgres-<method>``) under ``root``; PostgreSQL in a fresh schema."""
    if kind == "iceberg":
        monkeypatch.chdir(root)  # the default catalog lives under <cwd>/.raysink
        return IcebergTarget(root)
    if kind.startswith("postgres"):
        return PostgresTarget(request.getfixturevalue("pg_server"),
                              request.getfixturevalue("schema"))
    kinds: dict[str, type[ParquetTarget | DeltaTarget | ListTarget]] = {
        "parquet": ParquetTarget, "delta": DeltaTarget, "list": ListTarget}
    return kinds[kind](root / kind)
