"""A ``hypothesis.stateful`` model of the coordinator.

Random interleavings of epochs opened first and epochs whose open travels with their
decision (the driver's next epoch), writer pre-commits (each writer stages its share and
hands its commit request to the driver), the driver's one ``gather`` of every request,
the PENDING record (a step of its own: a resolve or a crash may come between), resolves,
each sink's commits on its own (failing or not), coordinator crashes with restarts, and
rescales: the writer layout changed between epochs (``set_layout``; a restarted
coordinator gets the current one), refused while an epoch is open at the coordinator,
and, out of turn, while the driver feeds an epoch the coordinator does not know yet: its
requests then no longer match the layout and the attempt is given up, nothing visible.

The driver holds the runtime's lease: another driver's start is refused while it lives
(its coordinator may not claim); a driver killed and replaced by a successor that takes
its lease over leaves its coordinator behind as a zombie, whose commit of a decided epoch
may still reach a target (the same decision: it lands once) but whose every meta store
write is fenced, and whose driver can no longer claim a generation.

Writers report the schema they wrote: sink ``a`` (``schema_evolution="fail"``) one,
sink ``b`` (``"add_columns"``) one drawn from three (the old one, one adding a string
column, one adding it as an integer). A gather the schemas refuse gives the attempt up,
as the driver does with bad data.

Invariants after every step: an epoch is visible in a sink at most once, and only from
the attempt that was decided (went PENDING); nothing of an aborted attempt is ever
visible; the decided epochs of ``b`` all evolve one table (their union exists). At the
end, after a last crash, a recovery and every commit: every decided epoch is visible
exactly once in every sink, and nothing staged is left behind.

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

from raysink import _schema
from raysink.coordinator.epochs import Resolution
from raysink.coordinator.metastore import SqliteMetaStore
from raysink.coordinator.metastore.base import MetaStore
from raysink.errors import (
    BackpressureError,
    EpochRegressionError,
    FencedError,
    RaySinkError,
    RescaleRefusedError,
    RuntimeInUseError,
    SchemaMismatchError,
    StaleAttemptError,
)
from raysink.protocol.messages import CommitRequest
from raysink.protocol.vnodes import assign
from tests.unit.test_epochs import RUNTIME, Harness, commit_sink, with_schema

SINKS = ("a", "b")
MAX_WRITERS = 3
SCHEMAS = (pa.schema([("v", pa.int64())]),
           pa.schema([("v", pa.int64()), ("extra", pa.string())]),
           pa.schema([("v", pa.int64()), ("extra", pa.int64())]))


class CoordinatorModel(RuleBasedStateMachine):
    def __init__(self, open_store: Callable[[], MetaStore] | None = None) -> None:
        super().__init__()
        self.h = Harness(sinks=SINKS, max_pending=3, open_store=open_store,
                         evolution={"b": "add_columns"})
        self.current: tuple[int, int] | None = None
        self.requests: dict[tuple[str, int], CommitRequest] = {}
        self.complete: tuple[int, int] | None = None
        self.decided: dict[int, int] = {}
        self.generation: int | None = None
        # the schemas the writers of the gathered attempt reported; of b's decided epochs
        self.reported: dict[str, list[pa.Schema]] = {}
        self.carrying: set[str] = set()  # the gathered attempt's sinks with a manifest
        self.carried: dict[int, set[str]] = {}  # per decided epoch
        self.schemas: dict[str, list[pa.Schema]] = {"b": []}
        self.feeding = self.h.writers  # the writers of the attempt being fed
        self.misrouted = False  # a rescale reached the coordinator while it was fed

    def _start(self, epoch: int, attempt: int, generation: int | None = None) -> None:
        self.current, self.requests, self.generation = (epoch, attempt), {}, generation
        self.feeding, self.misrouted = self.h.writers, False

    @precondition(lambda self: self.current is None)
    @rule(gap=st.integers(min_value=0, max_value=2), explicit=st.booleans())
    def open_epoch(self, gap: int, explicit: bool) -> None:
        """An epoch opened before its data (OPEN recorded first)."""
        last = max([*self.decided, self.h.core.last_committed or 0, 0])
        requested = last + 1 + gap if explicit else None
        try:
            decision = self.h.core.open_epoch(requested)
        except (BackpressureError, EpochRegressionError):
            return
        if not (decision.skip or decision.wait_roll_forward):
            self._start(decision.epoch, decision.attempt)

    @precondition(lambda self: self.current is None and self.complete is None)
    @rule()
    def next_epoch(self) -> None:
        """The driver's next epoch, at the attempt the coordinator said it would open it
        with: its open travels with its decision."""
        epoch = max([*self.decided, self.h.core.last_committed or 0, 0]) + 1
        self._start(epoch, self.h.core.next_attempt(epoch), self.h.core.generation)

    @precondition(lambda self: self.current is not None)
    @rule(sink=st.sampled_from(SINKS), writer_id=st.integers(0, MAX_WRITERS - 1),
          rows=st.integers(0, 3), schema=st.sampled_from(SCHEMAS))
    def pre_commit(self, sink: str, writer_id: int, rows: int, schema: pa.Schema) -> None:
        assert self.current is not None
        epoch, attempt = self.current
        if (sink, writer_id) in self.requests or writer_id >= self.feeding:
            return
        writer = self.h.core.sinks[sink].create_writer(writer_id)
        if rows:
            writer.write(pa.record_batch({"v": list(range(rows))}))
        manifest = writer.pre_commit(epoch, attempt)
        self.requests[(sink, writer_id)] = with_schema(CommitRequest(
            sink=sink, writer=writer_id, epoch=epoch, attempt=attempt, manifest=manifest),
            schema if sink == "b" else SCHEMAS[0])

    @precondition(lambda self: self.current is not None
                  and len(self.requests) < len(SINKS) * self.feeding)
    @rule(rows=st.integers(0, 3), schemas=st.lists(st.sampled_from(SCHEMAS),
                                                   min_size=MAX_WRITERS,
                                                   max_size=MAX_WRITERS))
    def pre_commit_the_rest(self, rows: int, schemas: list[pa.Schema]) -> None:
        """Every writer without a request yet pre-commits (b's writer k reporting
        ``schemas[k]``): without this step a gather is rare in 40 random steps."""
        for sink in SINKS:
            for writer_id in range(self.feeding):
                self.pre_commit(sink, writer_id, rows, schemas[writer_id])

    @precondition(lambda self: self.current is not None)
    @rule(sink=st.sampled_from(SINKS), writer_id=st.integers(0, MAX_WRITERS - 1))
    def idle(self, sink: str, writer_id: int) -> None:
        """A writer that received nothing this attempt: no barrier, no staging; the driver
        answers for it."""
        assert self.current is not None
        epoch, attempt = self.current
        if writer_id >= self.feeding:
            return
        self.requests.setdefault((sink, writer_id), CommitRequest(
            sink=sink, writer=writer_id, epoch=epoch, attempt=attempt, manifest=None))

    @precondition(lambda self: self.current is not None
                  and len(self.requests) == len(SINKS) * self.feeding)
    @rule()
    def gather(self) -> None:
        """The driver hands the coordinator every writer's request at once."""
        assert self.current is not None
        epoch, attempt = self.current
        try:
            self.h.core.gather(epoch, attempt, list(self.requests.values()), self.generation)
        except (StaleAttemptError, BackpressureError, EpochRegressionError,
                SchemaMismatchError):
            self.h.core.resolve(epoch, attempt)  # the driver gives the attempt up
            self.current = None
            return
        except RaySinkError:
            # requests of the old layout after a rescale the coordinator took meanwhile
            assert self.misrouted
            self.h.core.resolve(epoch, attempt)
            self.current = None
            return
        self.complete, self.current = (epoch, attempt), None
        self.carrying = {sink for (sink, _), r in self.requests.items()
                         if r.manifest is not None}
        self.reported = {"b": [_schema.decode(r.schema) for r in self.requests.values()
                               if r.sink == "b" and r.schema is not None]}

    @precondition(lambda self: self.current is None and self.complete is None)
    @rule(writers=st.integers(1, MAX_WRITERS))
    def rescale(self, writers: int) -> None:
        """``rt.rescale``: between epochs, a new layout from the next epoch on."""
        try:
            self.h.core.set_layout({sink: assign(writers) for sink in SINKS})
        except RescaleRefusedError:
            assert self.h.core.open_epoch_number() is not None
            return
        self.h.writers = writers

    @precondition(lambda self: self.current is not None)
    @rule(writers=st.integers(1, MAX_WRITERS))
    def rescale_while_feeding(self, writers: int) -> None:
        """A layout change out of turn (the driver never sends one while it feeds): an
        epoch opened first is open at the coordinator, so it is refused; the driver's next
        epoch is not known there yet, so it is taken, and that attempt cannot be decided
        under a layout its requests do not match."""
        try:
            self.h.core.set_layout({sink: assign(writers) for sink in SINKS})
        except RescaleRefusedError:
            assert self.h.core.open_epoch_number() is not None
            return
        self.misrouted = self.misrouted or writers != self.feeding
        self.h.writers = writers

    @precondition(lambda self: self.complete is not None)
    @rule()
    def decide(self) -> None:
        """The PENDING record of the gathered attempt (unless it was aborted meanwhile)."""
        assert self.complete is not None
        epoch, attempt = self.complete
        if self.h.core.persist_pending(epoch, attempt):
            self.decided[epoch] = attempt
            self.carried[epoch] = self.carrying
            self.schemas["b"].extend(self.reported["b"])
        self.complete = None

    @precondition(lambda self: self.current is not None)
    @rule()
    def resolve_current(self) -> None:
        """The driver gives up an attempt still being fed (a writer died)."""
        assert self.current is not None
        epoch, attempt = self.current
        assert self.h.core.resolve(epoch, attempt) is Resolution.ABORTED
        self.current = None

    @precondition(lambda self: self.complete is not None)
    @rule()
    def resolve_complete(self) -> None:
        """The driver resolves an attempt whose requests are all in, before its PENDING
        record: it is aborted, and can no longer be decided."""
        assert self.complete is not None
        epoch, attempt = self.complete
        assert self.h.core.resolve(epoch, attempt) is Resolution.ABORTED
        assert not self.h.core.persist_pending(epoch, attempt)
        self.complete = None

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
            pass
        finally:  # armed for this step only: a step that carries nothing never calls the sink
            self.h.targets[sink].fail_commits = 0

    @rule(feeding=st.booleans())
    def crash(self, feeding: bool) -> None:
        """The coordinator restarts; with ``feeding`` the driver goes on with the attempt
        it was feeding (its requests then reach the new coordinator)."""
        self.h.crash()
        self.complete = None
        if not feeding:
            self.current = None

    @rule()
    def second_driver(self) -> None:
        """Another driver starts the runtime while this one's lease lives: refused."""
        lease = self.h.store.acquire_lease(RUNTIME, "intruder", {"driver": 0}, 3600.0)
        assert lease.holder == self.h.holder
        with pytest.raises(RuntimeInUseError):
            self.h.store.claim(RUNTIME, {n: "memory" for n in SINKS}, holder="intruder")

    @rule(zombie_commits=st.booleans())
    def driver_replaced(self, zombie_commits: bool) -> None:
        """The driver is killed; its successor takes the lease over and starts its own
        coordinator. The old one, a zombie for a moment, may still commit a decided epoch
        to its target, but records nothing; its driver cannot claim again."""
        zombie, old_holder = self.h.core, self.h.holder
        self.h.replace_driver()
        self.current = self.complete = None
        step = zombie.next_commit()
        if zombie_commits and step is not None:
            try:
                outcome = zombie.run_commit(step)
            except ConnectionError:  # a target made to fail stays failing for it too
                return
            with pytest.raises(FencedError):
                zombie.record_commit(outcome)
        with pytest.raises(RuntimeInUseError):
            self.h.store.claim(RUNTIME, {n: "memory" for n in SINKS}, holder=old_holder)

    @invariant()
    def decided_schemas_agree(self) -> None:
        if self.schemas["b"]:
            _schema.union(self.schemas["b"])  # raises SchemaMismatchError on a conflict

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
            self.h.crash()
            self.h.commit_all()
            for name, target in self.h.targets.items():
                assert {e for e, _, _ in target.visible} <= set(self.decided)
                # a first attempt that carried nothing to a sink (every writer of it
                # idle) is recorded committed without a call to the sink
                assert target.commits == sum(name in self.carried[e] or attempt > 0
                                             for e, attempt in self.decided.items())
                assert not target.staged, f"staged data left behind: {sorted(target.staged)}"
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
