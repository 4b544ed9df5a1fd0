"""IcebergSink driven without Ray: stale handles, snapshot expiry, schema, validation,
lost tables and markers.

The cases every sink shares (commit twice, abort twice, markers, empty epochs,
rollback, a crash inside commit) are in ``tests/integration/test_sink_contract.py``.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

pytest.importorskip("pyiceberg")

from pyiceberg.catalog import load_catalog

from raysink.errors import (
    ConfigError,
    MetaStoreError,
    SchemaMismatchError,
    SinkUnavailableError,
)
from raysink.sinks.iceberg import EPOCH_PROPERTY, SINK_PROPERTY, IcebergSink
from raysink.sinks.iceberg import _sink as iceberg_module
from tests.support.staging import stage_writers as stage

IDENT = "ns.events"


def catalog_props(root: Path) -> dict[str, str]:
    return {"type": "sql", "uri": f"sqlite:///{root / 'catalog.db'}",
            "warehouse": f"file://{root / 'warehouse'}"}


def sink_at(root: Path, name: str = "main") -> IcebergSink:
    return IcebergSink(IDENT, catalog=catalog_props(root)).bind("rt", name)




def batch(ids: Sequence[int]) -> pa.RecordBatch:
    return pa.record_batch({"id": pa.array(ids, pa.int64()),
                            "v": pa.array([f"v{i}" for i in ids], pa.string())})


def table(root: Path) -> Any:
    return load_catalog("raysink", **catalog_props(root)).load_table(IDENT)


def ids(root: Path) -> list[int]:
    return sorted(table(root).scan().to_arrow().column("id").to_pylist())


def our_snapshots(root: Path, epoch: int) -> int:
    return sum(1 for s in table(root).snapshots()
               if s.summary.get(SINK_PROPERTY) == "raysink:rt:main"
               and s.summary.get(EPOCH_PROPERTY) == str(epoch))


def local(uri: str) -> Path:
    return Path(uri.removeprefix("file://"))


def listing(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*")) if path.exists() else []


def on_mid_commit(monkeypatch: pytest.MonkeyPatch, action: Callable[[], None]) -> None:
    fired: list[bool] = []

    def fake_hit(point: str, **context: Any) -> None:
        if point == "sink.mid_commit" and not fired:
            fired.append(True)
            action()

    monkeypatch.setattr(iceberg_module, "hit", fake_hit)


@pytest.mark.parametrize("existing_table", [False, True])  # table creation, plain append
def test_two_stale_handles_commit_the_same_epoch_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, existing_table: bool) -> None:
    first, second = sink_at(tmp_path), sink_at(tmp_path)
    if existing_table:
        first.commit(1, stage(first, 1, [[batch([1])]]))
    epoch = 2 if existing_table else 1
    manifests = stage(first, epoch, [[batch([10, 11, 12])], [batch([13])]])
    # first holds a table handle that is stale once second has committed the epoch
    on_mid_commit(monkeypatch, lambda: second.commit(epoch, manifests))
    first.commit(epoch, manifests)
    assert our_snapshots(tmp_path, epoch) == 1
    assert ids(tmp_path).count(10) == 1 and len(ids(tmp_path)) == 4 + int(existing_table)
    second.commit(epoch, manifests)
    assert our_snapshots(tmp_path, epoch) == 1
    # pyiceberg's own retry re-applies an append on refreshed metadata without our check
    assert table(tmp_path).properties["commit.retry.num-retries"] == "0"


def test_marker_survives_snapshot_expiry_through_the_table_property(tmp_path: Path) -> None:
    sink = sink_at(tmp_path)
    sink.commit(1, stage(sink, 1, [[batch([1])]]))
    other = sink_at(tmp_path, name="other")
    other.commit(1, stage(other, 1, [[batch([2])]]))
    t = table(tmp_path)
    t.maintenance.expire_snapshots().by_id(t.snapshots()[0].snapshot_id).commit()
    assert sink.committed_epoch() == 1
    sink.commit(1, stage(sink, 1, [[batch([1])]], attempt=2))  # still a no-op
    assert ids(tmp_path) == [1, 2]


def test_abort_before_any_table_creates_nothing(tmp_path: Path) -> None:
    sink = sink_at(tmp_path)
    manifests = stage(sink, 1, [[batch([1])]])
    sink.abort(1, manifests)
    sink.abort(1, None)
    assert not (tmp_path / "catalog.db").exists()
    assert not local(manifests[0]["files"][0]["path"]).exists()


def test_abort_over_a_table_whose_snapshot_has_no_files(tmp_path: Path) -> None:
    """An empty first epoch creates the table with a snapshot that references no data
    file. Sweeping the next epoch then listed the snapshot's files with pyiceberg's
    ``inspect.files()``, which raises ``ArrowInvalid`` over zero manifests: every
    resolve of the epoch failed, and the driver's every write of it (a chaos trial:
    Iceberg, ``write(df)``, a writer SIGKILLed after its pre-commit)."""
    sink = sink_at(tmp_path)
    empty = pa.RecordBatch.from_pylist([], schema=batch([1]).schema)
    assert sink.commit(1, stage(sink, 1, [[empty]])).value == "committed"
    assert table(tmp_path).current_snapshot() is not None
    manifests = stage(sink, 2, [[batch([5, 6])]])
    sink.abort(2, None)
    sink.abort(2, None)
    assert not local(manifests[0]["files"][0]["path"]).exists()
    assert ids(tmp_path) == []


def test_manifest_path_outside_the_staging_is_refused(tmp_path: Path) -> None:
    sink = sink_at(tmp_path)
    manifests = stage(sink, 1, [[batch([1])]])
    manifests[0]["files"][0]["path"] = "file:///etc/e000000000001-a0001-w0000-" + "0" * 32 \
        + "-0000.parquet"
    with pytest.raises(MetaStoreError):
        sink.commit(1, manifests)


def test_schema_mismatch(tmp_path: Path) -> None:
    sink = sink_at(tmp_path)
    sink.commit(1, stage(sink, 1, [[batch([1])]]))
    writer = sink.create_writer(0)
    with pytest.raises(SchemaMismatchError):
        writer.write(pa.record_batch({"id": pa.array([2], pa.int64()), "v": [1.5]}))
    with pytest.raises(SchemaMismatchError):
        writer.write(batch([2]).append_column("extra", pa.array([1])))
    fresh = sink.create_writer(1)
    fresh.write(batch([2]))
    with pytest.raises(SchemaMismatchError):
        fresh.write(pa.record_batch({"id": pa.array([2], pa.int32())}))


def test_validate_creates_nothing_with_the_default_catalog(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    sink = IcebergSink(IDENT).bind("rt", "main")
    monkeypatch.chdir("/")  # actors in another cwd agree on the catalog
    sink.validate()
    assert listing(tmp_path) == []
    sink.commit(1, stage(sink, 1, [[batch([1])]]))
    assert (tmp_path / ".raysink" / "iceberg" / "catalog.db").is_file()
    before = listing(tmp_path)
    sink.validate()
    assert listing(tmp_path) == before


def test_validate_an_empty_existing_catalog_creates_nothing(tmp_path: Path) -> None:
    sink_at(tmp_path).commit(1, [])  # no table, no schema: nothing at all
    assert listing(tmp_path) == []
    other = tmp_path / "other"
    other.mkdir()
    (other / "catalog.db").touch()  # a catalog database without catalog tables
    before = listing(tmp_path)
    sink_at(other).validate()
    assert listing(tmp_path) == before


def test_validate_errors(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    with pytest.raises(SinkUnavailableError):
        sink_at(tmp_path / "f").validate()
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "catalog.db").write_text("not a database")
    with pytest.raises(SinkUnavailableError):
        sink_at(tmp_path / "bad").validate()
    with pytest.raises(ConfigError):
        IcebergSink("no_namespace")
    with pytest.raises(ConfigError, match="warehouse"):
        IcebergSink(IDENT, catalog={"type": "sql",
                                    "uri": f"sqlite:///{tmp_path / 'x.db'}"}).validate()


def test_recreate_marker_is_idempotent(tmp_path: Path) -> None:
    other = sink_at(tmp_path, name="other")
    other.commit(4, stage(other, 4, [[batch([1])]]))
    sink = sink_at(tmp_path)
    sink.recreate_marker(3)
    sink.recreate_marker(3)
    assert sink.committed_epoch() == 3 and our_snapshots(tmp_path, 3) == 1


def test_sink_pickles_and_redacts_secrets(tmp_path: Path) -> None:
    sink = IcebergSink(IDENT, catalog={**catalog_props(tmp_path),
                                       "s3.secret-access-key": "hunter2",
                                       "uri": "postgresql://u:pw@h/db"}).bind("rt", "main")
    assert "hunter2" not in repr(sink) and "pw@" not in repr(sink)
    assert pickle.loads(pickle.dumps(sink)).identifier == IDENT
