"""The sink contract of ``raysink/sinks/base.py``, one table of cases run over every sink.

Each sink is driven by hand, as the writer actors and the coordinator drive it:
``create_writer(k)``, ``open``, ``write``, ``pre_commit``, then ``commit``/``abort``. The
target is read back as its readers see it, and what is left staged is looked up in the
target itself (``tests/integration/real_targets.py``). Cases that hold for one sink only
(file layouts, upserts, schema evolution, privileges, concurrent committers) stay in that
sink's own test module.
"""

from __future__ import annotations

import hashlib
import json
import pickle
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from raysink.sinks.base import Manifest, Sink
from raysink.testing import InjectedFault, arm_fault, fired
from tests.integration.real_targets import (
    DeltaTarget,
    IcebergTarget,
    ListTarget,
    ParquetTarget,
    PostgresTarget,
    Target,
)

pytestmark = pytest.mark.timeout(120)

KINDS = ["parquet", "delta", "iceberg", "postgres-prepared", "postgres-staging", "list"]
# Sinks whose commit is one atomic step: a crash inside it shows nothing of the epoch.
# (Parquet moves files before its log entry; "prepared" commits writer by writer.)
ATOMIC_COMMIT = {"delta", "iceberg", "postgres-staging", "list"}
# Sinks whose abort with manifests still drops every attempt of the epoch ("staging"
# deletes the epoch's staged rows by epoch).
ABORT_SWEEPS_EPOCH = {"postgres-staging"}


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def target(kind: str, request: pytest.FixtureRequest, tmp_path: Path,
           monkeypatch: pytest.MonkeyPatch) -> Target:
    root = tmp_path / "target"
    root.mkdir()
    if kind == "iceberg":
        monkeypatch.chdir(root)  # the default catalog lives under <cwd>/.raysink
        return IcebergTarget(root)
    if kind.startswith("postgres"):
        return PostgresTarget(request.getfixturevalue("pg_server"),
                              request.getfixturevalue("schema"))
    return {"parquet": ParquetTarget, "delta": DeltaTarget, "list": ListTarget}[kind](
        root / "table")


@pytest.fixture
def sink(kind: str, target: Target, name: str) -> Iterator[Sink]:
    options = {"method": kind.split("-")[1]} if kind.startswith("postgres") else {}
    bound = target.sink(**options).bind(name, "main")
    yield bound
    _close(bound)


def _close(sink: Sink) -> None:
    close = getattr(sink, "close", None)  # PostgresSink keeps a coordinator connection
    if close is not None:
        close()


def _batch(ids: Sequence[int]) -> pa.RecordBatch:
    return pa.record_batch({"id": pa.array(ids, pa.int64()),
                            "v": pa.array([f"v{i}" for i in ids], pa.string())})


def _stage(sink: Sink, epoch: int, attempt: int,
           rows: Sequence[Sequence[int]]) -> list[Manifest]:
    """One writer per entry of ``rows``: open, write its ids (if any), pre-commit, close.
    The manifests come back through JSON, as from the meta store."""
    manifests = []
    for writer_id, ids in enumerate(rows):
        writer = sink.create_writer(writer_id)
        writer.open()
        if ids:
            writer.write(_batch(ids))
        manifests.append(writer.pre_commit(epoch, attempt))
        writer.close()
    result: list[Manifest] = json.loads(json.dumps(manifests))
    return result


def _state(target: Target, sink: Sink, root: Path) -> tuple[Any, ...]:
    """What a no-op must leave as it was: rows, marker, commits carrying the marker, and
    every file under ``root`` (the file-based targets live there) with its content."""
    files = {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
             for p in sorted(root.rglob("*")) if p.is_file()}
    return (sorted(target.ids()), sink.committed_epoch(),
            target.commit_epochs(sink.runtime), files)


def _fresh(sink: Sink) -> Sink:
    """Another instance of the sink, as a restarted coordinator holds it."""
    copy: Sink = pickle.loads(pickle.dumps(sink))
    return copy


# --------------------------------------------------------------------------- the cases


