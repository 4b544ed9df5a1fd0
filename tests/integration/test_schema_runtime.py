"""Schema evolution through ``SinkRuntime`` with real actors, into every sink at once.

One runtime writes a Parquet directory, a Delta table, an Iceberg table and a PostgreSQL
table, all with ``schema_evolution="add_columns"`` (``ListSink``'s evolution is in
``tests/unit/test_schema_evolution.py``). Epoch 2 adds a
column on one writer only (the other writer's table lacks it); the coordinator is SIGKILLed
between its PENDING record and any sink commit (what each target shows at a crash inside
its commit is in ``tests/unit/test_schema_evolution.py`` and
``tests/integration/test_postgres_schema.py``). After recovery each target holds the new
schema with every row once, by one commit (nulls where the column was missing), the
replay of epoch 2 is skipped, and a change that is no widening is refused, naming the
column, with nothing written. Every target is read back with its own reader and compared
row by row.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from raysink import SinkRuntime
from raysink.errors import SchemaMismatchError
from raysink.testing import arm_fault, fired
from tests.integration.real_targets import (
    DeltaTarget,
    IcebergTarget,
    ParquetTarget,
    PostgresTarget,
    Target,
)
from tests.support.postgres import PostgresServer

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.timeout(240)]

ROWS = 200


def _rows(epoch: int, extra: bool, part: int = 0) -> pa.Table:
    """Half ``part`` of epoch ``epoch``'s rows (ids ``epoch * 1000 + i``); with ``extra``
    the new column, ``extra = id * 10``."""
    ids = [epoch * 1000 + i for i in range(part * ROWS // 2, (part + 1) * ROWS // 2)]
    columns: dict[str, Any] = {"id": pa.array(ids, pa.int64()),
                               "value": [f"v{i}" for i in ids]}
    if extra:
        columns["extra"] = pa.array([i * 10 for i in ids], pa.int64())
    return pa.table(columns)


def _contents(target: Target) -> list[tuple[Any, ...]]:
    """``(id, value[, extra])`` of every row the target's readers see, sorted."""
    table = target.table()
    assert table is not None
    names = [n for n in ("id", "value", "extra") if n in table.column_names]
    return sorted(zip(*(table.column(n).to_pylist() for n in names), strict=True))


def _expected(epochs: dict[int, tuple[bool, bool]]) -> list[tuple[Any, ...]]:
    """The rows of ``epochs`` (epoch -> whether each half had ``extra``; null where not)."""
    return sorted((row["id"], row["value"], row.get("extra"))
                  for epoch, halves in epochs.items()
                  for part, extra in enumerate(halves)
                  for row in _rows(epoch, extra, part).to_pylist())


def test_a_schema_change_in_every_sink_survives_a_coordinator_kill(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pg_server: PostgresServer,
        schema: str, name: str, meta: str) -> None:
    monkeypatch.chdir(tmp_path)  # the default Iceberg catalog lives under <cwd>/.raysink
    targets: dict[str, Target] = {
        "parquet": ParquetTarget(tmp_path / "parquet"),
        "delta": DeltaTarget(tmp_path / "delta"),
        "iceberg": IcebergTarget(tmp_path),
        "postgres": PostgresTarget(pg_server, schema),
    }
    sinks = {kind: t.sink(schema_evolution="add_columns") for kind, t in targets.items()}
    with SinkRuntime(name, sinks, writers=2, metastore=meta, progress=False,
                     commit_timeout=90, retry_cap=0.5) as rt:
        assert rt.write_arrow([_rows(1, False, 0), _rows(1, False, 1)]).committed

        arm_fault(name, "coordinator.after_pending", action="kill", when={"epoch": 2})
        second = rt.write_arrow([_rows(2, False, 0), _rows(2, True, 1)])
        assert fired(name, "coordinator.after_pending"), "the coordinator was never killed"
        # decided before the crash: rolled forward by the new coordinator, not fed again
        assert (second.epoch, second.committed, second.attempts) == (2, True, 1)
        for kind, target in targets.items():
            assert target.commit_epochs(name, kind) == [1, 2], kind  # one commit each

        replay = rt.write_arrow([_rows(2, True, 0), _rows(2, True, 1)], epoch=2)
        assert replay.skipped
        with pytest.raises(SchemaMismatchError, match="'extra'") as info:
            rt.write_arrow(_rows(3, False, 0).append_column("extra", pa.array(
                ["x"] * (ROWS // 2))))
        assert info.value.column == "extra"
        assert rt.write_arrow([_rows(3, True, 0), _rows(3, False, 1)], epoch=3).committed

    want = _expected({1: (False, False), 2: (False, True), 3: (True, False)})
    for kind, target in targets.items():
        assert _contents(target) == want, kind


def test_feeds_of_one_epoch_adding_a_column(tmp_path: Path, name: str, meta: str) -> None:
    """Producers (``ep.feed()``) of one epoch: one feed's second write adds a column
    (its first lacks it), another feed has it throughout; with ``add_columns`` the epoch
    commits their union, nulls where a write lacked the column. A write with no union
    with the feed's earlier ones is refused at once, naming the column."""
    target = ParquetTarget(tmp_path / "parquet")
    with SinkRuntime(name, target.sink(schema_evolution="add_columns"), writers=2,
                     metastore=meta, progress=False) as rt:
        ep = rt.open_epoch()
        with ep.feed() as first:
            first.write(_rows(1, False, 0))
            first.write(_rows(1, True, 1).slice(0, 10))  # the column, from here on
            with pytest.raises(SchemaMismatchError, match="'value'") as info:
                first.write(_rows(9, False, 0).set_column(
                    1, "value", pa.array(range(ROWS // 2), pa.int64())))
            assert info.value.column == "value"
        with ep.feed() as second:
            second.write(_rows(1, True, 1).slice(10))
        assert ep.commit().committed
    assert _contents(target) == _expected({1: (False, True)})
