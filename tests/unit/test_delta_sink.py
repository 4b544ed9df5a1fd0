"""DeltaSink driven without Ray: concurrent committers, upserts, partitions, schema,
validation, lost tables and markers.

The cases every sink shares (commit twice, abort twice, markers, empty epochs,
rollback, a crash inside commit) are in ``tests/integration/test_sink_contract.py``.
"""

from __future__ import annotations

import os
import pickle
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

deltalake = pytest.importorskip("deltalake")

from raysink.errors import (  # noqa: E402
    ConfigError,
    MetaStoreError,
    SchemaMismatchError,
    SinkUnavailableError,
)
from raysink.sinks.delta import DeltaSink  # noqa: E402
from raysink.sinks.delta import _sink as delta_module  # noqa: E402
from tests.support.staging import stage_writers as stage  # noqa: E402


def sink_at(path: Path, **options: Any) -> DeltaSink:
    return DeltaSink(str(path), **options).bind("rt", "main")




def batch(ids: Sequence[int], values: Sequence[str] | None = None) -> pa.RecordBatch:
    vals = values if values is not None else [f"v{i}" for i in ids]
    return pa.record_batch({"id": pa.array(ids, pa.int64()), "v": pa.array(vals, pa.string())})


def read(path: Path) -> dict[str, list[Any]]:
    table = deltalake.DeltaTable(str(path)).to_pyarrow_table()
    rows: dict[str, list[Any]] = table.sort_by(
        [(n, "ascending") for n in table.column_names]).to_pydict()
    return rows


def version(path: Path) -> int:
    return int(deltalake.DeltaTable(str(path)).version())


def listing(path: Path) -> list[str]:
    if not path.exists():
        return []
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def on_mid_commit(monkeypatch: pytest.MonkeyPatch, action: Callable[[], None]) -> None:
    """Run ``action`` once at the sink.mid_commit point of the next commit."""
    fired: list[bool] = []

    def fake_hit(point: str, **context: Any) -> None:
        if point == "sink.mid_commit" and not fired:
            fired.append(True)
            action()

    monkeypatch.setattr(delta_module, "hit", fake_hit)


# --------------------------------------------------------------------------- append


@pytest.mark.parametrize("existing_table", [False, True])  # table creation, plain append
def test_a_concurrent_commit_of_the_same_epoch_wins_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, existing_table: bool) -> None:
    path = tmp_path / "t"
    first, second = sink_at(path), sink_at(path)
    if existing_table:
        first.commit(1, stage(first, 1, [[batch([1])]]))
    epoch = 2 if existing_table else 1
    manifests = stage(first, epoch, [[batch([10, 11])]])
    start = version(path) if existing_table else -1
    # first has passed the marker check when second commits the whole epoch
    on_mid_commit(monkeypatch, lambda: second.commit(epoch, manifests))
    first.commit(epoch, manifests)
    assert version(path) == start + 1
    assert read(path)["id"].count(10) == 1
    assert first.committed_epoch() == epoch


def test_partitioned_append(tmp_path: Path) -> None:
    path = tmp_path / "t"
    sink = sink_at(path, partition_by=["day"])
    data = pa.record_batch({"day": ["a", "b", None, "a"], "n": [1, 2, 3, 4]})
    manifests = stage(sink, 1, [[data]])
    assert sorted(str(f["partition_values"]["day"]) for f in manifests[0]["files"]) == \
        ["None", "a", "b"]
    sink.commit(1, manifests)
    table = deltalake.DeltaTable(str(path))
    assert table.metadata().partition_columns == ["day"]
    got = table.to_pyarrow_table().sort_by("n").to_pydict()
    assert got == {"day": ["a", "b", None, "a"], "n": [1, 2, 3, 4]}


# --------------------------------------------------------------------------- abort


def test_manifest_path_outside_the_staging_is_refused(tmp_path: Path) -> None:
    sink = sink_at(tmp_path / "t")
    manifests = stage(sink, 1, [[batch([1])]])
    manifests[0]["files"][0]["path"] = "../elsewhere/x.parquet"
    with pytest.raises(MetaStoreError):
        sink.commit(1, manifests)
    with pytest.raises(MetaStoreError):
        sink.abort(1, manifests)


