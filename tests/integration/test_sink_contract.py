"""The sink contract of ``raysink/sinks/base.py``: one table of cases run over every sink.

Sinks are driven by hand as the writer actors and the coordinator drive them
(``create_writer``, ``open``, ``write``, ``pre_commit``, ``commit``/``abort``); targets are
read back, and leftovers of staging looked up, in the target itself (``real_targets``).
Cases one sink alone has (layouts, upserts, privileges, concurrent committers) stay in
that sink's test module.
"""

from __future__ import annotations

import hashlib
import json
import pickle
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from raysink.errors import DataLossError, NewerVersionError
from raysink.sinks.base import CommitResult, Manifest, Sink
from raysink.testing import InjectedFault, arm_fault, fired
from tests.integration.real_targets import (
    PostgresTarget,
    Target,
    make_target,
)

pytestmark = pytest.mark.timeout(120)

KINDS = ["parquet", "delta", "iceberg", "postgres-prepared", "postgres-staging", "list"]
# Where sinks differ, on purpose or as they are today:
# a crash inside commit shows nothing of the epoch (Parquet moves files before its log
# entry; "prepared" commits writer by writer)
ATOMIC_COMMIT = {"delta", "iceberg", "postgres-staging", "list"}
# abort with manifests drops every attempt of the epoch ("staging" deletes by epoch)
ABORT_SWEEPS_EPOCH = {"postgres-staging"}
# recreate_marker refuses a deleted target itself (the coordinator checks target_exists()
# first, for every sink)
REFUSE_MARKER_WITHOUT_TARGET = {"parquet", "delta", "iceberg"}


@dataclass
class Rig:
    kind: str
    sink: Sink
    target: Target
    root: Path  # the file-based targets live under it

    def stage(self, epoch: int, attempt: int, rows: Sequence[Sequence[int]]) -> list[Manifest]:
        """One writer per entry of ``rows``: open, write its ids (if any), pre-commit,
        close; the manifests come back through JSON, as from the meta store."""
        manifests = []
        for writer_id, ids in enumerate(rows):
            writer = self.sink.create_writer(writer_id)
            writer.open()
            if ids:
                writer.write(_batch(ids))
            manifests.append(writer.pre_commit(epoch, attempt))
            writer.close()
        result: list[Manifest] = json.loads(json.dumps(manifests))
        return result

    def ids(self) -> list[int]:
        return sorted(self.target.ids())

    def state(self) -> tuple[Any, ...]:
        """What a no-op leaves as it was: rows, marker, the commits carrying the marker, and
        every file under ``root`` with its content."""
        files = {str(p.relative_to(self.root)): hashlib.sha256(p.read_bytes()).hexdigest()
                 for p in sorted(self.root.rglob("*")) if p.is_file()}
        return (self.ids(), self.sink.committed_epoch(),
                self.target.commit_epochs(self.sink.runtime), files)

    def fresh(self) -> Sink:
        """Another instance of the sink, as a restarted coordinator holds it."""
        copy: Sink = pickle.loads(pickle.dumps(self.sink))
        return copy


def _batch(ids: Sequence[int]) -> pa.RecordBatch:
    return pa.record_batch({"id": pa.array(ids, pa.int64()),
                            "v": pa.array([f"v{i}" for i in ids], pa.string())})


def _close(sink: Sink) -> None:
    sink.close()  # PostgresSink keeps a coordinator connection


@pytest.fixture(params=KINDS)
def rig(request: pytest.FixtureRequest, tmp_path: Path, name: str,
        monkeypatch: pytest.MonkeyPatch) -> Iterator[Rig]:
    kind, root = str(request.param), tmp_path / "target"
    root.mkdir()
    target = make_target(kind, root, request, monkeypatch)
    options = {"method": kind.split("-")[1]} if kind.startswith("postgres") else {}
    sink = target.sink(**options).bind(name, "main")
    yield Rig(kind, sink, target, root)
    _close(sink)


# --------------------------------------------------------------------------- the cases


def commit_twice(r: Rig) -> None:
    manifests = r.stage(1, 0, [[1, 2], [3]])
    assert r.sink.commit(1, manifests) is CommitResult.COMMITTED
    assert r.target.staged(manifests) == []
    before = r.state()
    assert r.sink.commit(1, manifests) is CommitResult.ALREADY
    fresh = r.fresh()
    assert fresh.commit(1, manifests) is CommitResult.ALREADY
    _close(fresh)
    assert r.state() == before
    r.sink.commit(2, r.stage(2, 0, [[4]]))
    after_two = r.state()
    assert r.sink.commit(1, manifests) is CommitResult.ALREADY  # older, after a newer one
    assert r.state() == after_two and r.ids() == [1, 2, 3, 4]


