"""The meta store's schema version, on SQLite (a tmp file) and PostgreSQL (``pg_server``):
a store raysink 0.1.0 made (no version table: version 1) is migrated forward when opened,
once, also by two drivers opening it at the same moment; a store a newer raysink wrote is
refused with ``NewerVersionError`` and left as it is. Each PostgreSQL case has a database
of its own (the other meta store tests share one). No Ray is started here."""

from __future__ import annotations

import sqlite3
import threading
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from raysink.coordinator.metastore import EpochState, MetaStore, open_metastore
from raysink.coordinator.metastore._versions import SCHEMA_VERSION
from raysink.errors import MetaStoreError, NewerVersionError
from tests.support.postgres import PostgresServer

# What raysink 0.1.0 created (git show v0.1.0:raysink/coordinator/metastore/_sql.py),
# and the rows of a runtime it left with epoch 1 committed and epoch 2 PENDING.
V1_TABLES = (
    """CREATE TABLE raysink_runtimes (name TEXT PRIMARY KEY, generation BIGINT NOT NULL,
        sinks TEXT NOT NULL, dropped TEXT NOT NULL, epoch_source TEXT,
        updated_at DOUBLE PRECISION NOT NULL)""",
    """CREATE TABLE raysink_epochs (runtime TEXT NOT NULL, sink TEXT NOT NULL,
        epoch BIGINT NOT NULL, attempt BIGINT NOT NULL,
        state TEXT NOT NULL CHECK (state IN ('OPEN', 'PENDING', 'COMMITTED', 'ABORTED')),
        layout TEXT NOT NULL, manifests TEXT, updated_at DOUBLE PRECISION NOT NULL,
        marked INTEGER NOT NULL DEFAULT 1, PRIMARY KEY (runtime, sink, epoch))""",
    """CREATE TABLE raysink_sink_status (runtime TEXT NOT NULL, sink TEXT NOT NULL,
        state TEXT NOT NULL, last_error TEXT, history TEXT NOT NULL,
        updated_at DOUBLE PRECISION NOT NULL, PRIMARY KEY (runtime, sink))""",
    """CREATE TABLE raysink_leases (runtime TEXT PRIMARY KEY, holder TEXT NOT NULL,
        owner TEXT NOT NULL, token BIGINT NOT NULL, expires_at DOUBLE PRECISION NOT NULL)""",
)
V1_ROWS = (
    """INSERT INTO raysink_runtimes VALUES ('old', 3, '{"a": "parquet"}', '[]', NULL, 1.0)""",
    """INSERT INTO raysink_epochs VALUES ('old', 'a', 1, 1, 'COMMITTED', '{}', '[]', 1.0, 1)""",
    """INSERT INTO raysink_epochs VALUES ('old', 'a', 2, 1, 'PENDING', '{}',
        '[{"writer": 0, "rows": 5, "epoch": 2, "attempt": 1}]', 1.0, 1)""",
)


@dataclass
class Place:
    """Where a store lives and a raw connection to it behind raysink's back."""

    url: str
    raw: Callable[[str], list[tuple[Any, ...]]]


def _sqlite(path: Path) -> Place:
    def raw(sql: str) -> list[tuple[Any, ...]]:
        with sqlite3.connect(path) as conn:
            return [tuple(r) for r in conn.execute(sql).fetchall()]

    return Place(f"sqlite:///{path}", raw)


def _postgres(server: PostgresServer) -> Place:
    dbname = f"v_{uuid.uuid4().hex[:10]}"
    server.create_database(dbname, "raysink")
    dsn = server.dsn(dbname=dbname)

    def raw(sql: str) -> list[tuple[Any, ...]]:
        import psycopg

        with psycopg.connect(dsn, autocommit=True) as conn:
            cursor = conn.execute(sql)  # type: ignore[arg-type]
            return [tuple(r) for r in cursor.fetchall()] if cursor.description else []

    return Place(dsn, raw)