# --------------------------------------------------------------------------- upsert


def test_upsert_keeps_the_last_value_per_key_within_and_across_epochs(tmp_path: Path) -> None:
    path = tmp_path / "t"
    sink = sink_at(path, mode="upsert", key=["id"])
    # within epoch 1: writer 0 repeats key 1; writer 1 (later in manifest order) repeats 2
    sink.commit(1, stage(sink, 1, [[batch([1, 2, 1], ["a", "b", "c"])],
                                    [batch([2, 3], ["d", "e"])]]))
    assert read(path) == {"id": [1, 2, 3], "v": ["c", "d", "e"]}
    manifests = stage(sink, 2, [[batch([3, 4], ["x", "y"]), batch([4], ["z"])]])
    sink.commit(2, manifests)
    sink.commit(2, manifests)  # idempotent (its staged files are gone by now)
    assert read(path) == {"id": [1, 2, 3, 4], "v": ["c", "d", "x", "z"]}
    assert sink.committed_epoch() == 2
    assert not (path / "_raysink" / f"{2:012d}").exists()


def test_upsert_concurrent_commit_of_the_same_epoch_wins_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "t"
    first, second = sink_at(path, mode="upsert", key=["id"]), \
        sink_at(path, mode="upsert", key=["id"])
    first.commit(1, stage(first, 1, [[batch([1], ["a"])]]))
    manifests = stage(first, 2, [[batch([1, 2], ["b", "c"])]])
    on_mid_commit(monkeypatch, lambda: second.commit(2, manifests))
    first.commit(2, manifests)
    assert read(path) == {"id": [1, 2], "v": ["b", "c"]}
    assert first.committed_epoch() == 2


def test_null_keys_fail_the_write_and_nothing_is_staged(tmp_path: Path) -> None:
    path = tmp_path / "t"
    writer = sink_at(path, mode="upsert", key=["id"]).create_writer(0)
    with pytest.raises(SchemaMismatchError, match="null"):
        writer.write(pa.record_batch({"id": pa.array([1, None], pa.int64()), "v": ["a", "b"]}))
    assert listing(path) == []


# --------------------------------------------------------------------------- schema


def test_schema_mismatch_with_the_table_fails_the_write(tmp_path: Path) -> None:
    path = tmp_path / "t"
    sink = sink_at(path)
    sink.commit(1, stage(sink, 1, [[batch([1])]]))
    writer = sink.create_writer(0)
    with pytest.raises(SchemaMismatchError, match="'v'"):
        writer.write(pa.record_batch({"id": pa.array([2], pa.int64()), "v": [1.5]}))
    with pytest.raises(SchemaMismatchError, match="'extra'"):
        writer.write(batch([2]).append_column("extra", pa.array([1])))


def test_schema_change_within_an_epoch_fails(tmp_path: Path) -> None:
    writer = sink_at(tmp_path / "t").create_writer(0)
    writer.write(batch([1]))
    with pytest.raises(SchemaMismatchError):
        writer.write(pa.record_batch({"id": pa.array([2], pa.int32()), "v": ["x"]}))


def test_add_columns_evolves_the_table(tmp_path: Path) -> None:
    path = tmp_path / "t"
    sink = sink_at(path, schema_evolution="add_columns")
    sink.commit(1, stage(sink, 1, [[batch([1])]]))
    wider = batch([2]).append_column("extra", pa.array([7], pa.int64()))
    sink.commit(2, stage(sink, 2, [[wider]]))
    assert read(path) == {"id": [1, 2], "v": ["v1", "v2"], "extra": [None, 7]}


# --------------------------------------------------------------------------- validate


