"""The shipped fakes: ListSink, FailingSink, InMemoryMetaStore and fault arming.

ListSink's share of the sink contract is in ``tests/integration/test_sink_contract.py``.
"""

from __future__ import annotations

import json
import multiprocessing
import pickle
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path

import pyarrow as pa
import pytest

from raysink._faults import InjectedFault, hit
from raysink.coordinator.metastore.base import HISTORY_LIMIT, EpochState, MetaStore
from raysink.errors import (
    ConfigError,
    DataLossError,
    FencedError,
    MetaStoreError,
    SchemaMismatchError,
    SinkUnavailableError,
)
from raysink.sinks.base import Manifest, Sink
from raysink.testing import (
    FailingSink,
    InjectedSinkFailure,
    InMemoryMetaStore,
    ListSink,
    arm_fault,
    disarm_faults,
    fault_dir,
    fired,
)


@pytest.fixture
def runtime() -> Iterator[str]:
    name = f"fakes-{uuid.uuid4().hex[:8]}"
    yield name
    disarm_faults(name)


def _batch(ids: Sequence[int]) -> pa.RecordBatch:
    return pa.record_batch({"id": pa.array(ids, pa.int64())})


def _stage(sink: Sink, epoch: int, attempt: int,
           rows: Sequence[Sequence[int]]) -> list[Manifest]:
    manifests = []
    for writer_id, ids in enumerate(rows):
        writer = sink.create_writer(writer_id)
        writer.open()
        if ids:
            writer.write(_batch(ids))
        manifests.append(writer.pre_commit(epoch, attempt))
    return manifests


def _ids(sink: ListSink) -> list[int]:
    table = sink.read()
    return sorted(table.column("id").to_pylist()) if table.num_rows else []


# --------------------------------------------------------------------------- ListSink


@pytest.fixture
def list_sink(tmp_path: Path, runtime: str) -> ListSink:
    return ListSink(tmp_path / "list").bind(runtime, "main")


def test_list_sink_reads_back_by_epoch(list_sink: ListSink) -> None:
    list_sink.commit(1, _stage(list_sink, 1, 1, [[1, 2], [3]]))
    list_sink.commit(2, _stage(list_sink, 2, 1, [[4], []]))
    assert _ids(list_sink) == [1, 2, 3, 4]
    assert list_sink.committed_epochs() == [1, 2]
    epoch_two = list_sink.read_epoch(2)
    assert epoch_two is not None and epoch_two.num_rows == 1
    assert not (list_sink.directory / "staging" / f"{1:012d}").exists()


def test_list_sink_lost_staging_and_escapes(list_sink: ListSink) -> None:
    manifests = _stage(list_sink, 1, 1, [[1]])
    with pytest.raises(MetaStoreError):
        list_sink.commit(1, [{"writer": 0, "rows": 1, "files": [{"path": "../../etc/passwd"}]}])
    (list_sink.directory / manifests[0]["files"][0]["path"]).unlink()
    with pytest.raises(DataLossError):
        list_sink.commit(1, manifests)


def test_list_sink_writer_checks_schema_and_rolls_back(list_sink: ListSink) -> None:
    writer = list_sink.create_writer(0)
    writer.write(_batch([1]))
    with pytest.raises(SchemaMismatchError):
        writer.write(pa.record_batch({"other": [1.0]}))
    writer.rollback(1, 1)
    assert writer.pre_commit(1, 2)["rows"] == 0


def test_list_sink_validate_and_pickle(tmp_path: Path, list_sink: ListSink) -> None:
    list_sink.validate()
    assert not list_sink.directory.exists()
    (tmp_path / "file").write_text("x")
    with pytest.raises(SinkUnavailableError):
        ListSink(tmp_path / "file" / "sub").validate()
    copy = pickle.loads(pickle.dumps(list_sink))
    assert (copy.directory, copy.runtime, copy.name, copy.kind) == (
        list_sink.directory, list_sink.runtime, "main", "list")


# --------------------------------------------------------------------------- FailingSink


def _failing(tmp_path: Path, runtime: str, **options: object) -> FailingSink:
    inner = ListSink(tmp_path / "inner")
    return FailingSink(inner, state_dir=tmp_path / "state", **options).bind(  # type: ignore[arg-type]
        runtime, "main")