def marker(r: Rig) -> None:
    assert r.sink.committed_epoch() is None
    manifests = r.stage(0, 0, [[1]])
    assert r.sink.committed_epoch() is None  # pre-committed is not committed
    r.sink.commit(0, manifests)
    assert r.sink.committed_epoch() == 0  # 0 is a marker, not "nothing"
    r.sink.commit(5, r.stage(5, 0, [[2]]))  # epochs may leave gaps
    fresh = r.fresh()
    assert r.sink.committed_epoch() == fresh.committed_epoch() == 5  # read from the target
    _close(fresh)


def empty_epoch(r: Rig) -> None:
    if r.sink.commit(1, r.stage(1, 0, [[], []])) is CommitResult.NO_TARGET:
        # no target, and no schema to create it from: nothing written, not even the marker
        assert r.sink.committed_epoch() is None and not r.sink.target_exists()
    else:
        assert r.sink.committed_epoch() == 1 and r.ids() == []
    r.sink.commit(2, r.stage(2, 0, [[1, 2]]))
    r.sink.commit(3, r.stage(3, 0, [[], []]))
    assert r.sink.committed_epoch() == 3
    r.sink.commit(4, [])  # no manifests at all is an empty epoch too
    assert r.sink.committed_epoch() == 4 and r.ids() == [1, 2]


def staged_is_invisible(r: Rig) -> None:
    r.sink.commit(1, r.stage(1, 0, [[1]]))
    writer = r.sink.create_writer(0)
    writer.open()
    writer.write(_batch([2, 3]))
    writer.flush()
    assert r.ids() == [1]  # written and flushed
    manifest = writer.pre_commit(2, 0)
    assert r.ids() == [1] and r.sink.committed_epoch() == 1  # durable, still invisible
    writer.close()
    r.sink.commit(2, [manifest])
    assert r.ids() == [1, 2, 3]


def abort_twice(r: Rig) -> None:
    manifests = r.stage(1, 0, [[1, 2], [3]])
    r.sink.abort(1, manifests)
    r.sink.abort(1, manifests)
    assert r.target.staged(manifests) == []
    assert r.ids() == [] and r.sink.committed_epoch() is None


def abort_keeps_what_is_committed(r: Rig) -> None:
    first = r.stage(1, 0, [[1], [2]])
    r.sink.commit(1, first)
    second = r.stage(2, 0, [[3], [4]])
    r.sink.abort(2, second)
    assert r.target.staged(second) == []
    assert r.ids() == [1, 2] and r.sink.committed_epoch() == 1
    before = r.state()
    r.sink.abort(1, first)  # a committed epoch: nothing of it goes
    r.sink.abort(1, None)
    assert r.state() == before


def abort_keeps_other_attempts(r: Rig) -> None:
    listed, other = r.stage(2, 0, [[1], []]), r.stage(2, 1, [[], [2]])
    r.sink.abort(2, listed)
    assert r.target.staged(listed) == []
    if r.kind in ABORT_SWEEPS_EPOCH:
        assert r.target.staged(other) == []
        return
    r.sink.commit(2, other)
    assert r.ids() == [2]


def abort_none_sweeps_its_epoch(r: Rig) -> None:
    # other writers per attempt: one writer's next attempt starts after its rollback
    # (in "prepared" its progress row waits on the earlier prepared transaction)
    attempts = r.stage(3, 0, [[1], []]) + r.stage(3, 1, [[], [3]])
    later = r.stage(4, 0, [[4]])
    r.sink.abort(3, None)
    r.sink.abort(3, None)
    assert r.target.staged(attempts) == [] and r.target.staged(later) != []
    r.sink.commit(4, later)
    assert r.ids() == [4] and r.sink.committed_epoch() == 4


def rollback(r: Rig) -> None:
    writer = r.sink.create_writer(0)
    writer.open()
    writer.write(_batch([1]))
    staged = writer.pre_commit(1, 0)
    writer.rollback(1, 0)
    writer.rollback(1, 0)
    assert r.target.staged([json.loads(json.dumps(staged))]) == []
    writer.write(_batch([2]))
    writer.flush()
    writer.rollback(1, 1)  # never pre-committed: the flushed rows go too
    writer.write(_batch([3]))
    manifest = writer.pre_commit(1, 2)
    writer.close()
    r.sink.commit(1, [manifest])
    assert r.ids() == [3]


def commit_after_an_aborted_attempt(r: Rig) -> None:
    first = r.stage(1, 0, [[1, 2], [3]])
    r.sink.abort(1, first)
    retry = r.stage(1, 1, [[10], [11]])
    r.sink.commit(1, retry)
    assert r.ids() == [10, 11] and r.sink.committed_epoch() == 1
    assert r.target.staged(first + retry) == []


