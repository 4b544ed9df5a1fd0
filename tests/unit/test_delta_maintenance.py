"""Delta maintenance on real Delta tables, without Ray: compaction (per partition),
checkpoints, expiry of removed files and log cleanup keep the exact contents, the marker,
files staged for an epoch not yet committed, and time travel to every retained version.

The crash points are taken here in-process (an exception at the point, then the pass run
again); ``tests/integration/test_maintenance.py`` SIGKILLs the coordinator at them."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

deltalake = pytest.importorskip("deltalake")

from raysink import Maintenance  # noqa: E402
from raysink.sinks._maintenance import MaintenanceWindow  # noqa: E402
from raysink.sinks.delta import DeltaSink, _compact, _maintain  # noqa: E402
from tests.support.staging import stage_writers as stage  # noqa: E402

TIGHT = Maintenance(min_compact_files=4, keep_snapshots=1, keep_seconds=0,
                    checkpoint_every=1)


def sink_at(path: Path, policy: Maintenance = TIGHT, **options: Any) -> DeltaSink:
    return DeltaSink(str(path), maintenance=policy, **options).bind("rt", "main")


def rows(epoch: int, writer: int, n: int = 5) -> pa.RecordBatch:
    base = epoch * 100 + writer * 10
    return pa.record_batch({"id": pa.array(range(base, base + n), pa.int64()),
                            "day": pa.array([f"d{epoch % 2}"] * n)})


def commit_epochs(sink: DeltaSink, epochs: range) -> None:
    for epoch in epochs:
        sink.commit(epoch, stage(sink, epoch, [[rows(epoch, 0)], [rows(epoch, 1)]]))


def content(path: Path, version: int | None = None) -> list[int]:
    table = deltalake.DeltaTable(str(path), version=version).to_pyarrow_table()
    return sorted(table.column("id").to_pylist())


def expected(epochs: range) -> list[int]:
    return sorted(i for e in epochs for w in (0, 1)
                  for i in rows(e, w).column("id").to_pylist())


def window(sink: DeltaSink, force: bool = False, seconds: float = 30.0) -> MaintenanceWindow:
    return MaintenanceWindow(deadline=time.monotonic() + seconds,
                             committed_epoch=sink.committed_epoch(), force=force)


def leaked(path: Path, staged: Sequence[Path] = ()) -> list[str]:
    """Data files on disk that no version still in the log references (``staged``: files
    of epochs not committed, rightly on disk)."""
    versions = sorted({int(p.name.split(".")[0]) for p in (path / "_delta_log").glob("*.json")})
    kept = {Path(uri.removeprefix("file://")) for v in versions
            for uri in deltalake.DeltaTable(str(path), version=v).file_uris()}
    on_disk = {p for p in path.rglob("*.parquet") if "_delta_log" not in p.parts}
    return sorted(str(p.relative_to(path)) for p in on_disk - kept - set(staged))


def log_names(path: Path) -> list[str]:
    return sorted(p.name for p in (path / "_delta_log").iterdir())


def test_a_pass_compacts_expires_and_cleans_yet_keeps_rows_marker_and_staged(
        tmp_path: Path) -> None:
    path = tmp_path / "t"
    sink = sink_at(path)
    commit_epochs(sink, range(1, 11))
    pending = stage(sink, 11, [[rows(11, 0)]])  # staged, not committed
    staged = [path / f["path"] for f in pending[0]["files"]]
    before = sink.table_stats()
    assert before is not None and before.data_files == 20 and before.snapshots == 10

    report = sink.maintain(window(sink))

    assert report.steps == ("compact", "checkpoint", "expire_files", "cleanup_log")
    assert report.files_deleted == 20 + 10  # the compacted files, versions 0..9 of the log
    assert (report.files_compacted, report.files_written) == (20, 1)
    assert report.complete
    assert content(path) == expected(range(1, 11))
    assert sink.committed_epoch() == 10  # read from the checkpoint: its commit is gone
    assert all(f.exists() for f in staged)
    assert leaked(path, staged) == []
    after = sink.table_stats()
    assert after is not None and (after.data_files, after.snapshots) == (1, 1)
    assert sorted(p.name for p in (path / "_raysink").iterdir()) == [f"{11:012d}", "compact"]
    assert [p.suffix for p in (path / "_raysink/compact").iterdir()] == [".parquet"]  # no journal
    assert log_names(path) == sorted([f"{10:020d}.json", f"{10:020d}.checkpoint.parquet",
                                      f"{10:020d}.crc", "_last_checkpoint"])

    sink.commit(11, pending)  # the stream goes on over the compacted table
    assert content(path) == expected(range(1, 11)) + sorted(
        rows(11, 0).column("id").to_pylist())
    assert sink.committed_epoch() == 11


def test_partitions_compact_one_by_one(tmp_path: Path) -> None:
    path = tmp_path / "t"
    sink = sink_at(path, partition_by=["day"])
    commit_epochs(sink, range(1, 9))

    report = sink.maintain(window(sink))

    assert report.files_compacted == 16 and report.files_written == 2
    adds = pa.table(deltalake.DeltaTable(str(path)).get_add_actions(flatten=True)).to_pydict()
    assert sorted(adds["partition.day"]) == ["d0", "d1"]
    assert content(path) == expected(range(1, 9))


def test_retention_keeps_time_travel_to_every_retained_version(tmp_path: Path) -> None:
    path = tmp_path / "t"
    sink = sink_at(path, TIGHT.replace(keep_snapshots=4))
    commit_epochs(sink, range(1, 9))  # versions 0..7: version v holds epochs 1..v+1
    sink.maintain(window(sink))  # compaction at 8, checkpointed; nothing below 8 expires
    assert content(path, 0) == expected(range(1, 2))
    commit_epochs(sink, range(9, 13))  # versions 9..12
    sink.maintain(window(sink))  # compaction at 13: 10..13 retained, from checkpoint 8

    for version, epochs in [(8, range(1, 9)), (10, range(1, 11)), (12, range(1, 13)),
                            (13, range(1, 13))]:
        assert content(path, version) == expected(epochs)
    with pytest.raises(Exception):  # noqa: B017 - delta-rs's own error: the version is gone
        content(path, 7)


def test_nothing_is_cleaned_while_young(tmp_path: Path) -> None:
    path = tmp_path / "t"
    sink = sink_at(path, TIGHT.replace(keep_seconds=3600))
    commit_epochs(sink, range(1, 6))
    report = sink.maintain(window(sink))
    assert report.steps == ("compact", "checkpoint")
    assert content(path, 0) == expected(range(1, 2))


def test_a_table_that_expires_app_transactions_is_not_cleaned(tmp_path: Path) -> None:
    path = tmp_path / "t"
    sink = sink_at(path)
    commit_epochs(sink, range(1, 6))
    table = deltalake.DeltaTable(str(path))
    table.alter.set_table_properties({"delta.setTransactionRetentionDuration": "interval 1 days"})
    report = sink.maintain(window(sink))
    assert report.steps == ("compact",)
    assert sink.committed_epoch() == 5


def test_a_pass_past_its_deadline_runs_one_step(tmp_path: Path) -> None:
    path = tmp_path / "t"
    sink = sink_at(path)
    commit_epochs(sink, range(1, 6))
    report = sink.maintain(window(sink, seconds=-1))
    assert (report.steps, report.complete) == (("compact",), False)
    assert sink.maintain(window(sink)).steps == ("checkpoint", "expire_files", "cleanup_log")


def test_force_compacts_below_the_threshold(tmp_path: Path) -> None:
    path = tmp_path / "t"
    sink = sink_at(path, TIGHT.replace(min_compact_files=100))
    commit_epochs(sink, range(1, 3))
    assert "compact" not in sink.maintain(window(sink)).steps
    assert sink.maintain(window(sink, force=True)).files_compacted == 4


def test_the_option_switches_maintenance_off() -> None:
    assert not DeltaSink("/tmp/x", maintenance=False).maintenance.enabled
    assert DeltaSink("/tmp/x").maintenance == Maintenance()


def checkpoint_removes(path: Path) -> set[str]:
    """The paths the newest checkpoint's ``remove`` actions name."""
    import pyarrow.parquet as pq

    newest = max((path / "_delta_log").glob("*.checkpoint.parquet"))
    removes = pq.read_table(newest, columns=["remove"]).column("remove").to_pylist()
    return {r["path"] for r in removes if r}


