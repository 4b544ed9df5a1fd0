"""The coordinator's state machine without Ray: the epoch rules, 2PC, recovery, fencing."""

from __future__ import annotations

import pyarrow as pa
import pytest

from raysink.coordinator.epochs import EpochCoordinator, Resolution, StaleAttemptError
from raysink.coordinator.metastore.base import EpochState
from raysink.coordinator.vnodes import assign
from raysink.errors import (
    BackpressureError,
    DataLossError,
    EpochRegressionError,
    FencedError,
)
from raysink.testing import InMemoryMetaStore
from tests.unit.memsink import MemorySink, MemoryTarget

RUNTIME = "rt"
WRITERS = 2


class Harness:
    """A coordinator over two memory sinks, with what survives a crash kept outside it."""

    def __init__(self, sinks: tuple[str, ...] = ("a", "b"), max_pending: int = 2) -> None:
        self.store = InMemoryMetaStore()
        self.targets = {name: MemoryTarget() for name in sinks}
        self.max_pending = max_pending
        self.core = self.boot()

    def boot(self) -> EpochCoordinator:
        sinks = {n: MemorySink(t).bind(RUNTIME, n) for n, t in self.targets.items()}
        record = self.store.claim(RUNTIME, {n: "memory" for n in sinks})
        core = EpochCoordinator(runtime=RUNTIME, store=self.store, sinks=sinks,
                                generation=record.generation,
                                bitmaps={n: assign(WRITERS) for n in sinks},
                                max_pending_epochs=self.max_pending)
        core.recover()
        return core

    def crash(self) -> None:
        self.core = self.boot()

    def precommit_all(self, epoch: int, attempt: int, rows: int = 3) -> bool:
        done = False
        for name, sink in self.core.sinks.items():
            for writer_id in range(WRITERS):
                writer = sink.create_writer(writer_id)
                values = [epoch * 1000 + writer_id * 100 + i for i in range(rows)]
                writer.write(pa.record_batch({"v": values}))
                manifest = writer.pre_commit(epoch, attempt)
                done = self.core.commit_request(sink=name, writer_id=writer_id, epoch=epoch,
                                                attempt=attempt, manifest=manifest)
        return done

    def commit_all(self) -> None:
        while (step := self.core.next_commit()) is not None:
            self.core.commit_sink(*step)

    def write_epoch(self, epoch: int | None = None) -> int:
        decision = self.core.open_epoch(epoch)
        assert not decision.skip
        assert self.precommit_all(decision.epoch, decision.attempt)
        self.commit_all()
        return decision.epoch


def test_epoch_commits_once_in_every_sink() -> None:
    h = Harness()
    assert h.write_epoch() == 1
    assert h.write_epoch() == 2
    for target in h.targets.values():
        assert sorted({e for e, _, _ in target.visible}) == [1, 2]
        assert len(target.visible) == 2 * WRITERS * 3
    assert h.core.last_committed == 2


@pytest.mark.parametrize(
    ("setup", "requested", "expected"),
    [
        # E is COMMITTED: skipped
        ("commit3", 3, "skip"),
        # E below the last COMMITTED (a gap that was never written): skipped
        ("commit3", 2, "skip"),
        # gaps are allowed
        ("commit3", 7, "open"),
        # epoch=None is last known + 1
        ("commit3", None, "open4"),
        # E is PENDING: wait for the roll-forward
        ("pending3", 3, "wait"),
        # new but below a PENDING epoch
        ("pending3", 2, "regression"),
    ],
)
def test_epoch_rules(setup: str, requested: int | None, expected: str) -> None:
    h = Harness()
    decision = h.core.open_epoch(3)
    assert h.precommit_all(3, decision.attempt)
    if setup == "commit3":
        h.commit_all()
    if expected == "regression":
        with pytest.raises(EpochRegressionError):
            h.core.open_epoch(requested)
        return
    decision = h.core.open_epoch(requested)
    if expected == "skip":
        assert decision.skip
    elif expected == "wait":
        assert decision.wait_roll_forward
    elif expected == "open4":
        assert (decision.epoch, decision.attempt) == (4, 0)
    else:
        assert decision.epoch == requested and not decision.skip


def test_retry_of_open_epoch_sweeps_and_takes_next_attempt() -> None:
    h = Harness()
    first = h.core.open_epoch(5)
    h.targets["a"].staged[(5, first.attempt, 0)] = [1, 2]
    second = h.core.open_epoch(5)
    assert second.attempt == first.attempt + 1
    assert (5, first.attempt, 0) not in h.targets["a"].staged
    with pytest.raises(StaleAttemptError):
        h.core.commit_request(sink="a", writer_id=0, epoch=5, attempt=first.attempt,
                              manifest={"attempt": first.attempt, "writer": 0})


def test_resolve_answers_from_the_meta_store() -> None:
    h = Harness()
    opened = h.core.open_epoch(1)
    assert h.core.resolve(1) is Resolution.ABORTED
    assert h.core.open_epoch(1).attempt == opened.attempt + 1
    assert h.precommit_all(1, opened.attempt + 1)
    assert h.core.resolve(1) is Resolution.ROLLING_FORWARD
    h.commit_all()
    assert h.core.resolve(1) is Resolution.COMMITTED