def crash_inside_commit(r: Rig) -> None:
    r.sink.commit(1, r.stage(1, 0, [[1]]))
    manifests = r.stage(2, 0, [[2, 3], [4]])
    arm_fault(r.sink.runtime, "sink.mid_commit", action="raise", when={"epoch": 2})
    with pytest.raises(InjectedFault):
        r.sink.commit(2, manifests)
    assert fired(r.sink.runtime, "sink.mid_commit") and r.sink.committed_epoch() == 1
    if r.kind in ATOMIC_COMMIT:
        assert r.ids() == [1]
    r.sink.commit(2, manifests)  # the roll-forward
    assert r.ids() == [1, 2, 3, 4] and r.sink.committed_epoch() == 2
    assert r.target.commit_epochs(r.sink.runtime) == [1, 2]


def deleted_target(r: Rig) -> None:
    assert not r.sink.target_exists()
    r.sink.commit(1, r.stage(1, 0, [[1]]))
    assert r.sink.target_exists()
    r.target.delete()
    assert not r.sink.target_exists()
    if not r.kind.startswith("postgres"):  # PostgreSQL keeps markers in a table of their own
        assert r.sink.committed_epoch() is None
    if r.kind in REFUSE_MARKER_WITHOUT_TARGET:
        with pytest.raises(DataLossError):
            r.sink.recreate_marker(1)


def _marker_written_by_a_newer_raysink(r: Rig, epoch: int) -> None:
    """Commit ``epoch`` as a raysink whose marker format is one above this one's."""
    from psycopg import sql

    from raysink.sinks import _format

    newer = _format.MARKER_FORMAT + 1
    writes = {"parquet": "raysink.sinks.parquet._log", "delta": "raysink.sinks.delta._sink",
              "iceberg": "raysink.sinks.iceberg._sink"}
    with pytest.MonkeyPatch.context() as patch:
        if r.kind in writes:
            patch.setattr(f"{writes[r.kind]}.MARKER_FORMAT", newer)
        assert r.sink.commit(epoch, r.stage(epoch, 0, [[epoch * 10]])) is \
            CommitResult.COMMITTED
    if r.kind.startswith("postgres"):  # its progress rows' format column
        assert isinstance(r.target, PostgresTarget)
        r.target.pg.execute(sql.SQL("UPDATE {} SET format = %s WHERE epoch = %s").format(
            sql.Identifier(r.target.schema, "_raysink_progress")).as_string(None),
            (newer, epoch), dbname="raysink")


def marker_format(r: Rig) -> None:
    assert r.sink.commit(1, r.stage(1, 0, [[1]])) is CommitResult.COMMITTED
    assert r.sink.committed_epoch() == 1
    if r.kind == "list":  # a test sink: no marker format
        return
    _marker_written_by_a_newer_raysink(r, 2)
    fresh = r.fresh()
    with pytest.raises(NewerVersionError, match="format") as info:
        fresh.committed_epoch()
    _close(fresh)
    assert (info.value.what, info.value.sink) == ("marker", "main")


CASES: list[Callable[[Rig], None]] = [
    # commit is idempotent: again, from a fresh instance, and an older epoch after a newer
    commit_twice,
    # committed_epoch: None, then the highest epoch committed (0 included, gaps allowed)
    marker,
    # an epoch without rows moves the marker and adds nothing (before any table it may
    # return False and write nothing)
    empty_epoch,
    # written, flushed and pre-committed rows are invisible until commit
    staged_is_invisible,
    # abort is idempotent and leaves nothing staged or visible, and no marker
    abort_twice,
    # aborting an attempt on a live target removes that attempt only
    abort_keeps_what_is_committed,
    # abort with manifests removes those, not another attempt's (see ABORT_SWEEPS_EPOCH)
    abort_keeps_other_attempts,
    # abort(None) sweeps every attempt of its epoch and no other epoch
    abort_none_sweeps_its_epoch,
    # a writer's rollback drops its staged attempt (and unstaged rows); it writes on after
    rollback,
    # a retry of an aborted epoch commits its own rows only
    commit_after_an_aborted_attempt,
    # a crash inside commit leaves the marker where it was; the re-run commits once
    crash_inside_commit,
    # target_exists(): False before the first rows and after the target is deleted
    deleted_target,
    # the marker carries its format: a newer raysink's is refused when read
    marker_format,
]


@pytest.mark.parametrize("case", CASES, ids=[c.__name__ for c in CASES])
def test_contract(case: Callable[[Rig], None], rig: Rig) -> None:
    case(rig)
