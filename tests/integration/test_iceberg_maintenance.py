"""Iceberg maintenance on real tables (SQL catalog on SQLite), driven without Ray (the
sink's calls as the coordinator makes them; in the integration layer for the seconds its
real commits take):
compaction (every row once, per partition), manifest merging, snapshot expiry (exactly
the files only expired snapshots referenced; a pending epoch's staged files untouched;
time travel to each retained snapshot), old metadata deleted, the marker read back, the
crash points and a lost compare-and-swap."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

pytest.importorskip("pyiceberg")

from pyiceberg.catalog import load_catalog
from pyiceberg.expressions import EqualTo
from pyiceberg.manifest import ManifestContent

from raysink import Maintenance, SinkRuntime
from raysink._faults import InjectedFault
from raysink.errors import SinkUnavailableError
from raysink.sinks._maintenance import MaintenanceWindow
from raysink.sinks.base import CommitResult, Manifest
from raysink.sinks.iceberg import IcebergSink
from raysink.sinks.iceberg import _maintain as maintain_module
from raysink.sinks.iceberg._maintain import JOURNAL_DIR, METADATA_VERSIONS
from raysink.testing import arm_fault
from tests.integration.helpers import epoch_table
from tests.integration.real_targets import assert_ids_exact
from tests.support.staging import stage_writers as stage

IDENT = "ns.events"
KEEP_ALL = Maintenance(min_compact_files=4, keep_snapshots=10_000, keep_seconds=3600)
KEEP_ONE = Maintenance(min_compact_files=4, keep_snapshots=1, keep_seconds=0)


def props(root: Path) -> dict[str, str]:
    return {"type": "sql", "uri": f"sqlite:///{root / 'catalog.db'}",
            "warehouse": f"file://{root / 'warehouse'}"}


def sink_at(root: Path, policy: Maintenance | bool = KEEP_ALL, name: str = "main",
            runtime: str = "rt") -> IcebergSink:
    return IcebergSink(IDENT, catalog=props(root), maintenance=policy).bind(runtime, name)


def batch(ids: Sequence[int]) -> pa.RecordBatch:
    return pa.record_batch({"id": pa.array(ids, pa.int64()),
                            "v": pa.array([f"v{i}" for i in ids], pa.string())})


def table(root: Path) -> Any:
    return load_catalog("raysink", **props(root)).load_table(IDENT)


def ids(root: Path, snapshot_id: int | None = None) -> list[int]:
    scan = table(root).scan(snapshot_id=snapshot_id)
    return sorted(scan.to_arrow().column("id").to_pylist())


def window(committed: int | None = None, *, force: bool = False,
           seconds: float = 60.0) -> MaintenanceWindow:
    return MaintenanceWindow(deadline=time.monotonic() + seconds, committed_epoch=committed,
                             force=force)


def commit_epochs(sink: IcebergSink, first: int, last: int,
                  writers: int = 2) -> dict[int, list[Manifest]]:
    """Epochs ``first..last``, ``writers`` writers each, ids ``10*epoch + writer``."""
    decided = {}
    for epoch in range(first, last + 1):
        decided[epoch] = stage(sink, epoch, [[batch([10 * epoch + w])] for w in range(writers)])
        assert sink.commit(epoch, decided[epoch]) is CommitResult.COMMITTED
    return decided


def expected(first: int, last: int, writers: int = 2) -> list[int]:
    return sorted(10 * e + w for e in range(first, last + 1) for w in range(writers))


def live_files(root: Path) -> list[str]:
    t = table(root)
    return sorted(t.inspect.files().column("file_path").to_pylist())


def on_disk(uri: str) -> bool:
    return Path(uri.removeprefix("file://")).exists()


def data_manifests(root: Path) -> int:
    t = table(root)
    return sum(1 for m in t.current_snapshot().manifests(t.io)
               if m.content == ManifestContent.DATA)


def unreferenced_metadata(root: Path) -> list[str]:
    """Avro files under ``metadata/`` (manifests, manifest lists) no snapshot references."""
    t = table(root)
    referenced = {s.manifest_list for s in t.snapshots()}
    referenced |= {m.manifest_path for s in t.snapshots() for m in s.manifests(t.io)}
    names = {r.rsplit("/", 1)[1] for r in referenced}
    return sorted(p.name for p in (root / "warehouse/ns.db/events/metadata").glob("*.avro")
                  if p.name not in names)


def test_compaction_keeps_every_row_once_and_every_snapshot_readable(tmp_path: Path) -> None:
    sink = sink_at(tmp_path)
    decided = commit_epochs(sink, 1, 6)
    before = {s.snapshot_id: ids(tmp_path, s.snapshot_id) for s in table(tmp_path).snapshots()}
    small = live_files(tmp_path)
    assert len(small) == 12 and data_manifests(tmp_path) == 6

    report = sink.maintain(window(6))

    assert report.steps[:1] == ("delete_metadata",) and "compact" in report.steps
    assert (report.files_compacted, report.files_written, report.complete) == (12, 1, True)
    assert ids(tmp_path) == expected(1, 6)
    assert len(live_files(tmp_path)) == 1 and data_manifests(tmp_path) == 1
    assert unreferenced_metadata(tmp_path) == []  # no manifest merged away is left behind
    current = table(tmp_path).current_snapshot()
    assert current.summary.operation.value == "replace"
    # time travel: every snapshot from before reads as it did (nothing expired here)
    assert {s: ids(tmp_path, s) for s in before} == before
    assert all(on_disk(f) for f in small)
    # the marker reads back through the maintenance snapshot, decision included
    assert sink.committed_epoch() == 6
    assert sink.holds_decision(6, decided[6]) is True
    assert sink.commit(6, decided[6]) is CommitResult.ALREADY
    commit_epochs(sink, 7, 7)
    assert ids(tmp_path) == expected(1, 7)


def test_a_compacted_file_waits_for_its_own_tier(tmp_path: Path) -> None:
    """Size tiers (``raysink.sinks._tiers``): the next pass compacts the new small files
    and leaves the larger compacted one until its own tier holds enough files."""
    sink = sink_at(tmp_path)

    def commit(first: int, last: int) -> None:  # 500 rows a writer: files of a few KB
        for e in range(first, last + 1):
            staged = stage(sink, e, [[batch(range(1000 * e + 500 * w, 1000 * e + 500 * (w + 1)))]
                                     for w in range(2)])
            assert sink.commit(e, staged) is CommitResult.COMMITTED

    commit(1, 2)
    first = sink.maintain(window(2))
    assert (first.files_compacted, first.files_written) == (4, 1)
    (compacted,) = live_files(tmp_path)

    commit(3, 4)
    second = sink.maintain(window(4))

    assert (second.files_compacted, second.files_written) == (4, 1)
    assert compacted in live_files(tmp_path) and len(live_files(tmp_path)) == 2
    assert ids(tmp_path) == list(range(1000, 5000))


def test_below_the_threshold_nothing_is_compacted(tmp_path: Path) -> None:
    sink = sink_at(tmp_path)
    commit_epochs(sink, 1, 1)
    assert "compact" not in sink.maintain(window(1)).steps
    report = sink.maintain(window(1, force=True))  # rt.maintain(): any two small files
    assert report.files_compacted == 2 and ids(tmp_path) == expected(1, 1)


def test_expiry_deletes_exactly_what_only_expired_snapshots_referenced(
        tmp_path: Path) -> None:
    sink = sink_at(tmp_path, KEEP_ONE)
    decided = commit_epochs(sink, 1, 5)
    small = live_files(tmp_path)
    t = table(tmp_path)
    old_lists = [s.manifest_list for s in t.snapshots()]
    pending = stage(sink, 6, [[batch([60])], [batch([61])]])  # staged, not committed
    staged = [str(f["path"]) for m in pending for f in m["files"]]  # type: ignore[typeddict-item]

    report = sink.maintain(window(5))

    assert {"compact", "expire_snapshots"} <= set(report.steps)
    t = table(tmp_path)
    assert len(t.snapshots()) == 1 and report.snapshots_expired == 5
    assert ids(tmp_path) == expected(1, 5)
    assert ids(tmp_path, t.current_snapshot().snapshot_id) == expected(1, 5)
    assert not any(on_disk(f) for f in small + old_lists)
    assert all(on_disk(f) for f in staged + live_files(tmp_path))
    assert not list((tmp_path / "warehouse/ns.db/events/data/raysink").glob("00000000000[1-5]"))
    assert sink.committed_epoch() == 5 and sink.holds_decision(5, decided[5]) is True
    assert sink.commit(6, pending) is CommitResult.COMMITTED
    assert ids(tmp_path) == expected(1, 6)


def test_expiry_keeps_what_the_policy_keeps_and_time_travel_works(tmp_path: Path) -> None:
    sink = sink_at(tmp_path, Maintenance(min_compact_files=100, keep_snapshots=3,
                                         keep_seconds=0))
    commit_epochs(sink, 1, 5, writers=1)
    t = table(tmp_path)
    newest = [s.snapshot_id for s in t.snapshots()[-3:]]
    reads = {s: ids(tmp_path, s) for s in newest}
    sink.maintain(window(5))
    assert [s.snapshot_id for s in table(tmp_path).snapshots()] == newest
    assert {s: ids(tmp_path, s) for s in newest} == reads
    assert all(on_disk(f) for f in live_files(tmp_path))


def test_the_marker_snapshot_of_another_sink_is_kept(tmp_path: Path) -> None:
    sink, other = sink_at(tmp_path, KEEP_ONE), sink_at(tmp_path, KEEP_ONE, name="other")
    commit_epochs(other, 1, 1)
    commit_epochs(sink, 1, 3)
    sink.maintain(window(3))
    assert other.committed_epoch() == 1
    summaries = [s.summary.get("raysink.sink") for s in table(tmp_path).snapshots()]
    assert "raysink:rt:other" in summaries


def test_metadata_files_stay_bounded(tmp_path: Path) -> None:
    sink = sink_at(tmp_path, KEEP_ONE.replace(min_compact_files=2))
    metadata = tmp_path / "warehouse/ns.db/events/metadata"
    for epoch in range(1, 13):
        commit_epochs(sink, epoch, epoch, writers=1)
        if epoch % 3 == 0:
            sink.maintain(window(epoch))
            assert len(list(metadata.glob("*.metadata.json"))) <= METADATA_VERSIONS + 1
            assert unreferenced_metadata(tmp_path) == []
    stats = sink.table_stats()
    assert stats is not None and stats.snapshots == 1
    assert stats.data_files == len(live_files(tmp_path)) == 1
    assert stats.metadata_files == sum(1 for p in metadata.rglob("*") if p.is_file())
    assert stats.metadata_bytes == sum(p.stat().st_size for p in metadata.rglob("*")
                                       if p.is_file())
    assert ids(tmp_path) == expected(1, 12, writers=1)


def test_partitioned_table_is_compacted_per_partition(tmp_path: Path) -> None:
    from pyiceberg.partitioning import PartitionField, PartitionSpec
    from pyiceberg.schema import Schema
    from pyiceberg.transforms import IdentityTransform
    from pyiceberg.types import LongType, NestedField, StringType

    schema = Schema(NestedField(1, "id", LongType(), required=False),
                    NestedField(2, "p", StringType(), required=False),
                    NestedField(3, "g", LongType(), required=False))
    spec = PartitionSpec(PartitionField(2, 1000, IdentityTransform(), "p"),
                         PartitionField(3, 1001, IdentityTransform(), "g"))
    catalog = load_catalog("raysink", **props(tmp_path))
    catalog.create_namespace("ns")
    t = catalog.create_table(IDENT, schema=schema, partition_spec=spec)
    rows: list[int] = []
    for n in range(6):
        chunk = list(range(100 * n, 100 * n + 40))
        rows += chunk
        t.append(pa.table({"id": pa.array(chunk, pa.int64()),
                           "p": pa.array(["a" if i % 2 else "b" for i in chunk]),
                           "g": pa.array([i % 3 for i in chunk], pa.int64())}))
    before = len(live_files(tmp_path))
    partitions = {tuple(r.values()) for r in table(tmp_path).inspect.files()
                  .column("partition").to_pylist()}
    assert before == 6 * len(partitions)

    report = sink_at(tmp_path).maintain(window(force=True))

    assert report.files_compacted == before and report.files_written == len(partitions)
    assert ids(tmp_path) == sorted(rows)
    files = table(tmp_path).inspect.files()
    assert len(files) == len(partitions)
    for part in files.column("partition").to_pylist():  # each file still one partition
        found = ids_in(tmp_path, part)
        assert found and all(("a" if i % 2 else "b") == part["p"] and i % 3 == part["g"]
                             for i in found)


def ids_in(root: Path, partition: dict[str, Any]) -> list[int]:
    """The ids of the one file holding ``partition``."""
    (path,) = [f["file_path"] for f in table(root).inspect.files().to_pylist()
               if f["partition"] == partition]
    import pyarrow.parquet as pq

    return sorted(pq.ParquetFile(path.removeprefix("file://")).read().column("id").to_pylist())


@pytest.mark.parametrize("point", ["maintenance.mid_compaction", "maintenance.mid_expiry",
                                   "maintenance.mid_cleanup"])
def test_a_crash_leaves_the_table_exact_and_the_next_pass_finishes(
        tmp_path: Path, point: str, name: str) -> None:
    sink = sink_at(tmp_path, KEEP_ONE, runtime=name)
    commit_epochs(sink, 1, 4)
    small = live_files(tmp_path)
    arm_fault(name, point, action="raise")
    with pytest.raises(InjectedFault):
        sink.maintain(window(4))
    journal = tmp_path / "warehouse/ns.db/events/metadata" / JOURNAL_DIR
    assert len(list(journal.glob("*.json"))) == 1
    assert ids(tmp_path) == expected(1, 4) and sink.committed_epoch() == 4
    data = tmp_path / "warehouse/ns.db/events/data"
    compacted = sorted(str(p) for p in data.glob("raysink-compact-*"))
    if point == "maintenance.mid_compaction":  # written, never committed: an orphan
        assert len(compacted) == 1 and not any(c in f for f in live_files(tmp_path)
                                               for c in compacted)
    else:  # expired in the metadata, its files (some of them) still on disk
        assert len(table(tmp_path).snapshots()) == 1 and any(on_disk(f) for f in small)

    report = sink.maintain(window(4))

    assert not any(on_disk(f) for f in small)
    assert not any(Path(c).exists() for c in compacted if point.endswith("compaction"))
    assert sorted(str(p) for p in data.glob("raysink-compact-*")) == [
        f.removeprefix("file://") for f in live_files(tmp_path)]
    assert list(journal.glob("*.json")) == []
    assert ids(tmp_path) == expected(1, 4) and sink.committed_epoch() == 4
    assert report.steps[0] == "recover" and report.complete
    commit_epochs(sink, 5, 5)
    assert ids(tmp_path) == expected(1, 5)


def _at_compaction(monkeypatch: pytest.MonkeyPatch, action: Any) -> None:
    real = maintain_module.hit

    def fake_hit(point: str, **context: Any) -> None:
        if point == "maintenance.mid_compaction":
            action()
        real(point, **context)

    monkeypatch.setattr(maintain_module, "hit", fake_hit)


def test_a_compaction_losing_the_race_retries_on_the_new_table(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sink, other = sink_at(tmp_path), sink_at(tmp_path, name="other")
    commit_epochs(sink, 1, 2)
    _at_compaction(monkeypatch, lambda: commit_epochs(other, 1, 1))
    report = sink.maintain(window(2))
    assert report.files_compacted == 4 and report.complete
    t = table(tmp_path)  # the replace snapshot was made again on top of the other's
    parent = t.snapshot_by_id(t.current_snapshot().parent_snapshot_id)
    assert parent.summary.get("raysink.sink") == "raysink:rt:other"
    assert ids(tmp_path) == sorted(expected(1, 2) + expected(1, 1))
    assert sink.committed_epoch() == 2 and other.committed_epoch() == 1


def test_a_compaction_whose_files_changed_meanwhile_gives_up_cleanly(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sink = sink_at(tmp_path)
    commit_epochs(sink, 1, 2)
    _at_compaction(monkeypatch, lambda: table(tmp_path).delete(EqualTo("id", 10)))
    report = sink.maintain(window(2))
    assert report.files_compacted == 0 and not report.complete
    assert ids(tmp_path) == [i for i in expected(1, 2) if i != 10]
    data = tmp_path / "warehouse/ns.db/events/data"
    assert list(data.glob("raysink-compact-*")) == []
    assert list((data.parent / "metadata" / JOURNAL_DIR).glob("*.json")) == []
    assert sink.committed_epoch() == 2


def test_maintenance_off_does_nothing(tmp_path: Path) -> None:
    sink = sink_at(tmp_path, False)
    commit_epochs(sink, 1, 2)
    report = sink.maintain(window(2, force=True))
    assert report.steps == () and len(live_files(tmp_path)) == 4
    assert "write.metadata.delete-after-commit.enabled" not in table(tmp_path).properties


def test_a_cut_commit_is_a_typed_error(tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from pyiceberg.exceptions import CommitStateUnknownException

    sink = sink_at(tmp_path)
    commit_epochs(sink, 1, 2)

    def unknown(*args: Any, **kwargs: Any) -> None:
        raise CommitStateUnknownException("gateway timeout")

    monkeypatch.setattr(maintain_module, "rewrite", unknown)
    with pytest.raises(SinkUnavailableError, match="next pass finishes it"):
        sink.maintain(window(2, force=True))
    monkeypatch.undo()
    assert sink.maintain(window(2, force=True)).steps[0] == "recover"
    assert ids(tmp_path) == expected(1, 2)
    assert list((tmp_path / "warehouse/ns.db/events/data").glob("raysink-compact-*")) != []


@pytest.mark.usefixtures("ray_session")
@pytest.mark.timeout(240)
def test_a_fresh_meta_store_aligns_with_a_compacted_expired_table(tmp_path: Path,
                                                                  name: str) -> None:
    """Epochs 1-4 through a runtime, the table compacted and expired down to one
    snapshot, then the same runtime with a fresh meta store: the replayed epoch is
    skipped (the marker reads back from the maintenance snapshot), a new one is written
    once."""
    def runtime(meta: str) -> SinkRuntime:
        return SinkRuntime(name, IcebergSink(IDENT, catalog=props(tmp_path),
                                             maintenance=KEEP_ONE),
                           writers=2, metastore=f"sqlite:///{tmp_path / meta}",
                           progress=False, retry_cap=0.5)

    with runtime("original.db") as rt:
        for epoch in range(1, 5):
            assert rt.write_arrow(epoch_table(epoch, 100)).committed
    (marker,) = {s.summary.get("raysink.sink") for s in table(tmp_path).snapshots()}
    sink = IcebergSink(IDENT, catalog=props(tmp_path), maintenance=KEEP_ONE.replace(
        min_compact_files=2)).bind(name, marker.rsplit(":", 1)[1])
    report = sink.maintain(window(4))
    assert {"compact", "expire_snapshots"} <= set(report.steps)
    assert len(table(tmp_path).snapshots()) == 1

    with runtime("fresh.db") as rt:
        replay = rt.write_arrow(epoch_table(4, 100), epoch=4)
        assert (replay.skipped, replay.committed) == (True, True)
        fifth = rt.write_arrow(epoch_table(5, 100), epoch=5)
        assert (fifth.skipped, fifth.committed) == (False, True)
    assert_ids_exact(ids(tmp_path), [1, 2, 3, 4, 5], 100)


def test_an_expiry_losing_the_race_deletes_nothing_and_the_next_pass_expires(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sink, other = sink_at(tmp_path, KEEP_ONE), sink_at(tmp_path, KEEP_ONE, name="other")
    commit_epochs(sink, 1, 3, writers=1)
    files = live_files(tmp_path)
    planned = maintain_module.IcebergMaintenance._retained

    def racing(self: Any, table_: Any, window_: MaintenanceWindow) -> set[int]:
        keep = planned(self, table_, window_)
        commit_epochs(other, 1, 1, writers=1)  # lands between the plan and its commit
        return keep

    monkeypatch.setattr(maintain_module.IcebergMaintenance, "_retained", racing)
    report = sink.maintain(window(3))
    assert "expire_snapshots" not in report.steps and not report.complete
    assert all(on_disk(f) for f in files) and len(table(tmp_path).snapshots()) == 4
    assert list((tmp_path / "warehouse/ns.db/events/metadata" / JOURNAL_DIR).glob("*")) == []
    monkeypatch.undo()
    report = sink.maintain(window(3))
    assert "expire_snapshots" in report.steps
    assert ids(tmp_path) == sorted(expected(1, 3, writers=1) + expected(1, 1, writers=1))
    assert sink.committed_epoch() == 3 and other.committed_epoch() == 1


def test_files_of_an_older_schema_are_compacted_as_the_table_reads_them(
        tmp_path: Path) -> None:
    sink = IcebergSink(IDENT, catalog=props(tmp_path), maintenance=KEEP_ONE,
                       schema_evolution="add_columns").bind("rt", "main")
    for epoch in (1, 2, 3, 4):
        rows = batch([epoch])
        if epoch > 2:  # a column added by epoch 3
            rows = rows.append_column("extra", pa.array([float(epoch)]))
        sink.commit(epoch, stage(sink, epoch, [[rows]]))
    before = table(tmp_path).scan().to_arrow().sort_by("id")
    report = sink.maintain(window(4, force=True))
    assert report.files_compacted == 4 and len(live_files(tmp_path)) == 1
    after = table(tmp_path).scan().to_arrow().sort_by("id")
    assert after.to_pylist() == before.to_pylist()
    assert after.column("extra").to_pylist() == [None, None, 3.0, 4.0]


def test_manifests_are_merged_alone_when_nothing_is_compacted(tmp_path: Path) -> None:
    sink = sink_at(tmp_path, KEEP_ALL.replace(min_compact_files=100))
    decided = commit_epochs(sink, 1, 8, writers=1)
    files = live_files(tmp_path)
    assert data_manifests(tmp_path) == 8
    report = sink.maintain(window(8))
    assert "merge_manifests" in report.steps and "compact" not in report.steps
    assert data_manifests(tmp_path) == 1 and live_files(tmp_path) == files
    assert unreferenced_metadata(tmp_path) == []
    assert ids(tmp_path) == expected(1, 8, writers=1)
    assert table(tmp_path).current_snapshot().summary.operation.value == "replace"
    assert sink.holds_decision(8, decided[8]) is True
    assert "merge_manifests" not in sink.maintain(window(8)).steps  # one is as few as any