@pytest.fixture(params=["sqlite", "postgres"])
def place(request: pytest.FixtureRequest, tmp_path: Path) -> Place:
    if request.param == "sqlite":
        return _sqlite(tmp_path / "store.db")
    return _postgres(request.getfixturevalue("pg_server"))


@pytest.fixture
def v1_place(place: Place) -> Place:
    for statement in V1_TABLES + V1_ROWS:
        place.raw(statement)
    return place


@pytest.fixture
def opened() -> Iterator[list[MetaStore]]:
    stores: list[MetaStore] = []
    yield stores
    for store in stores:
        store.close()


def _open(place: Place, opened: list[MetaStore]) -> MetaStore:
    store = open_metastore(place.url, "old")
    opened.append(store)
    return store


def _version(place: Place) -> tuple[Any, ...]:
    return place.raw("SELECT version, raysink FROM raysink_schema")[0]


def test_a_new_store_is_created_at_this_version(place: Place, opened: list[MetaStore]) -> None:
    import raysink

    _open(place, opened)
    assert _version(place) == (SCHEMA_VERSION, raysink.__version__)


def test_a_store_of_version_1_is_migrated_and_its_pending_epoch_kept(
        v1_place: Place, opened: list[MetaStore]) -> None:
    """Raysink 0.1.0's store: the new column and the version row appear, the PENDING
    epoch and its manifests are as 0.1.0 left them, and new records say who wrote them."""
    import raysink

    store = _open(v1_place, opened)
    assert _version(v1_place) == (SCHEMA_VERSION, raysink.__version__) and SCHEMA_VERSION == 2
    records = {r.epoch: r for r in store.records("old")}
    assert [(r.epoch, r.state, r.written_by) for r in records.values()] == [
        (1, EpochState.COMMITTED, None), (2, EpochState.PENDING, None)]
    assert records[2].manifests == [{"writer": 0, "rows": 5, "epoch": 2, "attempt": 1}]
    generation = store.claim("old", {"a": "parquet"}).generation
    assert generation == 4
    store.put_committed("old", generation, 2, "a")
    store.put_open("old", generation, 3, 1, ["a"], {})
    assert [(r.epoch, r.written_by) for r in store.records("old")] == [
        (2, None), (3, raysink.__version__)]
    store.close()
    _open(v1_place, opened)  # reopened at its version: nothing to do
    assert _version(v1_place)[0] == SCHEMA_VERSION


def test_two_drivers_opening_a_version_1_store_at_once_migrate_it_once(
        v1_place: Place, opened: list[MetaStore]) -> None:
    """Both open it (the second waits for the first's lock, then finds it migrated); the
    store ends at this version with one version row and its records intact."""
    start = threading.Barrier(4)

    def open_at_once(_: int) -> MetaStore:
        start.wait(timeout=30)
        return open_metastore(v1_place.url, "old")

    with ThreadPoolExecutor(4) as pool:
        stores = list(pool.map(open_at_once, range(4)))
    opened.extend(stores)
    assert v1_place.raw("SELECT COUNT(*), MAX(version) FROM raysink_schema") == [
        (1, SCHEMA_VERSION)]
    for store in stores:
        assert [r.state for r in store.records("old")] == [EpochState.COMMITTED,
                                                           EpochState.PENDING]


def test_a_store_of_a_newer_raysink_is_refused_and_left_as_it_is(
        place: Place, opened: list[MetaStore]) -> None:
    _open(place, opened).close()
    place.raw("UPDATE raysink_schema SET version = 99, raysink = '9.9.0'")
    with pytest.raises(NewerVersionError) as info:
        _open(place, opened)
    error = info.value
    assert isinstance(error, MetaStoreError)
    assert (error.what, error.found, error.supported) == ("meta store schema", 99,
                                                          SCHEMA_VERSION)
    message = str(error)
    assert "schema version 99" in message and "raysink 9.9.0" in message
    assert f"up to {SCHEMA_VERSION}" in message and "never migrated backwards" in message
    assert _version(place) == (99, "9.9.0")
