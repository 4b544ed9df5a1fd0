"""ParquetSink driven without Ray: the commit log, crashes between its steps, manifests,
the writer, validation and markers.

The cases every sink shares (commit twice, abort twice, markers, empty epochs,
rollback, a crash inside commit) are in ``tests/integration/test_sink_contract.py``.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import subprocess
import sys
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

import raysink.sinks.parquet._sink as parquet_module
from raysink._faults import InjectedFault
from raysink.errors import (
    ConfigError,
    DataLossError,
    MetaStoreError,
    SchemaMismatchError,
    SinkUnavailableError,
)
from raysink.sinks.base import CommitResult, Manifest
from raysink.sinks.parquet import ParquetSink, ParquetSinkWriter
from raysink.testing import arm_fault, disarm_faults, fired


@pytest.fixture
def runtime() -> Iterator[str]:
    name = f"pq-{uuid.uuid4().hex[:8]}"
    yield name
    disarm_faults(name)


@pytest.fixture
def sink(tmp_path: Path, runtime: str) -> ParquetSink:
    return ParquetSink(tmp_path / "table").bind(runtime, "main")


def _batch(ids: Sequence[int]) -> pa.RecordBatch:
    return pa.record_batch({"id": pa.array(ids, pa.int64()),
                            "v": pa.array([f"r{i}" for i in ids])})


def _stage(sink: ParquetSink, epoch: int, attempt: int,
           rows: Sequence[Sequence[int]]) -> list[Manifest]:
    """One writer per entry of ``rows``, each writing its ids and pre-committing."""
    manifests = []
    for writer_id, ids in enumerate(rows):
        writer = sink.create_writer(writer_id)
        writer.open()
        if ids:
            writer.write(_batch(ids))
        manifests.append(writer.pre_commit(epoch, attempt))
    return manifests


def _visible(sink: ParquetSink) -> list[int]:
    """The ids a pyarrow.dataset reader sees, sorted."""
    if not Path(sink.path).exists():
        return []
    table = ds.dataset(sink.path, format="parquet").to_table()
    return sorted(table.column("id").to_pylist()) if table.num_rows else []


def _tree(root: Path) -> dict[str, str]:
    """Every file under ``root`` with a hash of its content."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _json_round_trip(manifests: list[Manifest]) -> list[Manifest]:
    result: list[Manifest] = json.loads(json.dumps(manifests))
    return result


# --------------------------------------------------------------------------- commit


def test_commit_makes_epoch_visible_with_its_log_entry(sink: ParquetSink) -> None:
    manifests = _json_round_trip(_stage(sink, 1, 1, [[1, 2], [3]]))
    sink.commit(1, manifests)

    assert _visible(sink) == [1, 2, 3]
    assert sink.committed_epoch() == 1
    entry = json.loads((Path(sink.path) / "_raysink/commits/000000000001.json").read_text())
    assert entry["epoch"] == 1 and entry["rows"] == 3
    assert (entry["runtime"], entry["sink"]) == (sink.runtime, "main")
    assert sorted(Path(sink.path).glob("part-e000000000001-a0001-w000*.parquet")) != []
    assert {f["path"] for f in entry["files"]} == {
        p.name for p in Path(sink.path).glob("part-*.parquet")}
    assert not (Path(sink.path) / "_raysink/staging/000000000001").exists()


def test_manifest_format(sink: ParquetSink) -> None:
    (manifest,) = _stage(sink, 12, 3, [[1, 2, 3]])
    assert json.loads(json.dumps(manifest)) == manifest
    assert manifest["rows"] == 3 and manifest["writer"] == 0
    (item,) = manifest["files"]
    assert item["path"].startswith("_raysink/staging/000000000012/0003/e000000000012-a0003-w0000-")
    assert item["rows"] == 3 and item["bytes"] == (Path(sink.path) / item["path"]).stat().st_size
    schema = pa.ipc.read_schema(pa.py_buffer(__import__("base64").b64decode(manifest["schema"])))
    assert schema.names == ["id", "v"]


