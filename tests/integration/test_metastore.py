"""The meta store contract, run against SQLite (a tmp file) and PostgreSQL (``pg_server``).

Every test uses a fresh runtime name, so the PostgreSQL tables can be shared by the whole
session. No Ray is started here.
"""

from __future__ import annotations

import json
import re
import sqlite3
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from raysink.coordinator.metastore import (
    HISTORY_LIMIT,
    EpochState,
    MetaStore,
    PostgresMetaStore,
    SqliteMetaStore,
    default_url,
    open_metastore,
    redact_url,
)
from raysink.errors import ConfigError, FencedError, MetaStoreError, RuntimeInUseError
from tests.support.postgres import PostgresServer

SINKS = {"a": "parquet", "b": "delta"}


@dataclass
class Backend:
    """One meta store location and a way to tamper with its rows behind its back."""

    name: str
    url: str
    raw: Callable[[str, tuple[Any, ...]], None]
    opened: list[MetaStore] = field(default_factory=list)

    def open(self, runtime: str = "ignored") -> MetaStore:
        store = open_metastore(self.url, runtime)
        self.opened.append(store)
        return store


def _sqlite_backend(path: Path) -> Backend:
    def raw(sql: str, params: tuple[Any, ...]) -> None:
        with sqlite3.connect(path) as conn:
            conn.execute(sql, params)

    return Backend("sqlite", f"sqlite:///{path}", raw)


def _postgres_backend(server: PostgresServer) -> Backend:
    def raw(sql: str, params: tuple[Any, ...]) -> None:
        server.execute(sql.replace("?", "%s"), params, dbname="raysink")

    return Backend("postgres", server.dsn(), raw)