def live_paths(path: Path) -> set[str]:
    return set(pa.table(deltalake.DeltaTable(str(path)).get_add_actions(flatten=False))
               .column("path").to_pylist())


@pytest.mark.parametrize(("seconds", "kept"), [(86_400.0, True), (1.0, False)])
def test_checkpoints_keep_removes_only_within_the_tombstone_retention(
        tmp_path: Path, seconds: float, kept: bool) -> None:
    path = tmp_path / "t"
    sink = sink_at(path, TIGHT.replace(tombstone_seconds=seconds))
    commit_epochs(sink, range(1, 5))
    small = live_paths(path)
    assert "compact" in sink.maintain(window(sink)).steps  # removes every small file
    time.sleep(1.5)
    commit_epochs(sink, range(5, 6))
    sink.maintain(window(sink))  # a checkpoint of a later version
    assert bool(checkpoint_removes(path) & small) is kept
    assert content(path) == expected(range(1, 6))


@pytest.mark.parametrize(("policy", "checkpointed"), [(TIGHT, False), (False, True)])
def test_a_maintained_table_is_checkpointed_by_its_passes_only(
        tmp_path: Path, policy: Maintenance | bool, checkpointed: bool) -> None:
    """delta-rs's post-commit hooks list the whole log after each commit; a maintained
    sink switches them off (its passes checkpoint), an unmaintained one keeps them: a
    checkpoint every ``delta.checkpointInterval`` versions (5 here, 100 by default)."""
    path = tmp_path / "t"
    deltalake.write_deltalake(str(path), pa.Table.from_batches([rows(0, 0).slice(0, 0)]),
                              configuration={"delta.checkpointInterval": "5"})
    commit_epochs(sink_at(path, policy), range(1, 7))  # type: ignore[arg-type]
    assert deltalake.DeltaTable(str(path)).version() == 6
    assert bool(list((path / "_delta_log").glob("*.checkpoint.parquet"))) is checkpointed
    assert content(path) == expected(range(1, 7))