def test_failing_sink_fails_the_nth_write_only(tmp_path: Path, runtime: str) -> None:
    sink = _failing(tmp_path, runtime, fail_write_at=3)
    first, second = sink.create_writer(0), sink.create_writer(1)
    first.write(_batch([1]))
    second.write(_batch([2]))
    with pytest.raises(InjectedSinkFailure, match="write call 3"):
        first.write(_batch([3]))
    first.write(_batch([4]))
    assert sink.counts()["write"] == 4


def _bump_commit_in_child(sink: FailingSink) -> None:
    with pytest.raises(InjectedSinkFailure):
        sink.commit(1, [])


def test_failing_sink_counts_across_processes(tmp_path: Path, runtime: str) -> None:
    sink = _failing(tmp_path, runtime, fail_commit_times=2)
    child = multiprocessing.get_context("fork").Process(target=_bump_commit_in_child,
                                                        args=(sink,))
    child.start()
    child.join(30)
    assert child.exitcode == 0
    with pytest.raises(InjectedSinkFailure, match="commit call 2"):
        sink.commit(1, [])
    assert sink.committed_epoch() is None  # "before": the target was never touched
    sink.commit(1, [])
    assert sink.committed_epoch() == 1
    assert sink.counts() == {"commit": 3}


def test_failing_sink_commit_fails_after_reaching_the_target(tmp_path: Path,
                                                              runtime: str) -> None:
    sink = _failing(tmp_path, runtime, fail_commit_times=1, fail_commit_mode="after")
    manifests = _stage(sink, 1, 1, [[1, 2]])
    with pytest.raises(InjectedSinkFailure):
        sink.commit(1, manifests)
    assert sink.committed_epoch() == 1
    sink.commit(1, manifests)  # the retry is idempotent
    assert isinstance(sink.inner, ListSink) and _ids(sink.inner) == [1, 2]


def test_failing_sink_stalls_commits(tmp_path: Path, runtime: str) -> None:
    sink = _failing(tmp_path, runtime, stall_commit_seconds=0.3, stall_commit_times=1)
    started = time.monotonic()
    sink.commit(1, [])
    assert time.monotonic() - started >= 0.3
    started = time.monotonic()
    sink.commit(2, [])
    assert time.monotonic() - started < 0.3


def test_failing_sink_pre_commit_and_abort(tmp_path: Path, runtime: str) -> None:
    sink = _failing(tmp_path, runtime, fail_pre_commit_times=1, fail_abort_times=1)
    writer = sink.create_writer(0)
    writer.write(_batch([1]))
    with pytest.raises(InjectedSinkFailure, match="pre_commit"):
        writer.pre_commit(1, 1)
    manifest = writer.pre_commit(1, 1)
    with pytest.raises(InjectedSinkFailure, match="abort"):
        sink.abort(1, [manifest])
    sink.abort(1, [manifest])
    sink.abort(1, None)


def test_failing_sink_wraps_transparently(tmp_path: Path, runtime: str) -> None:
    inner = ListSink(tmp_path / "inner", key=["id"])
    sink = FailingSink(inner, state_dir=tmp_path / "state").bind(runtime, "orders")
    assert sink.kind == "list" and sink.key == ("id",)
    assert sink.inner.runtime == runtime and sink.inner.name == "orders"
    assert sink.marker_id == f"raysink:{runtime}:orders"
    assert not sink.target_exists()
    sink.recreate_marker(3)
    assert sink.target_exists() and sink.committed_epoch() == 3
    assert pickle.loads(pickle.dumps(sink)).inner.name == "orders"
    with pytest.raises(ConfigError):
        FailingSink(inner, state_dir=tmp_path, fail_write_at=0)


# --------------------------------------------------------------------------- meta store


@pytest.fixture
def store() -> InMemoryMetaStore:
    return InMemoryMetaStore()


def test_store_implements_the_protocol(store: InMemoryMetaStore) -> None:
    assert isinstance(store, MetaStore)
    assert store.url == "memory://" and store.load("rt") is None


