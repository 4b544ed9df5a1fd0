"""The upgrade test: each previous release (the wheels kept in ``tests/upgrade/releases``,
v0.1.0 and v0.2.0, each installed into an environment of its own:
``tests/upgrade/release.py``) runs a runtime into every sink (Parquet, Delta,
Iceberg, PostgreSQL, Kafka) and is SIGKILLed, Ray and all, with epoch 2 decided and not
committed (PENDING in the meta store) and epoch 3 staged and not decided
(``tests/upgrade/old_driver.py``). This raysink then opens the same meta store (migrating
it when the release wrote an older schema version) and the same targets: it commits epoch 2 exactly
once, discards what the old epoch 3 staged, and writes epochs 3 and 4 itself. Each
target must hold exactly epochs 1 and 2 as the old driver wrote them and epochs 3 and 4 as
this one did (``feed`` tells the drivers' rows apart). Run with a SQLite meta store and
with a PostgreSQL one.

``@pytest.mark.upgrade``: not in the default run. ``make upgrade`` (``scripts/upgrade.sh``)
runs it from this release's wheel installed into a fresh environment, from a copy of the
tests outside the source tree; ``pytest tests/upgrade -m upgrade`` runs it from the source
tree while developing.
"""

from __future__ import annotations

import sqlite3
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from raysink import SinkRuntime
from raysink.coordinator.metastore._versions import SCHEMA_VERSION
from tests.chaos.driver_kill import reopen
from tests.chaos.targets import read_target
from tests.support.kafka import KafkaBroker
from tests.support.postgres import PostgresServer
from tests.upgrade.old_driver import build_sink, epoch_table
from tests.upgrade.release import OldDriver, previous_release, stored_releases

pytestmark = [pytest.mark.upgrade, pytest.mark.timeout(1500)]

PREVIOUS = tuple(stored_releases())
ROWS = 40
KINDS = ("parquet", "delta", "iceberg", "postgres", "kafka")


def _specs(tmp_path: Path, pg: PostgresServer, kafka: KafkaBroker) -> dict[str, Any]:
    suffix = uuid.uuid4().hex[:8]
    return {
        "parquet": {"kind": "parquet", "path": str(tmp_path / "parquet")},
        "delta": {"kind": "delta", "path": str(tmp_path / "delta")},
        "iceberg": {"kind": "iceberg", "identifier": "chaos.t",
                    "catalog": {"uri": f"sqlite:///{tmp_path / 'catalog.db'}",
                                "warehouse": f"file://{tmp_path / 'warehouse'}"}},
        "postgres": {"kind": "postgres", "dsn": pg.dsn(), "table": f"upgrade_{suffix}"},
        "kafka": {"kind": "kafka", "bootstrap": kafka.bootstrap, "topic": f"upgrade-{suffix}"},
    }


@dataclass
class Meta:
    """The meta store both releases open, and a way to read it behind raysink's back
    (opening it would migrate it)."""

    url: str
    rows: Callable[[str], list[tuple[Any, ...]]]
    has_table: Callable[[str], bool]


def _sqlite_meta(path: Path) -> Meta:
    def rows(sql: str) -> list[tuple[Any, ...]]:
        with sqlite3.connect(path) as conn:
            return [tuple(row) for row in conn.execute(sql).fetchall()]

    return Meta(f"sqlite:///{path}", rows, lambda table: bool(rows(
        f"SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = '{table}'")))


def _postgres_meta(pg: PostgresServer) -> Meta:
    dbname = f"upgrade_{uuid.uuid4().hex[:8]}"
    pg.create_database(dbname, "raysink")

    def rows(sql: str) -> list[tuple[Any, ...]]:
        return pg.execute(sql, dbname=dbname)

    return Meta(pg.dsn(dbname=dbname), rows, lambda table: bool(rows(
        f"SELECT to_regclass('{table}') IS NOT NULL")[0][0]))


def _rows(table: pa.Table) -> list[tuple[int, int, int]]:
    return sorted(zip(*(table.column(c).to_pylist() for c in ("id", "epoch", "feed")),
                      strict=True))


def _expected() -> list[tuple[int, int, int]]:
    tables = [epoch_table(1, ROWS, 0), epoch_table(2, ROWS, 0), epoch_table(3, ROWS, 1),
              epoch_table(4, ROWS, 1)]
    return sorted(row for table in tables for row in _rows(table))


@pytest.mark.parametrize("store", ["sqlite", "postgres"])
@pytest.mark.parametrize("tag", PREVIOUS)
def test_a_pending_epoch_of_a_previous_release_commits_once_after_the_upgrade(
        tmp_path: Path, pg_server: PostgresServer, kafka_broker: KafkaBroker,
        ray_session: None, name: str, tag: str, store: str) -> None:
    release = previous_release(tag)
    specs = _specs(tmp_path, pg_server, kafka_broker)
    meta = _sqlite_meta(tmp_path / "meta.db") if store == "sqlite" else _postgres_meta(pg_server)
    (tmp_path / "state").mkdir()
    config = {"name": name, "rows": ROWS, "state": str(tmp_path / "state"), "sinks": specs,
              "metastore": meta.url}

    # the previous release: epoch 1 committed, 2 decided, 3 staged; then SIGKILLed
    old = OldDriver(release, config, tmp_path)
    try:
        version, where = old.wait_for("RAYSINK ", 120).split()[1:]
        assert version == release.version and where.startswith(str(release.python.parents[1]))
        assert old.wait_for("COMMITTED 1", 900) == "COMMITTED 1 True"
        assert old.wait_for("DECIDED 2", 300) == "DECIDED 2 False"
        old.wait_for("STAGED 3", 300)
        assert old.ray_pids(), "the old driver's Ray processes cannot be told apart"
        old.kill()
        assert old.ray_pids() == []
    finally:
        old.cleanup()
    assert meta.has_table("raysink_epochs")
    if release.schema == 1:  # before the version was kept
        assert not meta.has_table("raysink_schema")
    else:
        assert meta.rows("SELECT version FROM raysink_schema") == [(release.schema,)]
    states = meta.rows("SELECT epoch, sink, state FROM raysink_epochs ORDER BY 1, 2")
    assert [(e, s) for e, _, s in states if e == 2] == [(2, "PENDING")] * len(KINDS)
    assert [s for e, _, s in states if e == 3] in ([], ["OPEN"] * len(KINDS))

    # this raysink: the same meta store and targets
    sinks = {kind: build_sink(spec) for kind, spec in specs.items()}
    rt = reopen(lambda: SinkRuntime(name, sinks, writers=2, metastore=meta.url,
                                    flush_interval=0.2, retry_cap=0.5, progress=False),
                timeout=120.0)
    try:
        for epoch in (3, 4):
            report = rt.write_arrow(epoch_table(epoch, ROWS, 1), epoch=epoch)
            assert report.committed and not report.skipped, report
    finally:
        rt.close()

    assert meta.rows("SELECT version FROM raysink_schema") == [(SCHEMA_VERSION,)]
    expected = _expected()
    found = {kind: _rows(read_target(spec, pg_server)) for kind, spec in specs.items()}
    assert {kind: rows == expected for kind, rows in found.items()} == {k: True for k in KINDS}