@pytest.mark.parametrize("prepare", [
    lambda p: None,                                          # absent: will be created
    lambda p: p.mkdir(),                                     # an empty directory
    lambda p: (p / "_raysink").mkdir(parents=True),          # only our staging
    lambda p: (p / "raysink").mkdir(parents=True),           # only 0.2's staging
])
def test_validate_accepts_and_creates_nothing(tmp_path: Path,
                                              prepare: Callable[[Path], None]) -> None:
    path = tmp_path / "t"
    prepare(path)
    before = listing(tmp_path)
    sink_at(path).validate()
    sink_at(path, mode="upsert", key=["id"]).validate()
    assert listing(tmp_path) == before


def test_validate_an_existing_table_creates_nothing(tmp_path: Path) -> None:
    path = tmp_path / "t"
    sink = sink_at(path)
    sink.commit(1, stage(sink, 1, [[batch([1])]]))
    before = listing(tmp_path)
    sink.validate()
    assert listing(tmp_path) == before
    with pytest.raises(ConfigError, match="partitioned"):
        sink_at(path, partition_by=["v"]).validate()


@pytest.mark.parametrize("prepare", [
    lambda p: p.write_text("x"),                              # a file
    lambda p: (p.mkdir(), (p / "data.csv").write_text("x")),  # a non-Delta directory
    lambda p: (p.parent / "f").write_text("x"),               # under a file
])
def test_validate_refuses_a_path_holding_something_else(
        tmp_path: Path, prepare: Callable[[Path], object]) -> None:
    path = tmp_path / "t"
    prepare(path)
    target = tmp_path / "f" / "t" if (tmp_path / "f").exists() else path
    before = listing(tmp_path)
    with pytest.raises(SinkUnavailableError):
        sink_at(target).validate()
    assert listing(tmp_path) == before


def test_options_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="key"):
        sink_at(tmp_path / "t", mode="upsert").validate()
    with pytest.raises(ConfigError):
        DeltaSink(str(tmp_path), mode="merge")  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        DeltaSink(str(tmp_path), key=["id"])  # a key without upsert


# --------------------------------------------------------------------------- lost table


def test_recreate_marker_writes_an_empty_commit_once(tmp_path: Path) -> None:
    path = tmp_path / "t"
    other = DeltaSink(str(path)).bind("rt", "other")
    other.commit(5, stage(other, 5, [[batch([1])]]))
    sink = sink_at(path)
    assert sink.committed_epoch() is None
    sink.recreate_marker(3)
    sink.recreate_marker(3)
    assert sink.committed_epoch() == 3 and version(path) == 1


def test_sink_pickles_without_live_state(tmp_path: Path) -> None:
    sink = sink_at(tmp_path / "t", mode="upsert", key=["id"])
    clone = pickle.loads(pickle.dumps(sink))
    assert clone.marker_id == "raysink:rt:main" and clone.key == ("id",)
    assert os.listdir(tmp_path) == []


def test_kept_table_follows_other_committers_deletion_and_recreation(tmp_path: Path) -> None:
    """The coordinator keeps its table between calls: it still sees commits made by
    another process, a deleted table, and a table re-created at the same path."""
    path = tmp_path / "t"
    ours, theirs = sink_at(path), sink_at(path)
    ours.commit(1, stage(ours, 1, [[batch([1, 2])]]))
    assert ours.committed_epoch() == 1
    theirs.commit(2, stage(theirs, 2, [[batch([3])]]))
    assert ours.committed_epoch() == 2  # brought up to date, not reloaded
    assert read(path)["id"] == [1, 2, 3]
    shutil.rmtree(path)
    assert ours.committed_epoch() is None and not ours.target_exists()
    deltalake.write_deltalake(str(path), pa.table({"id": pa.array([9], pa.int64()),
                                                   "v": pa.array(["x"], pa.string())}))
    assert ours.committed_epoch() is None  # another table: no marker of ours
    ours.commit(3, stage(ours, 3, [[batch([4])]]))
    assert ours.committed_epoch() == 3
    assert read(path)["id"] == [4, 9]


def test_sink_pickles_without_its_kept_table(tmp_path: Path) -> None:
    sink = sink_at(tmp_path / "t")
    sink.commit(1, stage(sink, 1, [[batch([1])]]))
    assert sink.committed_epoch() == 1
    clone = pickle.loads(pickle.dumps(sink))
    assert clone.committed_epoch() == 1