def test_overlapping_bitmaps_are_refused() -> None:
    h = Harness(sinks=("a",))
    d = h.core.open_epoch(1)
    h.core.commit_request(sink="a", writer_id=0, epoch=1, attempt=d.attempt,
                          manifest={"attempt": d.attempt, "writer": 0})
    with pytest.raises(ValueError):
        h.core.commit_request(sink="a", writer_id=0, epoch=1, attempt=d.attempt,
                              manifest={"attempt": d.attempt, "writer": 0})


def test_backpressure_bounds_outstanding_epochs() -> None:
    h = Harness(max_pending=2)
    for epoch in (1, 2):
        d = h.core.open_epoch(epoch)
        assert h.precommit_all(epoch, d.attempt)
    with pytest.raises(BackpressureError) as info:
        h.core.open_epoch(3)
    assert info.value.retry_after > 0
    h.commit_all()
    assert h.core.open_epoch(3).epoch == 3


@pytest.mark.parametrize(
    "crash_point",
    [
        # crash with the epoch OPEN: recovery aborts it, staging swept
        "open",
        # crash after PENDING, before any sink commit: recovery rolls it forward
        "pending",
        # crash after sink a committed, before b: b rolls forward, a is skipped by marker
        "half",
        # crash after the sink commit, before COMMITTED was recorded: marker says done
        "target_done",
    ],
)
def test_recovery_after_coordinator_crash(crash_point: str) -> None:
    h = Harness()
    h.write_epoch(1)
    d = h.core.open_epoch(2)
    if crash_point != "open":
        assert h.precommit_all(2, d.attempt)
    if crash_point == "half":
        h.core.commit_sink(2, "a")
    if crash_point == "target_done":
        for sink in h.core.sinks.values():
            entry_manifests = h.store.records(RUNTIME)
            manifests = next(r.manifests for r in entry_manifests
                         if r.epoch == 2 and r.sink == sink.name)
            sink.commit(2, manifests or [])
    h.crash()
    h.commit_all()
    expected = [1] if crash_point == "open" else [1, 2]
    for target in h.targets.values():
        assert sorted({e for e, _, _ in target.visible}) == expected
        assert len(target.visible) == len(expected) * WRITERS * 3
        assert not [k for k in target.staged if k[0] == 2]
    assert h.core.last_committed == expected[-1]


def test_old_generation_is_fenced() -> None:
    h = Harness()
    old = h.core
    h.crash()
    with pytest.raises(FencedError):
        old.open_epoch(1)


def test_commit_failures_leave_the_epoch_pending_until_it_succeeds() -> None:
    h = Harness()
    d = h.core.open_epoch(1)
    assert h.precommit_all(1, d.attempt)
    h.targets["a"].fail_commits = 2
    for _ in range(2):
        with pytest.raises(ConnectionError):
            h.core.commit_sink(1, "a")
        assert h.core.epoch_state(1) is EpochState.PENDING
    h.commit_all()
    assert h.core.last_committed == 1
    assert h.targets["a"].commits == 1


def test_commit_is_skipped_when_the_marker_is_there() -> None:
    h = Harness(sinks=("a",))
    d = h.core.open_epoch(1)
    assert h.precommit_all(1, d.attempt)
    h.targets["a"].marker = 1
    outcome = h.core.commit_sink(1, "a")
    assert outcome.skipped
    assert h.core.skipped_sinks(1) == () or h.core.last_committed == 1


def test_deleted_marker_while_pending_is_data_loss() -> None:
    h = Harness(sinks=("a",))
    h.write_epoch(1)
    d = h.core.open_epoch(2)
    assert h.precommit_all(2, d.attempt)
    h.targets["a"].marker = None
    with pytest.raises(DataLossError):
        h.core.commit_sink(2, "a")


def test_deleted_marker_without_pending_is_recreated() -> None:
    h = Harness(sinks=("a",))
    h.write_epoch(1)
    h.targets["a"].marker = None
    recreated: list[int] = []
    sink = h.core.sinks["a"]
    sink.recreate_marker = recreated.append  # type: ignore[method-assign]
    h.core.check_markers()
    assert recreated == [1]


def test_empty_epoch_before_the_target_exists_is_committed_without_a_marker() -> None:
    """An empty first epoch nobody saw a schema for cannot create the target, so it
    leaves no marker; neither the next epoch nor a recovery may read that as a loss."""
    h = Harness(sinks=("a",))
    target = h.targets["a"]
    target.exists = False
    d = h.core.open_epoch(1)
    assert h.precommit_all(1, d.attempt, rows=0)
    h.commit_all()
    assert h.core.last_committed == 1 and target.marker is None and not target.exists
    assert [r.marked for r in h.store.records(RUNTIME)] == [False]
    h.crash()
    h.core.check_markers()  # no target, no marker, and none was ever expected
    assert h.write_epoch(2) == 2
    assert target.exists and target.marker == 2
    assert sorted({e for e, _, _ in target.visible}) == [2]
    h.crash()
    h.core.check_markers()
    target.exists, target.marker = False, None  # now the target is lost for real
    with pytest.raises(DataLossError):
        h.core.check_markers()
