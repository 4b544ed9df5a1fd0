"""A ``hypothesis.stateful`` model of the coordinator.

Random interleavings of opens, writer pre-commits (each writer's commit request), resolves,
sink commits that fail or succeed, and coordinator crashes with restarts. Invariants after
every step: an epoch is visible in a sink at most once, and only from the attempt that was
decided (went PENDING); nothing of an aborted attempt is ever visible. At the end, after
draining the commits, every decided epoch is visible exactly once in every sink.

The model runs over the in-memory meta store and over the SQLite one, whose file is
opened again at every crash (what survives is what reached the file).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from raysink.coordinator.epochs import Resolution, StaleAttemptError
from raysink.coordinator.metastore import SqliteMetaStore
from raysink.coordinator.metastore.base import MetaStore
from raysink.errors import BackpressureError, EpochRegressionError
from tests.unit.test_epochs import WRITERS, Harness, commit_sink

SINKS = ("a", "b")


class CoordinatorModel(RuleBasedStateMachine):
    def __init__(self, open_store: Callable[[], MetaStore] | None = None) -> None:
        super().__init__()
        self.h = Harness(sinks=SINKS, max_pending=3, open_store=open_store)
        self.current: tuple[int, int] | None = None
        self.requested: set[tuple[str, int]] = set()
        self.decided: dict[int, int] = {}

    @rule(gap=st.integers(min_value=0, max_value=2), explicit=st.booleans())
    def open_epoch(self, gap: int, explicit: bool) -> None:
        last = max([*self.decided, self.h.core.last_committed or 0, 0])
        requested = last + 1 + gap if explicit else None
        try:
            decision = self.h.core.open_epoch(requested)
        except (BackpressureError, EpochRegressionError):
            return
        if decision.skip or decision.wait_roll_forward:
            return
        self.current = (decision.epoch, decision.attempt)
        self.requested = set()

    @precondition(lambda self: self.current is not None)
    @rule(sink=st.sampled_from(SINKS), writer_id=st.integers(0, WRITERS - 1),
          rows=st.integers(0, 3))
    def pre_commit(self, sink: str, writer_id: int, rows: int) -> None:
        assert self.current is not None
        epoch, attempt = self.current
        if (sink, writer_id) in self.requested:
            return
        writer = self.h.core.sinks[sink].create_writer(writer_id)
        if rows:
            writer.write(pa.record_batch({"v": list(range(rows))}))
        manifest = writer.pre_commit(epoch, attempt)
        try:
            done = self.h.core.commit_request(sink=sink, writer_id=writer_id, epoch=epoch,
                                              attempt=attempt, manifest=manifest)
        except StaleAttemptError:
            self.current = None
            return
        self.requested.add((sink, writer_id))
        if done:
            self.decided[epoch] = attempt
            self.current = None

    @precondition(lambda self: self.current is not None)
    @rule(rows=st.integers(0, 2))
    def pre_commit_remaining(self, rows: int) -> None:
        """Every writer that has not pre-committed does so now (the common path)."""
        for sink in SINKS:
            for writer_id in range(WRITERS):
                if self.current is not None:
                    self.pre_commit(sink, writer_id, rows)

    @precondition(lambda self: self.current is not None)
    @rule()
    def resolve_current(self) -> None:
        assert self.current is not None
        resolution = self.h.core.resolve(self.current[0])
        assert resolution is Resolution.ABORTED
        self.current = None

    @rule(fail=st.booleans(), sink=st.sampled_from(SINKS))
    def commit_step(self, fail: bool, sink: str) -> None:
        step = self.h.core.next_commit(sink)
        if step is None:
            return
        if fail:
            self.h.targets[sink].fail_commits = 1
        try:
            commit_sink(self.h.core, step.epoch, sink)
        except ConnectionError:
            self.h.targets[sink].fail_commits = 0

    @rule()
    def crash(self) -> None:
        self.h.crash()
        self.current = None

    @invariant()
    def visible_at_most_once_and_only_decided(self) -> None:
        for target in self.h.targets.values():
            seen: dict[int, int] = {}
            for epoch, attempt, _ in target.visible:
                assert self.decided.get(epoch) == attempt, (epoch, attempt, self.decided)
                seen.setdefault(epoch, attempt)
                assert seen[epoch] == attempt
            commits = {e for e, _, _ in target.visible}
            assert len(commits) <= len(self.decided)

    def teardown(self) -> None:
        try:
            self.h.commit_all()
            for target in self.h.targets.values():
                assert {e for e, _, _ in target.visible} <= set(self.decided)
                assert target.commits == len(self.decided)
                assert not target.staged or all(k[0] not in self.decided for k in target.staged)
            for epoch in self.decided:
                assert self.h.core.resolve(epoch) is Resolution.COMMITTED
        finally:
            self.h.store.close()


@pytest.mark.parametrize(("store", "examples"), [
    # the in-memory store: many interleavings, cheap
    ("memory", 150),
    # SQLite in a temp dir (WAL, synchronous=FULL): fewer, each step syncs to disk
    ("sqlite", 20),
])
def test_coordinator_model(store: str, examples: int, tmp_path: Path) -> None:
    def machine() -> CoordinatorModel:
        if store == "memory":
            return CoordinatorModel()
        path = tmp_path / f"meta-{uuid.uuid4().hex[:8]}.db"  # a fresh store per example
        return CoordinatorModel(lambda: SqliteMetaStore(path))

    run_state_machine_as_test(machine, settings=settings(
        max_examples=examples, stateful_step_count=40, deadline=None))