def test_claim_generations_and_sink_set(store: InMemoryMetaStore) -> None:
    assert store.claim("rt", {"a": "parquet"}).generation == 1
    assert store.claim("rt", {"a": "parquet"}).generation == 2
    with pytest.raises(ConfigError, match="sink set changed"):
        store.claim("rt", {"a": "parquet", "b": "delta"})
    with pytest.raises(ConfigError, match="changed kind"):
        store.claim("rt", {"a": "delta"})
    record = store.claim("rt", {"a": "parquet", "b": "delta"}, add=["b"])
    assert record.sinks == {"a": "parquet", "b": "delta"} and record.generation == 3
    record = store.claim("rt", {"b": "delta"}, drop=["a"])
    assert record.dropped == ("a",)
    assert store.claim("other", {"x": "list"}).generation == 1  # keyed by runtime


def test_generation_fence(store: InMemoryMetaStore) -> None:
    old = store.claim("rt", {"a": "list"}).generation
    new = store.claim("rt", {"a": "list"}).generation
    with pytest.raises(FencedError):
        store.put_open("rt", old, 1, 1, ["a"], {})
    assert store.records("rt") == []
    store.put_open("rt", new, 1, 1, ["a"], {})
    with pytest.raises(FencedError):
        store.set_sink_status("rt", old, "a", "running")
    with pytest.raises(MetaStoreError):
        store.put_open("never-claimed", 1, 1, 1, ["a"], {})


def test_epoch_lifecycle_round_trips_json(store: InMemoryMetaStore) -> None:
    gen = store.claim("rt", {"a": "list", "b": "list"}).generation
    store.put_open("rt", gen, 4, 1, ["a", "b"], {"writers": 2})
    manifests = {"a": [{"files": ("x",), "rows": 1}], "b": [{"files": [], "rows": 0}]}
    store.put_pending("rt", gen, 4, 1, manifests)
    records = store.records("rt")
    assert [(r.sink, r.epoch, r.state) for r in records] == [
        ("a", 4, EpochState.PENDING), ("b", 4, EpochState.PENDING)]
    assert records[0].manifests == [{"files": ["x"], "rows": 1}]  # a JSON round trip
    assert records[0].layout == {"writers": 2}
    records[0].manifests.clear()
    assert store.records("rt")[0].manifests  # records are copies
    store.put_committed("rt", gen, 4, "a")
    store.put_committed("rt", gen, 4, "a")  # idempotent
    assert store.records("rt")[0].state == EpochState.COMMITTED


def test_pending_needs_open_at_the_attempt(store: InMemoryMetaStore) -> None:
    gen = store.claim("rt", {"a": "list"}).generation
    with pytest.raises(MetaStoreError):
        store.put_pending("rt", gen, 1, 1, {"a": []})
    store.put_open("rt", gen, 1, 2, ["a"], {})
    with pytest.raises(MetaStoreError, match="attempt 1"):
        store.put_pending("rt", gen, 1, 1, {"a": []})
    with pytest.raises(MetaStoreError, match="JSON"):
        store.put_pending("rt", gen, 1, 2, {"a": [{"bad": object()}]})
    assert store.records("rt")[0].state == EpochState.OPEN
    with pytest.raises(MetaStoreError):
        store.put_committed("rt", gen, 1, "a")  # OPEN never commits


def test_committed_rows_are_pruned(store: InMemoryMetaStore) -> None:
    gen = store.claim("rt", {"a": "list"}).generation
    for epoch in (1, 2, 3):
        store.put_open("rt", gen, epoch, 1, ["a"], {})
        store.put_pending("rt", gen, epoch, 1, {"a": []})
        store.put_committed("rt", gen, epoch, "a")
    assert [(r.epoch, r.state) for r in store.records("rt")] == [(3, EpochState.COMMITTED)]
    with pytest.raises(MetaStoreError):
        store.put_open("rt", gen, 3, 2, ["a"], {})  # a committed epoch is never reopened