def test_commit_log_is_pruned_to_the_newest_entries(sink: ParquetSink,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(parquet_module, "COMMIT_LOG_KEEP", 3)
    monkeypatch.setattr(parquet_module, "_PRUNE_EVERY", 1)
    manifests = {}
    for epoch in range(1, 8):
        manifests[epoch] = _stage(sink, epoch, 0, [[epoch * 10]])
        sink.commit(epoch, manifests[epoch])
    log = sorted(p.name for p in (Path(sink.path) / "_raysink" / "commits").iterdir())
    assert log == [f"{e:012d}.json" for e in (5, 6, 7)]
    assert sink.committed_epoch() == 7
    before = _tree(Path(sink.path))
    sink.commit(2, manifests[2])  # its entry is pruned, a newer one says it is in
    assert _tree(Path(sink.path)) == before
    assert _visible(sink) == [10, 20, 30, 40, 50, 60, 70]


def test_a_commit_reads_one_log_entry_however_long_the_log(
        sink: ParquetSink, monkeypatch: pytest.MonkeyPatch) -> None:
    """The directory's schema comes from the newest entry alone (each records the schema
    after its epoch, null while none had one): a run of empty epochs used to read every
    kept entry in every commit, a cost that grew with the log."""
    for epoch in range(1, 41):
        sink.commit(epoch, [])
    reads: list[int] = []
    real = ParquetSink._read_commit_entry

    def counted(self: ParquetSink, epoch: int) -> dict[str, object]:
        reads.append(epoch)
        return real(self, epoch)

    monkeypatch.setattr(ParquetSink, "_read_commit_entry", counted)
    sink.commit(41, [])
    assert reads == [40]
    assert sink.table_schema() is None
    sink.commit(42, _stage(sink, 42, 0, [[1, 2]]))
    sink.commit(43, [])
    assert sink.table_schema() == _batch([1]).schema
    assert sink.committed_epoch() == 43


def _crash_mid_move(sink: ParquetSink, manifests: list[Manifest],
                    monkeypatch: pytest.MonkeyPatch) -> None:
    # the first staged file was renamed into place, the others not
    first = Path(sink.path) / manifests[0]["files"][0]["path"]
    first.rename(Path(sink.path) / f"part-{first.name}")


def _crash_after_move(sink: ParquetSink, manifests: list[Manifest],
                      monkeypatch: pytest.MonkeyPatch) -> None:
    # every file moved, the log entry not written (the named fault point)
    arm_fault(sink.runtime, "sink.mid_commit", action="raise", when={"epoch": 1})
    with pytest.raises(InjectedFault):
        sink.commit(1, manifests)
    assert fired(sink.runtime, "sink.mid_commit")
    assert sink.committed_epoch() is None


def _crash_writing_log(sink: ParquetSink, manifests: list[Manifest],
                       monkeypatch: pytest.MonkeyPatch) -> None:
    # files moved and a half-written temporary log entry left behind
    _crash_after_move(sink, manifests, monkeypatch)
    commits = Path(sink.path) / "_raysink/commits"
    commits.mkdir(parents=True, exist_ok=True)  # the commit's claim is in there
    (commits / ".000000000001.json.tmp").write_text('{"epo')


def _crash_after_log(sink: ParquetSink, manifests: list[Manifest],
                     monkeypatch: pytest.MonkeyPatch) -> None:
    # log entry written, staging not yet swept
    def crash(path: Path) -> None:
        raise OSError("crash before sweeping staging")

    with monkeypatch.context() as patch:
        patch.setattr(parquet_module, "rmtree", crash)
        with pytest.raises(OSError, match="crash before"):
            sink.commit(1, manifests)
    assert sink.committed_epoch() == 1


@pytest.mark.parametrize("crash", [_crash_mid_move, _crash_after_move, _crash_writing_log,
                                   _crash_after_log])
def test_commit_rerun_after_crash_converges(sink: ParquetSink, tmp_path: Path, crash: object,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    manifests = _stage(sink, 1, 1, [[1, 2], [3], [4, 5]])
    assert callable(crash)
    crash(sink, manifests, monkeypatch)
    sink.commit(1, manifests)
    sink.commit(1, manifests)

    assert _visible(sink) == [1, 2, 3, 4, 5]
    assert sink.committed_epoch() == 1
    assert not (Path(sink.path) / "_raysink/staging/000000000001").exists()
    assert not list((Path(sink.path) / "_raysink/commits").glob(".*"))


def test_two_decisions_of_one_epoch_never_both_land(
        sink: ParquetSink, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two drivers of the runtime, with meta stores of their own, decide epoch 1 with
    different rows. The first commit stops after moving its files (its claim stays); the
    other decision's commit then moves nothing and drops its own staged files; the first
    one's re-run finishes. ``holds_decision`` tells the two decisions apart throughout."""
    ours = _stage(sink, 1, 0, [[1, 2], [3]])
    theirs = _stage(sink, 1, 7, [[10, 11]])
    _crash_after_move(sink, ours, monkeypatch)
    assert sink.commit(1, theirs) is CommitResult.ALREADY
    assert not (Path(sink.path) / theirs[0]["files"][0]["path"]).exists()
    assert (sink.holds_decision(1, ours), sink.holds_decision(1, theirs)) == (True, False)
    assert sink.commit(1, _json_round_trip(ours)) is CommitResult.COMMITTED
    assert sink.commit(1, theirs) is CommitResult.ALREADY
    assert (sink.holds_decision(1, ours), sink.holds_decision(1, theirs)) == (True, False)
    assert sink.holds_decision(2, ours) is None
    assert _visible(sink) == [1, 2, 3]
    assert sorted(p.name for p in (Path(sink.path) / "_raysink/commits").iterdir()) == [
        "000000000001.json"]


def test_staged_file_lost_before_move_is_data_loss(sink: ParquetSink) -> None:
    manifests = _stage(sink, 1, 1, [[1], [2]])
    (Path(sink.path) / manifests[1]["files"][0]["path"]).unlink()
    with pytest.raises(DataLossError) as info:
        sink.commit(1, manifests)
    assert info.value.epoch == 1 and info.value.sink == "main"
    assert sink.committed_epoch() is None


# --------------------------------------------------------------------------- visibility


def test_stale_attempt_is_never_visible(sink: ParquetSink) -> None:
    _stage(sink, 4, 1, [[1, 2], [3]])  # attempt 1: staged, then the epoch was retried
    manifests = _stage(sink, 4, 2, [[10], [11]])
    sink.commit(4, manifests)
    assert _visible(sink) == [10, 11]
    assert not (Path(sink.path) / "_raysink/staging/000000000004").exists()


# --------------------------------------------------------------------------- abort


# --------------------------------------------------------------------------- manifests


@pytest.mark.parametrize("path", [
    "/etc/passwd",                                               # absolute
    "../outside.parquet",                                        # climbs out of the table
    "_raysink/staging/000000000001/0001/../../../../x.parquet",  # climbs out of staging
    "_raysink/staging/000000000002/0001/other-epoch.parquet",    # another epoch's staging
    "_raysink/staging/000000000001/0001/notes.txt",              # not a staged Parquet file
    "part-e000000000001-w0000-committed.parquet",                # a committed data file
    "_raysink/commits/000000000001.json",                        # the commit log
    "_raysink/staging/000000000001/x.parquet",                   # not inside an attempt
])
def test_manifest_path_escape_is_refused(sink: ParquetSink, path: str) -> None:
    manifests = _stage(sink, 1, 1, [[1]])
    evil = [*manifests, {"files": [{"path": path, "rows": 1, "bytes": 1}]}]
    with pytest.raises(MetaStoreError, match="refused"):
        sink.commit(1, evil)
    with pytest.raises(MetaStoreError, match="refused"):
        sink.abort(1, evil)
    assert _visible(sink) == [] and sink.committed_epoch() is None
    assert (Path(sink.path) / manifests[0]["files"][0]["path"]).exists()


def test_symlinked_staging_is_not_followed(sink: ParquetSink, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    victim = outside / "e000000000001-a0009-w0000-x.parquet"
    victim.write_bytes(b"precious")
    epoch_dir = Path(sink.path) / "_raysink/staging/000000000001"
    epoch_dir.mkdir(parents=True)
    (epoch_dir / "0009").symlink_to(outside)
    evil = [{"files": [{"path": f"_raysink/staging/000000000001/0009/{victim.name}"}]}]
    with pytest.raises(MetaStoreError):
        sink.abort(1, evil)
    with pytest.raises(MetaStoreError):
        sink.commit(1, evil)
    assert victim.read_bytes() == b"precious"


@pytest.mark.parametrize("manifest", [
    {"files": "not a list"},
    {"files": [{"rows": 1}]},   # no path
    "not a mapping",
])
def test_malformed_manifest_is_refused(sink: ParquetSink, manifest: object) -> None:
    with pytest.raises(MetaStoreError):
        sink.commit(1, [manifest])  # type: ignore[list-item]


# --------------------------------------------------------------------------- the writer


@pytest.mark.parametrize(("second", "expected"), [
    # an extra column
    (pa.record_batch({"id": pa.array([1], pa.int64()), "v": ["a"], "w": [1.0]}),
     "unexpected columns ['w']"),
    # a missing column
    (pa.record_batch({"id": pa.array([1], pa.int64())}), "missing columns ['v']"),
    # a changed type
    (pa.record_batch({"id": pa.array([1], pa.int32()), "v": ["a"]}),
     "column 'id': expected int64, got int32"),
    # same columns, other order
    (pa.record_batch({"v": ["a"], "id": pa.array([1], pa.int64())}), "column order"),
])
def test_schema_mismatch_within_an_epoch(sink: ParquetSink, second: pa.RecordBatch,
                                         expected: str) -> None:
    writer = sink.create_writer(0)
    writer.write(_batch([1, 2]))
    with pytest.raises(SchemaMismatchError, match=expected.replace("[", r"\[").replace("]", r"\]")):
        writer.write(second)
    # the bad batch was not kept; the good rows still pre-commit
    assert writer.pre_commit(1, 1)["rows"] == 2


def test_writer_usable_after_mismatch_and_rollback(sink: ParquetSink) -> None:
    writer = sink.create_writer(0)
    writer.write(_batch([1]))
    other = pa.record_batch({"x": [1.5]})
    with pytest.raises(SchemaMismatchError):
        writer.write(other)
    writer.rollback(1, 1)
    writer.write(other)  # the next attempt may start with any schema
    manifest = writer.pre_commit(1, 2)
    assert manifest["rows"] == 1
    writer.write(_batch([5]))  # and so may the next epoch
    assert writer.pre_commit(2, 1)["rows"] == 1


def test_given_schema_is_enforced(tmp_path: Path) -> None:
    schema = pa.schema([("id", pa.int64()), ("v", pa.string())])
    sink = ParquetSink(tmp_path / "t", schema=schema)
    writer = sink.create_writer(0)
    with pytest.raises(SchemaMismatchError, match="missing columns"):
        writer.write(pa.record_batch({"id": pa.array([1], pa.int64())}))
    writer.write(_batch([1]))
    non_null = pa.schema([pa.field("id", pa.int64(), nullable=False), ("v", pa.string())])
    writer.write(pa.record_batch([pa.array([2], pa.int64()), pa.array(["b"])], schema=non_null))
    assert writer.pre_commit(1, 1)["rows"] == 2


def test_rolling_files(tmp_path: Path) -> None:
    sink = ParquetSink(tmp_path / "t", row_group_size=10, max_file_bytes=1)
    writer = sink.create_writer(0)
    writer.write(_batch(range(35)))
    writer.write(_batch(range(35, 50)))
    manifest = writer.pre_commit(1, 1)
    assert [f["rows"] for f in manifest["files"]] == [10, 10, 10, 10, 10]
    for item in manifest["files"]:
        assert pq.read_metadata(tmp_path / "t" / item["path"]).num_rows == 10
    sink.commit(1, [manifest])
    assert sorted(ds.dataset(sink.path).to_table().column("id").to_pylist()) == list(range(50))


def test_flush_leaves_only_complete_files(sink: ParquetSink) -> None:
    writer = sink.create_writer(0)
    writer.write(_batch([1, 2, 3]))
    writer.flush()
    writing = list((Path(sink.path) / "_raysink/staging/_writing").rglob("*"))
    files = [p for p in writing if p.is_file()]
    assert len(files) == 1 and not files[0].name.startswith(".")
    assert pq.read_table(files[0]).num_rows == 3


def test_pre_commit_rerun_returns_the_same_manifest(sink: ParquetSink) -> None:
    writer = sink.create_writer(0)
    writer.write(_batch([1]))
    first = writer.pre_commit(1, 1)
    assert writer.pre_commit(1, 1) == first
    assert writer.pre_commit(2, 1)["files"] == []


def test_open_sweeps_a_dead_incarnation(sink: ParquetSink) -> None:
    dead = sink.create_writer(3)
    dead.write(_batch([1]))
    dead.flush()  # then the actor died
    other = sink.create_writer(4)
    other.write(_batch([2]))
    other.flush()
    writing = Path(sink.path) / "_raysink/staging/_writing"
    assert len(list(writing.iterdir())) == 2
    reborn = sink.create_writer(3)
    reborn.open()
    reborn.open()
    assert [p.name[:5] for p in writing.iterdir()] == ["w0004"]


def test_close_drops_unstaged_files(sink: ParquetSink) -> None:
    writer = sink.create_writer(0)
    writer.write(_batch([1]))
    writer.flush()
    writer.write(_batch([2]))
    writer.close()
    assert list((Path(sink.path) / "_raysink/staging/_writing").iterdir()) == []


def test_writer_type(sink: ParquetSink) -> None:
    assert isinstance(sink.create_writer(0), ParquetSinkWriter)
    with pytest.raises(ConfigError):
        sink.create_writer(-1)


# --------------------------------------------------------------------------- validate


def test_validate_path_is_a_file(tmp_path: Path) -> None:
    target = tmp_path / "table"
    target.write_text("x")
    with pytest.raises(SinkUnavailableError, match="is a file; give a directory"):
        ParquetSink(target).validate()


def test_validate_parent_is_a_file(tmp_path: Path) -> None:
    (tmp_path / "plain").write_text("x")
    with pytest.raises(SinkUnavailableError, match="is a file"):
        ParquetSink(tmp_path / "plain" / "sub" / "table").validate()


def test_validate_creates_nothing(tmp_path: Path) -> None:
    ParquetSink(tmp_path / "a" / "b").validate()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("name", "is_dir", "match"), [
    ("data.csv", False, "not a Parquet file"),     # foreign files beside ours
    ("year=2020", True, "not a Parquet file"),     # a partitioned dataset
    ("metadata", True, "not a Parquet file"),      # an Iceberg table
    ("_delta_log", True, "Delta table"),           # a Delta table
    ("_raysink", False, "raysink keeps its log"),  # our log dir, clobbered by a file
])
def test_validate_refuses_foreign_content(tmp_path: Path, name: str, is_dir: bool,
                                          match: str) -> None:
    root = tmp_path / "t"
    root.mkdir()
    (root / name).mkdir() if is_dir else (root / name).write_text("x")
    with pytest.raises(SinkUnavailableError, match=match):
        ParquetSink(root).validate()


def test_validate_accepts_existing_parquet(tmp_path: Path) -> None:
    root = tmp_path / "t"
    root.mkdir()
    pq.write_table(pa.table({"id": [1], "v": ["a"]}), root / "part-0000.snappy.parquet")
    (root / "_SUCCESS").write_text("")
    ParquetSink(root).validate()
    with pytest.raises(SchemaMismatchError, match="unexpected columns"):
        ParquetSink(root, schema=pa.schema([("id", pa.int64())])).validate()


def test_validate_refuses_a_directory_of_another_runtime(sink: ParquetSink) -> None:
    sink.commit(1, _stage(sink, 1, 1, [[1]]))
    sink.validate()
    with pytest.raises(SinkUnavailableError, match="committed to by runtime"):
        ParquetSink(sink.path).bind("someone-else", "main").validate()


# --------------------------------------------------------------------------- markers


def test_committed_epoch_cases(sink: ParquetSink) -> None:
    assert sink.committed_epoch() is None  # directory never created
    sink.commit(7, _stage(sink, 7, 1, [[1]]))
    assert sink.committed_epoch() == 7
    (Path(sink.path) / "_raysink/commits/000000000007.json").unlink()
    assert sink.committed_epoch() is None  # marker deleted: the coordinator re-creates it
    sink.recreate_marker(7)
    assert sink.committed_epoch() == 7 and _visible(sink) == [1]


# --------------------------------------------------------------------------- options


def test_sink_is_picklable_and_keeps_its_binding(sink: ParquetSink) -> None:
    copy = pickle.loads(pickle.dumps(sink))
    assert copy.describe() == sink.describe()
    assert (copy.runtime, copy.name, copy.kind) == (sink.runtime, "main", "parquet")
    assert ParquetSink("rel/path").path == os.path.abspath("rel/path")
    assert ParquetSink("file:///tmp/x").path == "/tmp/x"


@pytest.mark.parametrize("options", [
    {"path": "s3://bucket/t"},               # object stores are for Delta / Iceberg
    {"path": "/t", "compression": "lzma"},   # unknown codec
    {"path": "/t", "row_group_size": 0},     # must be positive
    {"path": "/t", "max_file_bytes": -1},    # must be positive
    {"path": "/t", "schema": "id int"},      # a pa.Schema or None
])
def test_bad_options_are_config_errors(options: dict[str, object]) -> None:
    path = options.pop("path")
    with pytest.raises(ConfigError):
        ParquetSink(path, **options)  # type: ignore[arg-type]


def test_importing_sinks_imports_no_optional_library() -> None:
    code = ("import sys, raysink.sinks as s; assert s.ParquetSink.kind == 'parquet'; "
            "print(sorted(m for m in ('deltalake','pyiceberg','psycopg','pyspark') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                         text=True).stdout
    assert out.strip() == "[]"


def test_dictionary_encoding_only_where_values_repeat() -> None:
    from raysink.sinks._parquet_buffer import dictionary_columns

    rows = 10_000
    table = pa.table({
        "id": pa.array(range(rows), pa.int64()),                       # all distinct
        "label": pa.array([f"l{i % 7}" for i in range(rows)]),         # 7 values
        "flag": pa.array([i % 2 == 0 for i in range(rows)]),           # bit-packed anyway
        "nothing": pa.array([None] * rows, pa.string()),               # all null
    })
    assert dictionary_columns(table) == ["label", "nothing"]
    nested = table.append_column("tags", pa.array([[1]] * rows, pa.list_(pa.int64())))
    assert dictionary_columns(nested) is True  # pyarrow's default for nested schemas