def commit_twice(sink: Sink, target: Target, root: Path, kind: str) -> None:
    manifests = _stage(sink, 1, 0, [[1, 2], [3]])
    sink.commit(1, manifests)
    assert target.staged(manifests) == []
    before = _state(target, sink, root)
    sink.commit(1, manifests)
    fresh = _fresh(sink)
    fresh.commit(1, manifests)
    _close(fresh)
    assert _state(target, sink, root) == before
    sink.commit(2, _stage(sink, 2, 0, [[4]]))
    after_two = _state(target, sink, root)
    sink.commit(1, manifests)  # an older epoch replayed after a newer one
    assert _state(target, sink, root) == after_two
    assert sorted(target.ids()) == [1, 2, 3, 4] and sink.committed_epoch() == 2


def marker(sink: Sink, target: Target, root: Path, kind: str) -> None:
    assert sink.committed_epoch() is None
    manifests = _stage(sink, 0, 0, [[1]])
    assert sink.committed_epoch() is None  # pre-committed is not committed
    sink.commit(0, manifests)
    assert sink.committed_epoch() == 0  # 0 is a marker, not "nothing"
    sink.commit(5, _stage(sink, 5, 0, [[2]]))  # epochs may leave gaps
    assert sink.committed_epoch() == 5
    fresh = _fresh(sink)
    assert fresh.committed_epoch() == 5  # read from the target, not remembered
    _close(fresh)


def empty_epoch(sink: Sink, target: Target, root: Path, kind: str) -> None:
    result = sink.commit(1, _stage(sink, 1, 0, [[], []]))
    if result is False:  # no target and no schema to create it from: nothing at all
        assert sink.committed_epoch() is None and not sink.target_exists()
    else:
        assert sink.committed_epoch() == 1 and target.ids() == []
    sink.commit(2, _stage(sink, 2, 0, [[1, 2]]))
    sink.commit(3, _stage(sink, 3, 0, [[], []]))
    assert sink.committed_epoch() == 3
    sink.commit(4, [])  # no manifests at all is an empty epoch too
    assert sink.committed_epoch() == 4 and sorted(target.ids()) == [1, 2]


def staged_is_invisible(sink: Sink, target: Target, root: Path, kind: str) -> None:
    sink.commit(1, _stage(sink, 1, 0, [[1]]))
    writer = sink.create_writer(0)
    writer.open()
    writer.write(_batch([2, 3]))
    writer.flush()
    assert target.ids() == [1]  # written and flushed
    manifest = writer.pre_commit(2, 0)
    assert target.ids() == [1] and sink.committed_epoch() == 1  # durable, still invisible
    writer.close()
    sink.commit(2, [manifest])
    assert sorted(target.ids()) == [1, 2, 3]


def abort_twice(sink: Sink, target: Target, root: Path, kind: str) -> None:
    manifests = _stage(sink, 1, 0, [[1, 2], [3]])
    sink.abort(1, manifests)
    sink.abort(1, manifests)
    assert target.staged(manifests) == []
    assert target.ids() == [] and sink.committed_epoch() is None


def abort_keeps_what_is_committed(sink: Sink, target: Target, root: Path, kind: str) -> None:
    first = _stage(sink, 1, 0, [[1], [2]])
    sink.commit(1, first)
    second = _stage(sink, 2, 0, [[3], [4]])
    sink.abort(2, second)
    assert target.staged(second) == []
    assert sorted(target.ids()) == [1, 2] and sink.committed_epoch() == 1
    before = _state(target, sink, root)
    sink.abort(1, first)  # a committed epoch: nothing of it is removed
    sink.abort(1, None)
    assert _state(target, sink, root) == before


def abort_keeps_other_attempts(sink: Sink, target: Target, root: Path, kind: str) -> None:
    listed = _stage(sink, 2, 0, [[1], []])
    other = _stage(sink, 2, 1, [[], [2]])
    sink.abort(2, listed)
    assert target.staged(listed) == []
    if kind in ABORT_SWEEPS_EPOCH:
        assert target.staged(other) == []
        return
    sink.commit(2, other)
    assert target.ids() == [2]