@pytest.mark.parametrize(("policy", "mode", "expected_retention"), [
    (Maintenance(), "append", "interval 600 seconds"),
    (Maintenance(keep_seconds=3600), "append", "interval 3600 seconds"),
    (Maintenance(tombstone_seconds=0.5), "upsert", "interval 1 seconds"),
    (False, "append", None),
])
def test_a_created_table_gets_the_tombstone_retention(
        tmp_path: Path, policy: Maintenance | bool, mode: str,
        expected_retention: str | None) -> None:
    path = tmp_path / "t"
    options: dict[str, Any] = {"mode": "upsert", "key": ["id"]} if mode == "upsert" else {}
    commit_epochs(sink_at(path, policy, **options), range(1, 2))  # type: ignore[arg-type]
    config = deltalake.DeltaTable(str(path)).metadata().configuration
    assert config.get(_maintain.TOMBSTONE_RETENTION) == expected_retention


@pytest.mark.parametrize("point", [
    "maintenance.mid_compaction",  # both partitions' compacted files written, not committed
    "maintenance.mid_expiry",  # removed files deleted, their log entries not
    "maintenance.mid_cleanup",  # the oldest log entry deleted, the rest not
])
def test_a_pass_cut_at_each_point_is_finished_by_the_next(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, point: str) -> None:
    path = tmp_path / "t"
    sink = sink_at(path, partition_by=["day"])
    commit_epochs(sink, range(1, 9))

    def cut(at: str, **context: Any) -> None:
        if at == point:
            raise RuntimeError(f"cut at {at}")

    monkeypatch.setattr(_maintain, "hit", cut)
    monkeypatch.setattr(_compact, "hit", cut)
    with pytest.raises(RuntimeError, match="cut at"):
        sink.maintain(window(sink))
    assert content(path) == expected(range(1, 9))
    assert sink.committed_epoch() == 8
    if point == "maintenance.mid_compaction":
        assert len(leaked(path)) == 2 and len(list(path.glob("_raysink/compact/*.json"))) == 1
    monkeypatch.undo()

    sink.maintain(window(sink))
    assert leaked(path) == []  # a cut pass leaves nothing the next one does not delete
    assert list(path.glob("_raysink/compact/*.json")) == []
    commit_epochs(sink, range(9, 10))
    assert content(path) == expected(range(1, 10))
    assert sink.committed_epoch() == 9
    tables = deltalake.DeltaTable(str(path)).file_uris()
    assert all(Path(uri.removeprefix("file://")).exists() for uri in tables)