def test_abort_and_delete(store: InMemoryMetaStore) -> None:
    gen = store.claim("rt", {"a": "list", "b": "list"}).generation
    store.put_open("rt", gen, 1, 1, ["a", "b"], {})
    store.put_aborted("rt", gen, 1, 1)
    store.put_aborted("rt", gen, 1, 1)
    assert {r.state for r in store.records("rt")} == {EpochState.ABORTED}
    store.put_open("rt", gen, 1, 2, ["a", "b"], {})  # the retry
    store.put_pending("rt", gen, 1, 2, {"a": [], "b": []})
    with pytest.raises(MetaStoreError, match="rolls forward"):
        store.put_aborted("rt", gen, 1, 2)
    store.put_open("rt", gen, 2, 1, ["a"], {})
    store.put_aborted("rt", gen, 2, 1)
    store.delete_aborted("rt", gen, 2)
    assert [r.epoch for r in store.records("rt")] == [1, 1]


def test_status_history_and_source(store: InMemoryMetaStore) -> None:
    gen = store.claim("rt", {"a": "list"}).generation
    store.set_sink_status("rt", gen, "a", "running")
    store.set_sink_status("rt", gen, "a", "running")
    store.set_sink_status("rt", gen, "a", "stalled", "timeout")
    status = store.sink_statuses("rt")["a"]
    assert (status.state, status.last_error) == ("stalled", "timeout")
    assert [h["state"] for h in status.history] == ["running", "stalled"]
    for i in range(HISTORY_LIMIT * 2):
        store.set_sink_status("rt", gen, "a", f"s{i}")
    assert len(store.sink_statuses("rt")["a"].history) == HISTORY_LIMIT
    store.bind_source("rt", gen, {"query_id": "q1", "offset": 0})
    record = store.load("rt")
    assert record is not None and record.epoch_source == {"query_id": "q1", "offset": 0}
    store.close()
    assert store.load("rt") is not None  # the data outlives close


# --------------------------------------------------------------------------- faults


def test_arm_raise_fires_once(runtime: str) -> None:
    path = arm_fault(runtime, "coordinator.after_pending", action="raise")
    assert path.parent == fault_dir()
    assert json.loads(path.read_text())["action"] == "raise"
    assert not fired(runtime, "coordinator.after_pending")
    with pytest.raises(InjectedFault):
        hit("coordinator.after_pending", runtime=runtime)
    hit("coordinator.after_pending", runtime=runtime)  # disarmed itself
    assert fired(runtime, "coordinator.after_pending")


def test_arm_counts_times(runtime: str) -> None:
    arm_fault(runtime, "writer.during_write", action="raise", times=2)
    with pytest.raises(InjectedFault):
        hit("writer.during_write", runtime=runtime)
    assert fired(runtime, "writer.during_write")
    with pytest.raises(InjectedFault):
        hit("writer.during_write", runtime=runtime)
    hit("writer.during_write", runtime=runtime)


def test_when_filter(runtime: str) -> None:
    arm_fault(runtime, "sink.mid_commit", action="raise", when={"sink": "b", "epoch": 2})
    hit("sink.mid_commit", runtime=runtime, sink="a", epoch=2)
    hit("sink.mid_commit", runtime=runtime, sink="b", epoch=1)
    hit("sink.mid_commit", runtime=f"{runtime}-other", sink="b", epoch=2)
    assert not fired(runtime, "sink.mid_commit")
    with pytest.raises(InjectedFault):
        hit("sink.mid_commit", runtime=runtime, sink="b", epoch=2)


def test_sleep_rearm_and_disarm(runtime: str) -> None:
    arm_fault(runtime, "coordinator.after_open", action="sleep", seconds=0.2)
    started = time.monotonic()
    hit("coordinator.after_open", runtime=runtime)
    assert time.monotonic() - started >= 0.2
    assert fired(runtime, "coordinator.after_open")
    arm_fault(runtime, "coordinator.after_open", action="raise")
    assert not fired(runtime, "coordinator.after_open")  # re-arming clears it
    disarm_faults(runtime)
    disarm_faults(runtime)
    hit("coordinator.after_open", runtime=runtime)
    assert not fired(runtime, "coordinator.after_open")


@pytest.mark.parametrize("options", [
    {"point": "no.such.point"},                 # unknown point
    {"action": "explode"},                      # unknown action
    {"times": 0},                               # fires at least once
])
def test_arm_rejects_bad_options(runtime: str, options: dict[str, object]) -> None:
    args: dict[str, object] = {"point": "sink.mid_commit", **options}
    point = str(args.pop("point"))
    with pytest.raises(ConfigError):
        arm_fault(runtime, point, **args)  # type: ignore[arg-type]