def abort_none_sweeps_its_epoch(sink: Sink, target: Target, root: Path, kind: str) -> None:
    # other writers per attempt: one writer's next attempt starts after its rollback
    # (in "prepared" its progress row waits on the earlier prepared transaction)
    attempts = _stage(sink, 3, 0, [[1], []]) + _stage(sink, 3, 1, [[], [3]])
    later = _stage(sink, 4, 0, [[4]])
    sink.abort(3, None)
    sink.abort(3, None)
    assert target.staged(attempts) == []
    assert target.staged(later) != []  # epoch 4 is untouched
    sink.commit(4, later)
    assert target.ids() == [4] and sink.committed_epoch() == 4


def rollback(sink: Sink, target: Target, root: Path, kind: str) -> None:
    writer = sink.create_writer(0)
    writer.open()
    writer.write(_batch([1]))
    staged = writer.pre_commit(1, 0)
    writer.rollback(1, 0)
    writer.rollback(1, 0)
    assert target.staged([json.loads(json.dumps(staged))]) == []
    writer.write(_batch([2]))
    writer.flush()
    writer.rollback(1, 1)  # never pre-committed: the flushed rows go too
    writer.write(_batch([3]))
    manifest = writer.pre_commit(1, 2)
    writer.close()
    sink.commit(1, [manifest])
    assert target.ids() == [3]


def commit_after_an_aborted_attempt(sink: Sink, target: Target, root: Path,
                                    kind: str) -> None:
    first = _stage(sink, 1, 0, [[1, 2], [3]])
    sink.abort(1, first)
    retry = _stage(sink, 1, 1, [[10], [11]])
    sink.commit(1, retry)
    assert sorted(target.ids()) == [10, 11] and sink.committed_epoch() == 1
    assert target.staged(first + retry) == []


def crash_inside_commit(sink: Sink, target: Target, root: Path, kind: str) -> None:
    sink.commit(1, _stage(sink, 1, 0, [[1]]))
    manifests = _stage(sink, 2, 0, [[2, 3], [4]])
    arm_fault(sink.runtime, "sink.mid_commit", action="raise", when={"epoch": 2})
    with pytest.raises(InjectedFault):
        sink.commit(2, manifests)
    assert fired(sink.runtime, "sink.mid_commit")
    assert sink.committed_epoch() == 1
    if kind in ATOMIC_COMMIT:
        assert target.ids() == [1]
    sink.commit(2, manifests)  # the roll-forward
    assert sorted(target.ids()) == [1, 2, 3, 4] and sink.committed_epoch() == 2
    assert target.commit_epochs(sink.runtime) == [1, 2]


Case = Callable[[Sink, Target, Path, str], None]
CASES: list[Case] = [
    # commit is idempotent: again, from a fresh instance, and an older epoch after a newer
    commit_twice,
    # committed_epoch: None, then the highest epoch committed (0 included, gaps allowed)
    marker,
    # an epoch without rows moves the marker and adds nothing; before any table it may
    # return False and write nothing
    empty_epoch,
    # written, flushed and pre-committed rows are invisible until commit
    staged_is_invisible,
    # abort is idempotent and leaves nothing staged or visible, and no marker
    abort_twice,
    # aborting an attempt on a live target removes it only; a committed epoch stays
    abort_keeps_what_is_committed,
    # abort with manifests removes those only, not another attempt's (but see
    # ABORT_SWEEPS_EPOCH)
    abort_keeps_other_attempts,
    # abort(None) sweeps every attempt of its epoch and no other epoch
    abort_none_sweeps_its_epoch,
    # a writer's rollback drops its staged attempt (and unstaged rows); it writes on after
    rollback,
    # a retry of an aborted epoch commits its own rows only
    commit_after_an_aborted_attempt,
    # a crash inside commit leaves the marker where it was; the re-run commits once
    crash_inside_commit,
]


@pytest.mark.parametrize("case", CASES, ids=[c.__name__ for c in CASES])
def test_contract(case: Case, sink: Sink, target: Target, kind: str, tmp_path: Path) -> None:
    case(sink, target, tmp_path / "target", kind)