def staged_roots(path: Path, manifests: Sequence[Any]) -> set[str]:
    return {str(f["path"]).split("/")[0] for m in manifests for f in m["files"]}


def external_vacuum(path: Path) -> list[str]:
    """A ``VACUUM`` run outside raysink at zero retention, listing every file (delta-rs's
    full mode, as Spark's): what it deleted."""
    return deltalake.DeltaTable(str(path)).vacuum(
        retention_hours=0, dry_run=False, enforce_retention_duration=False, full=True)


def test_a_vacuum_outside_raysink_never_reaches_a_pending_epoch(tmp_path: Path) -> None:
    """A maintained sink stages under ``_raysink/``, which ``VACUUM`` skips: a vacuum at
    zero retention between pre-commit and commit deletes nothing of the epoch."""
    path = tmp_path / "t"
    sink = sink_at(path, TIGHT)
    commit_epochs(sink, range(1, 6))
    sink.maintain(window(sink))  # compaction: the small files are removed from the table
    pending = stage(sink, 6, [[rows(6, 0)], [rows(6, 1)]])
    assert staged_roots(path, pending) == {"_raysink"}
    deleted = external_vacuum(path)
    assert not any("_raysink" in p for p in deleted), deleted
    sink.commit(6, pending)
    assert content(path) == expected(range(1, 7))


def test_an_unmaintained_sink_stages_where_vacuum_reclaims(tmp_path: Path) -> None:
    """``maintenance=False`` stages under ``raysink/`` so that the table's own ``VACUUM``
    reclaims what a user's ``OPTIMIZE`` removes: a pending epoch is protected only by the
    retention (zero here, so its files go)."""
    path = tmp_path / "t"
    sink = sink_at(path, False)  # type: ignore[arg-type]
    commit_epochs(sink, range(1, 2))
    pending = stage(sink, 2, [[rows(2, 0)]])
    assert staged_roots(path, pending) == {"raysink"}
    assert any(p.startswith("raysink/000000000002/") for p in external_vacuum(path))


def test_an_epoch_staged_under_the_old_root_still_commits_and_aborts(tmp_path: Path) -> None:
    """Epochs staged under ``raysink/`` (by 0.2, or with maintenance off) are found by a
    maintained sink: committed from their manifests, aborted without them."""
    path = tmp_path / "t"
    old = sink_at(path, False)  # type: ignore[arg-type]
    commit_epochs(old, range(1, 2))
    pending = stage(old, 2, [[rows(2, 0)], [rows(2, 1)]])
    lost = stage(old, 3, [[rows(3, 0)]])
    new = sink_at(path, TIGHT)
    new.abort(3, None)
    assert not (path / "raysink" / f"{3:012d}").exists()
    new.commit(2, pending)
    assert content(path) == expected(range(1, 3))
    assert staged_roots(path, lost) == {"raysink"}
