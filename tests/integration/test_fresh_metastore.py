"""A runtime reopened with a fresh meta store never loses or doubles rows.

The default meta store, ``sqlite:///<cwd>/.raysink/<name>.db``, is fresh whenever a job
starts from another directory. Its targets still hold the markers of the epochs the same
runtime committed before. Each case writes epochs 1-3 with one meta store, then opens the
same runtime name and sinks with an empty one (one runtime holds a sink of every kind, so
each kind's marker is read where it counts):

* an implicit epoch (``write_arrow(t)``) is refused with a ``RaySinkError`` naming both
  the meta store and the target, before anything is written;
* explicit replays of epochs the targets hold are skipped and write nothing;
* an explicit new epoch is written once; afterwards the store knows it and implicit
  numbering goes on after it;
* ``epoch_offset=`` acknowledges the targets: implicit epochs start after it, never at or
  below a target's marker (a lower offset is a ``ConfigError``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from raysink import SinkRuntime
from raysink.errors import ConfigError, RaySinkError
from raysink.sinks.base import Sink
from tests.integration.helpers import epoch_table
from tests.integration.real_targets import (
    DeltaTarget,
    IcebergTarget,
    ParquetTarget,
    Target,
    assert_ids_exact,
    make_target,
)

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.timeout(240)]

ROWS = 200
KINDS = ["parquet", "delta", "iceberg", "postgres"]
# One writer per sink: what this module checks is each target's marker against the meta
# store, which the driver and the coordinator read before any writer gets a row; the
# writers' number plays no part (two writers' parts of one epoch, committed once after a
# crash, are test_sinks_runtime's). A writer fewer per sink is 37 fewer actor processes
# in this module: 105 CPU-s against 154 (the module alone, in a cgroup).
WRITERS = 1


def _targets(kinds: list[str], request: pytest.FixtureRequest, tmp_path: Path,
             monkeypatch: pytest.MonkeyPatch) -> dict[str, Target]:
    """A target of each kind, by the name of its sink in one runtime."""
    return {kind: make_target(kind, tmp_path, request, monkeypatch) for kind in kinds}


def _sinks(targets: dict[str, Target]) -> dict[str, Sink]:
    return {kind: target.sink() for kind, target in targets.items()}


def _assert_ids(targets: dict[str, Target], epochs: list[int]) -> None:
    for target in targets.values():
        assert_ids_exact(target.ids(), epochs, ROWS)


def _runtime(name: str, sinks: Sink | dict[str, Sink], meta: str, **options: Any) -> SinkRuntime:
    return SinkRuntime(name, sinks, writers=WRITERS, metastore=meta, progress=False,
                       retry_cap=0.5, **options)


def _three_epochs(name: str, sinks: Sink | dict[str, Sink], meta: str) -> None:
    with _runtime(name, sinks, meta) as rt:
        for epoch in (1, 2, 3):
            report = rt.write_arrow(epoch_table(epoch, ROWS))
            assert (report.epoch, report.committed) == (epoch, True)


@pytest.mark.timeout(600)  # four sinks' work of 240 s each, at most
def test_fresh_metastore(request: pytest.FixtureRequest, tmp_path: Path,
                         monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """Epochs 1-3 with one meta store, then the same runtime with fresh ones, into a sink
    of every kind at once.

    Today's silent loss: a fresh store made the next write epoch 1, which the target's
    marker already holds: reported committed, and the rows were in no table. Now the
    implicit write is refused, names both sides (every sink, with the epoch its target
    holds) and says what to do, and writes nothing; explicit replays are skipped by every
    sink (never doubled); an explicit new epoch is written, after which implicit numbering
    follows it. With another fresh store, ``epoch_offset=`` below the marker is refused
    and above it numbers implicit epochs after it."""
    targets = _targets(KINDS, request, tmp_path, monkeypatch)
    _three_epochs(name, _sinks(targets), f"sqlite:///{tmp_path / 'original.db'}")

    fresh = f"sqlite:///{tmp_path / 'elsewhere' / 'fresh.db'}"
    with _runtime(name, _sinks(targets), fresh) as rt:
        with pytest.raises(RaySinkError) as refused:
            rt.write_arrow(epoch_table(4, ROWS))
        message = str(refused.value)
        assert "fresh.db" in message, message
        for kind in KINDS:
            assert f"sink {kind!r} (" in message, message
        assert message.count("holds epoch 3") == len(KINDS), message
        assert "metastore=" in message and "epoch_offset=" in message, message
        _assert_ids(targets, [1, 2, 3])  # nothing of the refused write
        assert rt.status().last_committed_epoch is None
        for replay in (1, 3):
            report = rt.write_arrow(epoch_table(replay, ROWS), epoch=replay)
            assert (report.epoch, report.skipped, report.committed) == (replay, True, True)
            assert sorted(report.skipped_sinks) == sorted(KINDS)
        fourth = rt.write_arrow(epoch_table(4, ROWS), epoch=4)
        assert (fourth.epoch, fourth.committed, fourth.skipped) == (4, True, False)
        fifth = rt.write_arrow(epoch_table(5, ROWS))
        assert (fifth.epoch, fifth.committed) == (5, True)
    _assert_ids(targets, [1, 2, 3, 4, 5])

    another = f"sqlite:///{tmp_path / 'another.db'}"
    with (_runtime(name, _sinks(targets), another, epoch_offset=4) as rt,
          pytest.raises(ConfigError, match="epoch_offset=4 is below epoch 5")):
        rt.write_arrow(epoch_table(6, ROWS))
    with _runtime(name, _sinks(targets), another, epoch_offset=6) as rt:
        report = rt.write_arrow(epoch_table(7, ROWS))
        assert (report.epoch, report.committed, report.skipped) == (7, True, False)
    _assert_ids(targets, [1, 2, 3, 4, 5, 7])


def test_parquet_and_delta_fresh_default_metastore(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch,
                                                   name: str) -> None:
    """The issue's case as a user meets it: the default meta store (no ``metastore=``), a
    job started from another directory the second time. The 5,000 new rows are neither
    lost nor reported committed."""
    parquet, delta = ParquetTarget(tmp_path / "pq"), DeltaTarget(tmp_path / "delta")

    def sinks() -> dict[str, Sink]:
        return {"files": parquet.sink(), "lake": delta.sink()}

    (tmp_path / "first").mkdir()
    (tmp_path / "second").mkdir()
    monkeypatch.chdir(tmp_path / "first")
    with SinkRuntime(name, sinks(), writers=WRITERS, progress=False) as rt:
        for epoch in (1, 2, 3):
            assert rt.write_arrow(epoch_table(epoch, 1_000)).committed
    monkeypatch.chdir(tmp_path / "second")
    with (SinkRuntime(name, sinks(), writers=WRITERS, progress=False) as rt,
          pytest.raises(RaySinkError, match="metastore=")):
        rt.write_arrow(epoch_table(4, 5_000))
    with SinkRuntime(name, sinks(), writers=WRITERS, progress=False, epoch_offset=3) as rt:
        report = rt.write_arrow(epoch_table(4, 5_000))
        assert (report.epoch, report.rows, report.committed) == (4, 5_000, True)
    for target in (parquet, delta):
        ids = target.ids()
        assert len(ids) == 3 * 1_000 + 5_000 and len(set(ids)) == len(ids)


def test_a_new_streaming_query_over_a_fresh_metastore_is_refused(tmp_path: Path,
                                                                 name: str) -> None:
    """A streaming query wrote epochs 1-4; a new query (new checkpoint: batch ids from 0)
    is bound with a fresh meta store over the same table. Bound at offset 0, its batches
    0-3 would be epochs 1-4, each skipped as committed, and their rows lost while Spark
    moves on. Refused, naming both ways on; ``epoch_offset=4`` binds it after them."""
    target = ParquetTarget(tmp_path / "pq")
    with _runtime(name, target.sink(), f"sqlite:///{tmp_path / 'original.db'}") as rt:
        assert rt._bind_source("query-1") == 0
        for epoch in (1, 2, 3, 4):
            assert rt.write_arrow(epoch_table(epoch, ROWS), epoch=epoch).committed
    fresh = f"sqlite:///{tmp_path / 'elsewhere' / 'fresh.db'}"
    with _runtime(name, target.sink(), fresh) as rt:
        with pytest.raises(ConfigError) as refused:
            rt._bind_source("query-2")
        message = str(refused.value)
        assert "metastore=" in message and "epoch_offset=4" in message, message
        assert rt.status().last_committed_epoch is None
    with _runtime(name, target.sink(), fresh, epoch_offset=3) as rt, \
            pytest.raises(ConfigError, match="epoch_offset=3 is below epoch 4"):
        rt._bind_source("query-2")
    with _runtime(name, target.sink(), fresh, epoch_offset=4) as rt:
        assert rt._bind_source("query-2") == 4
        report = rt.write_arrow(epoch_table(5, ROWS), epoch=0 + 1 + 4)  # batch 0
        assert (report.epoch, report.committed, report.skipped) == (5, True, False)
    assert_ids_exact(target.ids(), [1, 2, 3, 4, 5], ROWS)


def test_a_lagging_sink_over_a_fresh_metastore_is_named(tmp_path: Path, name: str) -> None:
    """Sink 'files' holds epochs 1-4 but sink 'lake' only 1-2 (its epochs 3-4 were
    decided in a meta store that is gone). Going on after epoch 4 would leave 'lake'
    without them for good: an implicit epoch and a new query are refused whatever the
    offset, naming 'lake'; nothing is written to either target."""
    files, lake = ParquetTarget(tmp_path / "pq"), DeltaTarget(tmp_path / "delta")
    both = {"files": files.sink(), "lake": lake.sink()}
    with _runtime(name, both, f"sqlite:///{tmp_path / 'one.db'}") as rt:
        for epoch in (1, 2):
            assert rt.write_arrow(epoch_table(epoch, ROWS)).committed
    with _runtime(name, {"files": files.sink()}, f"sqlite:///{tmp_path / 'two.db'}") as rt:
        for epoch in (3, 4):
            assert rt.write_arrow(epoch_table(epoch, ROWS), epoch=epoch).committed
    fresh = f"sqlite:///{tmp_path / 'fresh.db'}"
    for offset in (None, 4):
        with _runtime(name, both, fresh, epoch_offset=offset) as rt:
            with pytest.raises(ConfigError, match="sink 'lake' holds epoch 2") as refused:
                rt.write_arrow(epoch_table(5, ROWS))
            assert refused.value.sink == "lake"
            with pytest.raises(ConfigError, match="sink 'lake' holds epoch 2"):
                rt._bind_source("query-2")
    assert_ids_exact(files.ids(), [1, 2, 3, 4], ROWS)
    assert_ids_exact(lake.ids(), [1, 2], ROWS)


def test_a_fresh_metastore_keeps_what_older_versions_reference(
        request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        name: str) -> None:
    """Epochs 1-2 committed, then each table (Delta and Iceberg, two sinks of one runtime)
    rewritten by another writer (a delete): the current version no longer references
    epoch 1's files, older versions still do. A runtime opened with a fresh meta store
    sweeps, at its start, the staging of the epochs it does not know: it used to delete
    epoch 1's files, and time travel to the version holding epoch 1 failed. An epoch the
    target's marker holds is not swept."""
    targets = _targets(["delta", "iceberg"], request, tmp_path, monkeypatch)
    _three_epochs(name, _sinks(targets), f"sqlite:///{tmp_path / 'original.db'}")
    old_versions = {kind: _rewrite_without_epoch_1(kind, target)
                    for kind, target in targets.items()}
    fresh = f"sqlite:///{tmp_path / 'fresh.db'}"
    with _runtime(name, _sinks(targets), fresh, epoch_offset=3) as rt:
        assert rt.write_arrow(epoch_table(4, ROWS)).committed
    for kind, target in targets.items():
        assert_ids_exact(target.ids(), [2, 3, 4], ROWS)
        assert_ids_exact(_ids_at(kind, target, old_versions[kind]), [1, 2, 3], ROWS)


def _rewrite_without_epoch_1(kind: str, target: Target) -> int:
    """Delete epoch 1's rows as another writer would; returns the version before it."""
    if kind == "delta":
        from deltalake import DeltaTable

        assert isinstance(target, DeltaTarget)
        table = DeltaTable(str(target.path))
        version = table.version()
        table.delete("id < 2000000")
        return int(version)
    from pyiceberg.expressions import LessThan

    assert isinstance(target, IcebergTarget)
    loaded = target._load()
    assert loaded is not None and loaded.current_snapshot() is not None
    snapshot = loaded.current_snapshot().snapshot_id
    loaded.delete(LessThan("id", 2_000_000))
    return int(snapshot)


def _ids_at(kind: str, target: Target, version: int) -> list[int]:
    if kind == "delta":
        from deltalake import DeltaTable

        assert isinstance(target, DeltaTarget)
        return DeltaTable(str(target.path), version=version).to_pyarrow_table()[
            "id"].to_pylist()
    assert isinstance(target, IcebergTarget)
    loaded = target._load()
    assert loaded is not None
    return loaded.scan(snapshot_id=version).to_arrow()["id"].to_pylist()