@pytest.fixture(params=["sqlite", "postgres"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    if request.param == "sqlite":
        chosen = _sqlite_backend(tmp_path / "meta" / "store.db")
    else:
        chosen = _postgres_backend(request.getfixturevalue("pg_server"))
    yield chosen
    for store in chosen.opened:
        store.close()


@pytest.fixture
def store(backend: Backend) -> MetaStore:
    return backend.open()


@pytest.fixture
def rt() -> str:
    return f"rt-{uuid.uuid4().hex[:10]}"


def _states(store: MetaStore, runtime: str) -> list[tuple[str, int, int, EpochState]]:
    return [(r.sink, r.epoch, r.attempt, r.state) for r in store.records(runtime)]


# --------------------------------------------------------------------------- runtimes


def test_claim_creates_then_starts_new_generations(store: MetaStore, rt: str) -> None:
    assert store.load(rt) is None
    first = store.claim(rt, SINKS)
    assert (first.name, first.generation, first.sinks, first.dropped) == (rt, 1, SINKS, ())
    assert store.claim(rt, SINKS).generation == 2
    loaded = store.load(rt)
    assert loaded is not None and loaded.generation == 2 and loaded.epoch_source is None
    assert isinstance(store, MetaStore)


@pytest.mark.parametrize(("sinks", "add", "drop"), [
    ({"a": "parquet"}, (), ()),                              # b missing, not dropped
    ({"a": "parquet", "b": "delta", "c": "iceberg"}, (), ()),  # c new, not added
    ({"a": "parquet", "c": "iceberg"}, ("c",), ()),           # added c but b missing
    ({"a": "parquet", "b": "iceberg"}, ("b",), ("b",)),       # b changed kind
])
def test_sink_set_change_without_add_drop_is_config_error(
        store: MetaStore, rt: str, sinks: dict[str, str], add: tuple[str, ...],
        drop: tuple[str, ...]) -> None:
    store.claim(rt, SINKS)
    with pytest.raises(ConfigError) as info:
        store.claim(rt, sinks, add=add, drop=drop)
    assert info.value.runtime == rt
    loaded = store.load(rt)
    assert loaded is not None and (loaded.generation, loaded.sinks) == (1, SINKS)


def test_sink_set_change_with_add_drop_records_dropped(store: MetaStore, rt: str) -> None:
    store.claim(rt, SINKS)
    store.bind_source(rt, 1, {"kind": "own"})
    changed = store.claim(rt, {"a": "parquet", "c": "iceberg"}, add={"c"}, drop={"b"})
    assert (changed.generation, changed.dropped) == (2, ("b",))
    assert changed.epoch_source == {"kind": "own"}  # the binding survives a claim
    again = store.claim(rt, {"a": "parquet", "c": "iceberg"})
    assert again.dropped == ("b",)  # dropped names stay recorded
    back = store.claim(rt, {"a": "parquet", "b": "delta", "c": "iceberg"}, add={"b"})
    assert back.dropped == ()


def test_bind_source_replaces(store: MetaStore, rt: str) -> None:
    store.claim(rt, SINKS)
    store.bind_source(rt, 1, {"query_id": "q1", "offset": 0})
    store.bind_source(rt, 1, {"query_id": "q2", "offset": 7})
    loaded = store.load(rt)
    assert loaded is not None and loaded.epoch_source == {"query_id": "q2", "offset": 7}


# --------------------------------------------------------------------------- epochs


def test_open_pending_committed(store: MetaStore, rt: str) -> None:
    gen = store.claim(rt, SINKS).generation
    layout = {"writers": {"a": 2, "b": 1}}
    store.put_open(rt, gen, 1, 1, ["a", "b"], layout)
    assert _states(store, rt) == [("a", 1, 1, EpochState.OPEN), ("b", 1, 1, EpochState.OPEN)]
    manifests: dict[str, list[dict[str, Any]]] = {
        "a": [{"files": ["x.parquet"], "rows": 3}], "b": [{"rows": 0}]}
    store.put_pending(rt, gen, 1, 1, manifests)
    records = store.records(rt)
    assert [r.state for r in records] == [EpochState.PENDING] * 2
    assert {r.sink: r.manifests for r in records} == manifests
    assert all(r.layout == layout and r.updated_at > 0 for r in records)
    for _ in range(2):  # idempotent
        store.put_committed(rt, gen, 1, "a")
    store.put_committed(rt, gen, 1, "b")
    assert [r.state for r in store.records(rt)] == [EpochState.COMMITTED] * 2
    assert store.records(rt)[0].manifests == manifests["a"]


def test_aborted_then_deleted_and_retried(store: MetaStore, rt: str) -> None:
    gen = store.claim(rt, SINKS).generation
    store.put_open(rt, gen, 4, 1, ["a", "b"], {})
    for _ in range(2):  # idempotent
        store.put_aborted(rt, gen, 4, 1)
    assert _states(store, rt) == [("a", 4, 1, EpochState.ABORTED),
                                  ("b", 4, 1, EpochState.ABORTED)]
    store.put_open(rt, gen, 4, 2, ["a"], {})  # a retry reopens over an aborted attempt
    with pytest.raises(MetaStoreError):
        store.put_open(rt, gen, 4, 1, ["a"], {})  # below the recorded attempt
    for _ in range(2):  # idempotent
        store.delete_aborted(rt, gen, 4)
    assert _states(store, rt) == [("a", 4, 2, EpochState.OPEN)]


@pytest.mark.parametrize(("epoch", "attempt", "sink"), [
    (1, 2, "a"),   # OPEN, but at attempt 1
    (9, 1, "a"),   # no record at all
    (1, 1, "c"),   # sink without a record
    (2, 1, "a"),   # already PENDING
])
def test_put_pending_refused_unless_open_at_attempt(
        store: MetaStore, rt: str, epoch: int, attempt: int, sink: str) -> None:
    gen = store.claim(rt, SINKS).generation
    store.put_open(rt, gen, 1, 1, ["a", "b"], {})
    store.put_open(rt, gen, 2, 1, ["a"], {})
    store.put_pending(rt, gen, 2, 1, {"a": []})
    before = store.records(rt)
    with pytest.raises(MetaStoreError) as info:
        store.put_pending(rt, gen, epoch, attempt, {"b": [{"n": 1}], sink: [{"n": 2}]})
    assert info.value.epoch == epoch
    assert store.records(rt) == before  # the whole transaction changed nothing


def test_put_aborted_refused_on_pending(store: MetaStore, rt: str) -> None:
    gen = store.claim(rt, SINKS).generation
    store.put_open(rt, gen, 3, 1, ["a", "b"], {})
    store.put_pending(rt, gen, 3, 1, {"a": [], "b": []})
    with pytest.raises(MetaStoreError, match="rolls forward"):
        store.put_aborted(rt, gen, 3, 1)
    with pytest.raises(MetaStoreError, match="cannot be reopened"):
        store.put_open(rt, gen, 3, 2, ["a"], {})
    assert {r.state for r in store.records(rt)} == {EpochState.PENDING}


def test_put_committed_refused_unless_pending(store: MetaStore, rt: str) -> None:
    gen = store.claim(rt, SINKS).generation
    store.put_open(rt, gen, 1, 1, ["a"], {})
    with pytest.raises(MetaStoreError, match="only a PENDING epoch"):
        store.put_committed(rt, gen, 1, "a")
    with pytest.raises(MetaStoreError, match="no record"):
        store.put_committed(rt, gen, 2, "a")


def test_committed_records_say_whether_the_marker_was_left(store: MetaStore, rt: str) -> None:
    gen = store.claim(rt, SINKS).generation
    store.put_open(rt, gen, 1, 0, ["a", "b"], {})
    store.put_pending(rt, gen, 1, 0, {"a": [], "b": []})
    store.put_committed(rt, gen, 1, "a", marked=False)  # no target yet, nothing to make one
    store.put_committed(rt, gen, 1, "b")
    assert {r.sink: r.marked for r in store.records(rt)} == {"a": False, "b": True}
    store.put_open(rt, gen, 2, 0, ["a", "b"], {})
    assert {r.sink: r.marked for r in store.records(rt) if r.epoch == 2} == {"a": True,
                                                                             "b": True}


def test_the_newest_marked_commit_outlives_the_pruning(store: MetaStore, rt: str) -> None:
    """Epochs that carried nothing leave no marker: the newest epoch whose marker the
    target must hold is kept beside the newest, whatever came between."""
    gen = store.claim(rt, SINKS).generation
    for epoch, marked in [(1, True), (2, True), (3, False), (4, False), (5, False)]:
        store.put_open(rt, gen, epoch, 0, ["a"], {})
        store.put_pending(rt, gen, epoch, 0, {"a": []})
        store.put_committed(rt, gen, epoch, "a", marked=marked)
    assert [(r.epoch, r.marked) for r in store.records(rt)] == [(2, True), (5, False)]
    store.put_open(rt, gen, 6, 0, ["a"], {})
    store.put_pending(rt, gen, 6, 0, {"a": []})
    store.put_committed(rt, gen, 6, "a")
    assert [(r.epoch, r.marked) for r in store.records(rt)] == [(6, True)]


def test_a_store_from_before_the_marked_column_is_brought_up_to_date(
        backend: Backend, store: MetaStore, rt: str) -> None:
    gen = store.claim(rt, SINKS).generation
    store.put_open(rt, gen, 1, 0, ["a"], {})
    store.close()
    # a build from before raysink 0.1.0: no schema version, no marked (nor written_by)
    for statement in ("ALTER TABLE raysink_epochs DROP COLUMN marked",
                      "ALTER TABLE raysink_epochs DROP COLUMN written_by",
                      "DROP TABLE raysink_schema"):
        backend.raw(statement, ())
    reopened = backend.open()
    assert [(r.epoch, r.marked) for r in reopened.records(rt)] == [(1, True)]
    reopened.put_pending(rt, gen, 1, 0, {"a": []})
    reopened.put_committed(rt, gen, 1, "a", marked=False)
    assert [r.marked for r in reopened.records(rt)] == [False]


def test_put_open_refuses_unknown_sink(store: MetaStore, rt: str) -> None:
    gen = store.claim(rt, SINKS).generation
    with pytest.raises(MetaStoreError, match="not in the runtime's sink set"):
        store.put_open(rt, gen, 1, 1, ["a", "zzz"], {})
    assert store.records(rt) == []


def test_pruning_keeps_newest_committed_per_sink(store: MetaStore, rt: str) -> None:
    gen = store.claim(rt, SINKS).generation
    for epoch in (1, 2, 3):
        store.put_open(rt, gen, epoch, 1, ["a", "b"], {})
        store.put_pending(rt, gen, epoch, 1, {"a": [], "b": []})
        store.put_committed(rt, gen, epoch, "a")
        if epoch < 3:
            store.put_committed(rt, gen, epoch, "b")
    store.put_open(rt, gen, 4, 1, ["a", "b"], {})
    assert _states(store, rt) == [
        ("b", 2, 1, EpochState.COMMITTED),  # b's high-water mark
        ("a", 3, 1, EpochState.COMMITTED),
        ("b", 3, 1, EpochState.PENDING),
        ("a", 4, 1, EpochState.OPEN),
        ("b", 4, 1, EpochState.OPEN),
    ]


def test_values_that_are_not_json_are_refused(store: MetaStore, rt: str) -> None:
    gen = store.claim(rt, SINKS).generation
    with pytest.raises(MetaStoreError, match="JSON"):
        store.put_open(rt, gen, 1, 1, ["a"], {"when": object()})
    store.put_open(rt, gen, 1, 1, ["a"], {})
    with pytest.raises(MetaStoreError, match="JSON"):
        store.put_pending(rt, gen, 1, 1, {"a": [{"files": {"x"}}]})
    with pytest.raises(MetaStoreError, match="JSON"):
        store.bind_source(rt, gen, {"offset": float("nan")})
    assert _states(store, rt) == [("a", 1, 1, EpochState.OPEN)]


# --------------------------------------------------------------------------- fencing


_FENCED_WRITES: list[tuple[str, Callable[[MetaStore, str, int], None]]] = [
    ("bind_source", lambda s, rt, g: s.bind_source(rt, g, {"x": 1})),
    ("put_open", lambda s, rt, g: s.put_open(rt, g, 2, 1, ["a"], {})),
    ("put_pending", lambda s, rt, g: s.put_pending(rt, g, 1, 1, {"a": [], "b": []})),
    ("put_committed", lambda s, rt, g: s.put_committed(rt, g, 0, "a")),
    ("put_aborted", lambda s, rt, g: s.put_aborted(rt, g, 5, 1)),
    ("delete_aborted", lambda s, rt, g: s.delete_aborted(rt, g, 5)),
    ("set_sink_status", lambda s, rt, g: s.set_sink_status(rt, g, "a", "stalled", "x")),
]


def _snapshot(store: MetaStore, rt: str) -> tuple[Any, ...]:
    return store.load(rt), store.records(rt), store.sink_statuses(rt)


def test_old_generation_is_fenced_and_changes_nothing(backend: Backend, rt: str) -> None:
    old, new = backend.open(), backend.open()
    gen = old.claim(rt, SINKS).generation
    old.put_open(rt, gen, 0, 1, ["a"], {})
    old.put_pending(rt, gen, 0, 1, {"a": []})
    old.put_open(rt, gen, 1, 1, ["a", "b"], {})
    old.put_open(rt, gen, 5, 1, ["a"], {})
    old.put_aborted(rt, gen, 5, 1)
    old.set_sink_status(rt, gen, "a", "running")
    assert new.claim(rt, SINKS).generation == gen + 1
    before = _snapshot(new, rt)
    for name, write in _FENCED_WRITES:
        for stale in (gen, gen + 5):  # older, and one never claimed
            with pytest.raises(FencedError) as info:
                write(old, rt, stale)
            assert info.value.runtime == rt, name
    assert _snapshot(new, rt) == before
    for _, write in _FENCED_WRITES:  # the current generation may do all of it
        write(new, rt, gen + 1)


def test_unclaimed_runtime_write_is_metastore_error(store: MetaStore, rt: str) -> None:
    with pytest.raises(MetaStoreError, match="never claimed"):
        store.put_open(rt, 1, 1, 1, ["a"], {})


_CHILD = """
import json, sys
from raysink.coordinator.metastore import open_metastore
url, runtime = sys.argv[1], sys.argv[2]
store = open_metastore(url, runtime)
generation = store.claim(runtime, {"a": "parquet"}).generation
print(json.dumps({"generation": generation}), flush=True)
sys.stdin.readline()
try:
    store.put_open(runtime, generation, 1, 1, ["a"], {})
    print(json.dumps({"error": None}), flush=True)
except Exception as exc:
    print(json.dumps({"error": type(exc).__name__, "message": str(exc)}), flush=True)
store.close()
"""


def test_fence_across_two_processes(backend: Backend, rt: str) -> None:
    """Process A claims, process B (this one) claims, A's next write is fenced."""
    child = subprocess.Popen([sys.executable, "-c", _CHILD, backend.url, rt],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdin is not None
        assert json.loads(child.stdout.readline()) == {"generation": 1}
        store = backend.open()
        assert store.claim(rt, {"a": "parquet"}).generation == 2
        child.stdin.write("go\n")
        child.stdin.flush()
        answer = json.loads(child.stdout.readline())
        assert child.wait(timeout=30) == 0
    finally:
        child.kill()
    assert answer["error"] == "FencedError", answer
    assert store.records(rt) == []
    store.put_open(rt, 2, 1, 1, ["a"], {})
    assert _states(store, rt) == [("a", 1, 1, EpochState.OPEN)]


# --------------------------------------------------------------------------- the lease

A_OWNER = {"host": "a", "pid": 1}
B_OWNER = {"host": "b", "pid": 2}


def test_the_lease_is_one_holders_until_it_expires_or_is_released(
        store: MetaStore, rt: str) -> None:
    """A takes the lease; B cannot while it lives; A renews it (same token, later end) and
    releases it; B takes it (a new token); a claim needs the lease; an expired lease nobody
    took is still its holder's; one taken over from a holder known gone (``replace``)."""
    assert store.lease(rt) is None
    first = store.acquire_lease(rt, "A", A_OWNER, 30.0)
    assert (first.holder, first.owner, first.token, first.live) == ("A", A_OWNER, 1, True)
    assert 29.0 < first.expires_at - first.now <= 30.0
    refused = store.acquire_lease(rt, "B", B_OWNER, 30.0)
    assert (refused.holder, refused.token, refused.expires_at) == ("A", 1, first.expires_at)
    renewed = store.acquire_lease(rt, "A", A_OWNER, 60.0)
    assert (renewed.holder, renewed.token) == ("A", 1)
    assert renewed.expires_at > first.expires_at
    store.claim(rt, SINKS, holder="A")
    with pytest.raises(RuntimeInUseError, match="pid 1 on host a until") as info:
        store.claim(rt, SINKS, holder="B")
    assert (info.value.holder, info.value.until) == (A_OWNER, renewed.expires_at)
    store.release_lease(rt, "B")  # not B's: nothing happens
    assert store.acquire_lease(rt, "B", B_OWNER, 30.0).holder == "A"
    store.release_lease(rt, "A")
    store.release_lease(rt, "A")  # idempotent
    released = store.lease(rt)
    assert released is not None and not released.live
    second = store.acquire_lease(rt, "B", B_OWNER, 0.2)
    assert (second.holder, second.owner, second.token) == ("B", B_OWNER, 2)
    with pytest.raises(RuntimeInUseError, match="pid 2 on host b"):
        store.claim(rt, SINKS, holder="A")  # A lost it: no coordinator of A's may claim
    time.sleep(0.3)
    expired = store.lease(rt)
    assert expired is not None and not expired.live and expired.holder == "B"
    assert store.claim(rt, SINKS, holder="B").generation == 2  # expired, but nobody took it
    third = store.acquire_lease(rt, "C", A_OWNER, 30.0)
    assert (third.holder, third.token) == ("C", 3)
    fourth = store.acquire_lease(rt, "D", B_OWNER, 30.0, replace="C")
    assert (fourth.holder, fourth.token) == ("D", 4)
    loaded = store.load(rt)
    assert loaded is not None and loaded.generation == 2  # leases never change generations


def test_a_lease_race_has_one_winner(backend: Backend, rt: str) -> None:
    """Eight stores (connections) take the lease at once: exactly one holds it."""
    stores = [backend.open() for _ in range(8)]
    gate = threading.Barrier(len(stores))

    def take(index: int) -> str:
        gate.wait()
        return stores[index].acquire_lease(rt, f"h{index}", {"pid": index}, 30.0).holder

    with ThreadPoolExecutor(len(stores)) as pool:
        holders = set(pool.map(take, range(len(stores))))
    assert len(holders) == 1


def test_a_store_from_before_the_lease_table_is_brought_up_to_date(
        backend: Backend, store: MetaStore, rt: str) -> None:
    assert store.claim(rt, SINKS).generation == 1
    store.close()
    # a build from before raysink 0.1.0: no schema version (version 1), no lease table
    backend.raw("DROP TABLE raysink_leases", ())
    backend.raw("DROP TABLE raysink_schema", ())
    reopened = backend.open()
    assert reopened.lease(rt) is None
    assert reopened.acquire_lease(rt, "A", A_OWNER, 30.0).holder == "A"
    assert reopened.claim(rt, SINKS, holder="A").generation == 2


# --------------------------------------------------------------------------- status, isolation


def test_status_history_is_bounded(store: MetaStore, rt: str) -> None:
    gen = store.claim(rt, SINKS).generation
    store.set_sink_status(rt, gen, "a", "starting")
    store.set_sink_status(rt, gen, "a", "starting")  # no change of state: no entry
    assert len(store.sink_statuses(rt)["a"].history) == 1
    for i in range(HISTORY_LIMIT + 5):
        store.set_sink_status(rt, gen, "a", "stalled" if i % 2 else "running",
                              f"boom {i}" if i % 2 else None)
    status = store.sink_statuses(rt)["a"]
    assert len(status.history) == HISTORY_LIMIT
    assert (status.state, status.last_error) == ("running", None)
    assert [h["state"] for h in status.history[-2:]] == ["stalled", "running"]
    assert status.history[-2]["error"] == f"boom {HISTORY_LIMIT + 3}"
    store.set_sink_status(rt, gen, "a", "running", "still retrying")
    status = store.sink_statuses(rt)["a"]
    assert status.last_error == "still retrying" and len(status.history) == HISTORY_LIMIT


def test_many_runtimes_in_one_store_are_independent(backend: Backend, rt: str) -> None:
    store = backend.open()
    other = rt + "-other"
    g1 = store.claim(rt, SINKS).generation
    g2 = store.claim(other, {"z": "iceberg"}).generation
    store.claim(other, {"z": "iceberg"})  # fences only `other`
    store.put_open(rt, g1, 1, 1, ["a"], {})
    store.set_sink_status(rt, g1, "a", "running")
    with pytest.raises(FencedError):
        store.put_open(other, g2, 1, 1, ["z"], {})
    assert store.records(other) == [] and store.sink_statuses(other) == {}
    assert _states(store, rt) == [("a", 1, 1, EpochState.OPEN)]
    assert set(store.sink_statuses(rt)) == {"a"}


# --------------------------------------------------------------------------- corruption


@pytest.mark.parametrize(("sql", "params", "read"), [
    # an epoch row's layout is not JSON
    ("UPDATE raysink_epochs SET layout = ? WHERE runtime = ?", ("{not json",), "records"),
    # manifests decode, but to the wrong shape
    ("UPDATE raysink_epochs SET manifests = ? WHERE runtime = ?", ('{"a": 1}',), "records"),
    # the runtime's sink set is garbage
    ("UPDATE raysink_runtimes SET sinks = ? WHERE name = ?", ("garbage{",), "load"),
    # a status history is not JSON
    ("UPDATE raysink_sink_status SET history = ? WHERE runtime = ?", ("[{",), "statuses"),
])
def test_corrupt_row_is_metastore_error(backend: Backend, rt: str, sql: str,
                                        params: tuple[Any, ...], read: str) -> None:
    store = backend.open()
    gen = store.claim(rt, SINKS).generation
    store.put_open(rt, gen, 7, 1, ["a"], {"w": 1})
    store.put_pending(rt, gen, 7, 1, {"a": [{"rows": 1}]})
    store.set_sink_status(rt, gen, "a", "running")
    backend.raw(sql, (*params, rt))
    readers: dict[str, Callable[[], object]] = {
        "records": lambda: store.records(rt), "load": lambda: store.load(rt),
        "statuses": lambda: store.sink_statuses(rt)}
    with pytest.raises(MetaStoreError, match="corrupt: repair or delete") as info:
        readers[read]()
    assert info.value.runtime == rt
    if read == "records":
        assert (info.value.sink, info.value.epoch) == ("a", 7)


# --------------------------------------------------------------------------- SQLite


def test_sqlite_path_under_a_regular_file_is_metastore_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(MetaStoreError, match="writable directory") as info:
        SqliteMetaStore(blocker / "sub" / "store.db")
    assert str(blocker) in str(info.value)
    with pytest.raises(MetaStoreError, match=str(blocker)):
        open_metastore(f"sqlite:///{blocker}/store.db", "rt")


@pytest.mark.parametrize("make", [
    lambda p: p.mkdir(),                         # the path is a directory
    lambda p: p.write_bytes(b"x" * 4096),        # the path is not a SQLite file
])
def test_sqlite_path_that_is_not_a_database(tmp_path: Path,
                                            make: Callable[[Path], Any]) -> None:
    path = tmp_path / "store.db"
    make(path)
    with pytest.raises(MetaStoreError, match="cannot open meta store"):
        SqliteMetaStore(path)


def test_sqlite_is_wal_creates_parent_and_reopens(tmp_path: Path, rt: str) -> None:
    path = tmp_path / "a" / "b" / "m.db"
    store = SqliteMetaStore(path)
    assert store.url == f"sqlite:///{path}" and store.url.startswith("sqlite:////")
    with sqlite3.connect(path) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    store.claim(rt, SINKS)
    store.close()
    store.close()  # idempotent
    assert store.claim(rt, SINKS).generation == 2  # reopens on use
    store.close()


# --------------------------------------------------------------------------- open_metastore


def test_open_metastore_default_is_sqlite_under_cwd(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    store = open_metastore(None, "job")
    try:
        assert store.url == f"sqlite:///{tmp_path}/.raysink/job.db" == default_url("job")
        assert (tmp_path / ".raysink" / "job.db").is_file()
    finally:
        store.close()


@pytest.mark.parametrize("url", [
    "mysql://u:hunter22@h/db",            # unknown scheme
    "sqlite:///relative.db",              # not absolute
    "sqlite://host/abs.db",               # a host
    "sqlite:////abs.db?mode=ro",          # options
    "/just/a/path.db",                    # no scheme
])
def test_open_metastore_refuses_other_forms(url: str) -> None:
    with pytest.raises(ConfigError, match=re.escape("sqlite:////abs/path.db")) as info:
        open_metastore(url, "rt")
    assert "hunter22" not in str(info.value)


@pytest.mark.parametrize("runtime", ["", "..", "a/b"])
def test_default_url_refuses_unsafe_runtime_names(runtime: str) -> None:
    with pytest.raises(ConfigError):
        default_url(runtime)


@pytest.mark.parametrize(("url", "expected"), [
    ("postgresql://u:pw@h:5432/db", "postgresql://u:***@h:5432/db"),
    ("postgres://u@h/db", "postgres://u@h/db"),
    ("postgresql://h/db?password=pw&sslmode=require",
     "postgresql://h/db?password=***&sslmode=require"),
    ("host=h password='p w' user=u", "host=h password=*** user=u"),
    ("sqlite:////x/y.db", "sqlite:////x/y.db"),
])
def test_redact_url(url: str, expected: str) -> None:
    assert redact_url(url) == expected


def test_missing_psycopg_is_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "psycopg", None)
    with pytest.raises(ConfigError, match=r"pip install 'raysink\[postgres\]'"):
        open_metastore("postgresql://u:pw@127.0.0.1:1/db", "rt")


# --------------------------------------------------------------------------- PostgreSQL


def test_postgres_password_never_shown(pg_server: PostgresServer, rt: str) -> None:
    password = pg_server.password("raysink")
    store = PostgresMetaStore(pg_server.dsn())
    try:
        assert password not in store.url and "***" in store.url
        assert password not in repr(store)
        store.claim(rt, SINKS)
        store.claim(rt, SINKS)
        with pytest.raises(FencedError) as fenced:
            store.put_open(rt, 1, 1, 1, ["a"], {})
        assert password not in str(fenced.value)
    finally:
        store.close()
    wrong = pg_server.dsn(password=password + "-wrong")
    unreachable = f"postgresql://raysink:{password}@127.0.0.1:1/raysink"
    for dsn in (wrong, unreachable, pg_server.dsn().replace("postgresql", "postgres", 1)
                + "x"):
        with pytest.raises(MetaStoreError) as info:
            open_metastore(dsn, rt)
        assert password not in str(info.value) and password not in repr(info.value)
        assert "***" in str(info.value)


def test_postgres_without_privileges_is_metastore_error(pg_server: PostgresServer) -> None:
    PostgresMetaStore(pg_server.dsn()).close()  # the tables exist, owned by raysink
    with pytest.raises(MetaStoreError, match=r"permission denied|grant"):
        store = PostgresMetaStore(pg_server.dsn(user="reader"))
        try:
            store.load("rt")
        finally:
            store.close()


def test_postgres_survives_a_crash_restart(pg_server: PostgresServer, rt: str) -> None:
    store = PostgresMetaStore(pg_server.dsn())
    try:
        gen = store.claim(rt, SINKS).generation
        store.put_open(rt, gen, 1, 1, ["a"], {})
        store.put_pending(rt, gen, 1, 1, {"a": [{"rows": 5}]})
        pg_server.restart(mode="immediate")
        try:
            records = store.records(rt)
        except MetaStoreError:  # the broken connection fails once, then reconnects
            records = store.records(rt)
        assert [(r.state, r.manifests) for r in records] == [
            (EpochState.PENDING, [{"rows": 5}])]
        store.put_committed(rt, gen, 1, "a")
    finally:
        store.close()
