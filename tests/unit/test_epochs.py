"""The coordinator's state machine without Ray: the epoch rules, 2PC, recovery, fencing."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pytest

from raysink import _schema
from raysink._schema import SchemaEvolution
from raysink.coordinator.epochs import (
    CommitOutcome,
    EpochCoordinator,
    Resolution,
    StaleAttemptError,
)
from raysink.coordinator.metastore import SqliteMetaStore
from raysink.coordinator.metastore.base import EpochState, MetaStore
from raysink.errors import (
    BackpressureError,
    ConfigError,
    DataLossError,
    EpochRegressionError,
    FencedError,
    MetaStoreError,
    SchemaMismatchError,
    SinkUnavailableError,
)
from raysink.protocol.messages import CommitRequest
from raysink.protocol.vnodes import assign
from raysink.testing import InMemoryMetaStore
from tests.unit.memsink import MemorySink, MemoryTarget

RUNTIME = "rt"
WRITERS = 2


def commit_sink(core: EpochCoordinator, epoch: int, sink: str) -> CommitOutcome:
    """One sink's commit of a PENDING epoch, as a commit worker does it: the sink's I/O
    (``run_commit``), then the record (``record_commit``)."""
    step = core.next_commit(sink)
    assert step is not None and step.epoch == epoch, (step, epoch)  # a sink goes in order
    outcome = core.run_commit(step)
    core.record_commit(outcome)
    return outcome


class Harness:
    """A coordinator over two memory sinks, with what survives a crash kept outside it: the
    targets, and the meta store (``self.store``, an ``InMemoryMetaStore`` by default). With
    ``open_store``, the store is opened by it, and closed and opened again at every crash
    (a SQLite file: what survives is what reached the file). The driver (``holder``)
    holds the runtime's lease; ``replace_driver`` hands it to a successor."""

    def __init__(self, sinks: tuple[str, ...] = ("a", "b"), max_pending: int = 2,
                 open_store: Callable[[], MetaStore] | None = None,
                 evolution: dict[str, SchemaEvolution] | None = None) -> None:
        self.open_store = open_store
        self.store: MetaStore = open_store() if open_store else InMemoryMetaStore()
        self.targets = {name: MemoryTarget() for name in sinks}
        self.max_pending = max_pending
        self.epoch_offset: int | None = None
        self.evolution = dict(evolution or {})  # a sink's schema_evolution, "fail" if absent
        self.writers = WRITERS  # the layout a (re)started coordinator gets (rescale)
        self.holder = "driver-1"
        self.add: tuple[str, ...] = ()  # sinks a (re)start adds or drops on purpose
        self.drop: tuple[str, ...] = ()
        self.core = self.boot()

    def boot(self) -> EpochCoordinator:
        sinks = {n: MemorySink(t).bind(RUNTIME, n) for n, t in self.targets.items()}
        for name, sink in sinks.items():
            sink.schema_evolution = self.evolution.get(name, "fail")
        lease = self.store.acquire_lease(RUNTIME, self.holder, {"driver": self.holder},
                                         3600.0)  # the driver's, at its start
        assert lease.holder == self.holder
        record = self.store.claim(RUNTIME, {n: "memory" for n in sinks}, add=self.add,
                                  drop=self.drop, holder=self.holder)
        core = EpochCoordinator(runtime=RUNTIME, store=self.store, sinks=sinks,
                                generation=record.generation,
                                bitmaps={n: assign(self.writers) for n in sinks},
                                max_pending_epochs=self.max_pending,
                                epoch_offset=self.epoch_offset)
        core.recover()
        core.reconcile_markers()
        return core

    def crash(self) -> None:
        if self.open_store is not None:  # the coordinator's process and connection are gone
            self.store.close()
            self.store = self.open_store()
        self.core = self.boot()

    def replace_driver(self) -> None:
        """The driver is gone (killed); a successor takes its lease over and starts a
        coordinator of its own (a new generation). The old coordinator object is left as
        it was (a zombie, for the caller to try)."""
        old = self.holder
        number = int(old.rsplit("-", 1)[1]) + 1
        self.holder = f"driver-{number}"
        if self.open_store is not None:
            self.store = self.open_store()  # the successor's own connection
        lease = self.store.acquire_lease(RUNTIME, self.holder, {"driver": self.holder},
                                         3600.0, replace=old)
        assert lease.holder == self.holder
        self.core = self.boot()

    def requests(self, epoch: int, attempt: int, rows: int = 3) -> list[CommitRequest]:
        """Every writer of every sink stages ``rows`` rows: their commit requests."""
        out = []
        for name, sink in self.core.sinks.items():
            for writer_id in range(self.writers):
                writer = sink.create_writer(writer_id)
                values = [epoch * 1000 + writer_id * 100 + i for i in range(rows)]
                writer.write(pa.record_batch({"v": values}))
                out.append(CommitRequest(sink=name, writer=writer_id, epoch=epoch,
                                         attempt=attempt,
                                         manifest=writer.pre_commit(epoch, attempt)))
        return out

    def precommit_all(self, epoch: int, attempt: int, rows: int = 3) -> bool:
        """The writers' requests, gathered, then the decision."""
        self.core.gather(epoch, attempt, self.requests(epoch, attempt, rows))
        return self.core.persist_pending(epoch, attempt)

    def commit_all(self) -> None:
        while (step := self.core.next_commit()) is not None:
            commit_sink(self.core, step.epoch, step.sink)

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
        h.core.gather(5, first.attempt, h.requests(5, first.attempt))


def test_resolve_answers_from_the_meta_store() -> None:
    h = Harness()
    opened = h.core.open_epoch(1)
    assert h.core.resolve(1) is Resolution.ABORTED
    assert h.core.open_epoch(1).attempt == opened.attempt + 1
    assert h.precommit_all(1, opened.attempt + 1)
    assert h.core.resolve(1) is Resolution.ROLLING_FORWARD
    h.commit_all()
    assert h.core.resolve(1) is Resolution.COMMITTED


def test_a_writer_twice_in_one_gather_is_refused() -> None:
    h = Harness(sinks=("a",))
    d = h.core.open_epoch(1)
    requests = h.requests(1, d.attempt)
    with pytest.raises(ValueError):
        h.core.gather(1, d.attempt, [*requests, requests[0]])


def test_the_next_epoch_is_decided_with_its_open_in_one_record() -> None:
    """An epoch whose open travelled with its data: no OPEN before, PENDING with its
    layout at once; it commits like any other."""
    h = Harness()
    h.write_epoch()
    attempt = h.core.next_attempt(2)
    h.core.gather(2, attempt, h.requests(2, attempt), h.core.generation)
    assert [r.state for r in h.store.records(RUNTIME) if r.epoch == 2] == []
    assert h.core.persist_pending(2, attempt)
    records = [r for r in h.store.records(RUNTIME) if r.epoch == 2]
    assert {r.state for r in records} == {EpochState.PENDING}
    assert records[0].layout["sinks"]["a"]["writers"] == WRITERS
    h.commit_all()
    _visible_once(h, [1, 2])


def test_a_crash_before_the_decision_sweeps_what_writers_staged() -> None:
    """Writers staged the next epoch, whose open never reached the meta store: recovery
    sweeps the epochs after the last one it knows."""
    h = Harness()
    h.write_epoch()
    began = h.core.generation
    requests = h.requests(2, 0)  # staged, never gathered
    assert any(k[0] == 2 for k in h.targets["a"].staged)
    h.crash()
    assert not any(k[0] == 2 for t in h.targets.values() for k in t.staged)
    with pytest.raises(StaleAttemptError, match="before a restart"):
        h.core.gather(2, 0, requests, began)  # the driver was still feeding it
    assert h.write_epoch() == 2
    _visible_once(h, [1, 2])


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
        commit_sink(h.core, 2, "a")
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
            commit_sink(h.core, 1, "a")
        assert h.core.epoch_state(1) is EpochState.PENDING
    h.commit_all()
    assert h.core.last_committed == 1
    assert h.targets["a"].commits == 1


def test_commit_is_skipped_when_the_marker_is_there() -> None:
    h = Harness(sinks=("a",))
    d = h.core.open_epoch(1)
    assert h.precommit_all(1, d.attempt)
    h.targets["a"].marker = 1
    outcome = commit_sink(h.core, 1, "a")
    assert outcome.skipped
    assert h.core.skipped_sinks(1) == () or h.core.last_committed == 1


def test_a_marker_of_the_epochs_own_decision_is_no_skip() -> None:
    """Epoch 1 reached the target, then the coordinator crashed before recording it: the
    next one finds the marker, and the target says the data is this decision's
    (``holds_decision``): not a skip. Epoch 2's marker holds another decision's rows (another
    driver's, with a meta store of its own): a skip."""
    h = Harness(sinks=("a",))
    assert h.precommit_all(1, h.core.open_epoch(1).attempt)
    step = h.core.next_commit("a")
    assert step is not None and not h.core.run_commit(step).skipped  # never recorded
    h.crash()
    assert not commit_sink(h.core, 1, "a").skipped
    assert h.targets["a"].commits == 1
    assert h.precommit_all(2, h.core.open_epoch(2).attempt)
    h.targets["a"].marker = 2
    h.targets["a"].visible.append((2, 99, 0))  # another decision's row
    assert commit_sink(h.core, 2, "a").skipped
    assert h.targets["a"].commits == 1


def test_deleted_marker_while_pending_is_data_loss() -> None:
    h = Harness(sinks=("a",))
    h.write_epoch(1)
    d = h.core.open_epoch(2)
    assert h.precommit_all(2, d.attempt)
    h.targets["a"].marker = None
    with pytest.raises(DataLossError):
        commit_sink(h.core, 2, "a")


def test_deleted_marker_without_pending_is_recreated() -> None:
    h = Harness(sinks=("a",))
    h.write_epoch(1)
    h.targets["a"].marker = None
    recreated: list[int] = []
    sink = h.core.sinks["a"]
    sink.recreate_marker = recreated.append  # type: ignore[method-assign]
    h.core.reconcile_markers()
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
    h.core.reconcile_markers()  # no target, no marker, and none was ever expected
    assert h.write_epoch(2) == 2
    assert target.exists and target.marker == 2
    assert sorted({e for e, _, _ in target.visible}) == [2]
    h.crash()
    h.core.reconcile_markers()
    target.exists, target.marker = False, None  # now the target is lost for real
    with pytest.raises(DataLossError):
        h.core.reconcile_markers()


def _idle_epoch(h: Harness, epoch: int) -> int:
    """Epoch ``epoch`` with every writer of every sink idle (the driver answers for them);
    returns its attempt."""
    decision = h.core.open_epoch(epoch)
    idle = [CommitRequest(sink=name, writer=k, epoch=epoch, attempt=decision.attempt,
                          manifest=None)
            for name in h.core.sinks for k in range(h.writers)]
    h.core.gather(epoch, decision.attempt, idle)
    assert h.core.persist_pending(epoch, decision.attempt)
    h.commit_all()
    return decision.attempt


def test_an_epoch_that_carried_nothing_is_committed_without_calling_the_sink() -> None:
    """No manifest in any writer: recorded committed, unmarked, the target untouched (no
    marker write, no empty version); the marker of the last epoch that carried something
    is still expected of the target after a restart, so its loss is still caught. (The
    first epochs after a start have their attempt 0 spent by the start's sweep.)"""
    h = Harness(sinks=("a",))
    target = h.targets["a"]
    for epoch in (1, 2, 3):
        h.write_epoch(epoch)
    for epoch in (4, 5):
        assert _idle_epoch(h, epoch) == 0
    assert target.commits == 3 and target.marker == 3 and h.core.last_committed == 5
    assert [(r.epoch, r.marked) for r in h.store.records(RUNTIME)] == [(3, True), (5, False)]
    h.crash()
    assert h.core.last_committed == 5 and h.core.open_epoch(None).epoch == 6
    h.crash()
    target.marker = 1  # behind the meta store: epoch 3's marker is re-created
    h.core.reconcile_markers()
    assert target.marker == 3
    h.crash()
    target.exists, target.marker = False, None  # the target deleted: a loss, not "new"
    with pytest.raises(DataLossError):
        h.core.reconcile_markers()


def test_a_later_attempt_that_carried_nothing_still_calls_the_sink() -> None:
    """After a failed attempt (or a start, which spends attempt 0 of the next epochs on
    its sweep) the commit also clears what may be left (a PostgreSQL writer's
    transaction prepared after the abort): the sink is called."""
    h = Harness(sinks=("a",))
    target = h.targets["a"]
    assert _idle_epoch(h, 1) == 1  # attempt 0 spent by the start
    for epoch in (2, 3):
        h.write_epoch(epoch)
    first = h.core.open_epoch(4)
    assert first.attempt == 0
    h.core.gather(4, first.attempt, h.requests(4, first.attempt))
    assert h.core.resolve(4, first.attempt) is Resolution.ABORTED
    assert _idle_epoch(h, 4) == 1
    assert target.commits == 4 and target.marker == 4
    assert sorted({e for e, _, _ in target.visible}) == [2, 3]


# ----------------------------------------------------------------------------- markers


def _visible_once(h: Harness, epochs: list[int]) -> None:
    for target in h.targets.values():
        assert sorted({e for e, _, _ in target.visible}) == epochs
        assert len(target.visible) == len(epochs) * WRITERS * 3


def test_fresh_metastore_refuses_implicit_epochs_and_skips_replays() -> None:
    """The meta store is lost, the targets keep their markers (a job started from another
    directory gets a fresh default store): an implicit epoch would be numbered 1 and
    skipped as committed, its rows lost. It is refused; explicit replays are skipped; an
    explicit new epoch is written, after which implicit numbering goes on after it."""
    h = Harness()
    for _ in range(3):
        h.write_epoch()
    h.store = InMemoryMetaStore()
    h.crash()
    with pytest.raises(ConfigError, match=r"holds epoch 3.*metastore=.*epoch_offset=3"):
        h.core.open_epoch(None)
    for replay in (1, 3):
        assert h.core.open_epoch(replay).skip
        assert h.core.resolve(replay) is Resolution.COMMITTED
    assert h.core.committed_through() == 3
    assert h.write_epoch(4) == 4
    assert h.write_epoch() == 5
    _visible_once(h, [1, 2, 3, 4, 5])


@pytest.mark.parametrize(("offset", "refused"), [
    (2, True),  # below the markers: epoch 3 would be skipped
    (3, False),  # at the markers: the next epoch is 4
    (7, False),  # above: a gap, allowed
])
def test_epoch_offset_acknowledges_the_markers(offset: int, refused: bool) -> None:
    h = Harness()
    for _ in range(3):
        h.write_epoch()
    h.store = InMemoryMetaStore()
    h.epoch_offset = offset
    h.crash()
    if refused:
        with pytest.raises(ConfigError, match=f"epoch_offset={offset} is below epoch 3"):
            h.core.open_epoch(None)
        return
    assert h.write_epoch() == offset + 1
    _visible_once(h, [1, 2, 3, offset + 1])


def test_markers_ahead_of_an_old_metastore_copy(tmp_path: Path) -> None:
    """A store that knows epochs 1-2 while the targets hold 3 (an old copy restored):
    unexplained too, refused until acknowledged."""
    h = Harness()
    h.store = SqliteMetaStore(tmp_path / "meta.db")
    h.crash()
    h.write_epoch()
    h.write_epoch()
    h.store.close()
    shutil.copy(tmp_path / "meta.db", tmp_path / "old.db")
    h.store = SqliteMetaStore(tmp_path / "meta.db")
    h.crash()
    h.write_epoch()
    h.store.close()
    h.store = SqliteMetaStore(tmp_path / "old.db")
    h.crash()
    with pytest.raises(ConfigError, match="epochs up to 2 only"):
        h.core.open_epoch(None)
    h.store.close()


@pytest.mark.parametrize("offset", [None, 2, 5])
def test_a_lagging_sink_over_a_fresh_store_is_named_and_refused(offset: int | None) -> None:
    """'a' committed epochs 1-2 while 'b' stalled after epoch 1 (its epoch 2 still
    pending), then the meta store was lost. A fresh store cannot roll 'b' forward: going
    on after epoch 2 (``epoch_offset=2``, the highest marker) would leave 'b' without epoch
    2 for good. Refused whatever the offset, naming 'b'; nothing is numbered."""
    h = Harness()
    h.write_epoch()
    decision = h.core.open_epoch(None)
    assert h.precommit_all(decision.epoch, decision.attempt)
    commit_sink(h.core, 2, "a")
    h.store = InMemoryMetaStore()
    h.epoch_offset = offset
    h.crash()
    with pytest.raises(ConfigError, match="sink 'b' holds epoch 1") as refused:
        h.core.open_epoch(None)
    assert refused.value.sink == "b"
    assert "metastore=" in str(refused.value), refused.value
    with pytest.raises(ConfigError, match="sink 'b' holds epoch 1"):
        h.core.check_alignment("query", epoch_offset=offset)
    assert sorted({e for e, _, _ in h.targets["a"].visible}) == [1, 2]
    assert sorted({e for e, _, _ in h.targets["b"].visible}) == [1]


def test_a_new_query_over_a_fresh_store_is_refused_below_the_markers() -> None:
    """A streaming query bound for the first time in a fresh store: its batch ids would
    number epochs from 1, each skipped as committed. Refused unless ``epoch_offset``
    is at least the targets' epoch; the message names both ways on."""
    h = Harness()
    for _ in range(3):
        h.write_epoch()
    h.store = InMemoryMetaStore()
    h.crash()
    for offset in (None, 0, 2):
        with pytest.raises(ConfigError, match="epoch_offset=3") as refused:
            h.core.check_alignment("query", epoch_offset=offset)
        if offset is None:
            assert "metastore=" in str(refused.value), refused.value
            assert "streaming query" in str(refused.value), refused.value
    h.core.check_alignment("query", epoch_offset=3)  # acknowledged


def test_unreadable_marker_is_read_again_before_numbering() -> None:
    h = Harness()
    h.write_epoch()
    h.targets["b"].unreachable = True
    h.crash()
    with pytest.raises(SinkUnavailableError, match="progress marker of sink 'b'"):
        h.core.open_epoch(None)
    h.targets["b"].unreachable = False
    assert h.write_epoch() == 2
    _visible_once(h, [1, 2])


def test_a_sink_ahead_of_a_stalled_one_survives_a_crash() -> None:
    """Sinks commit on their own: 'a' commits epochs 1 and 2 while 'b' fails. The store
    keeps only each sink's newest COMMITTED row, so 'a' has no row for epoch 1 any more;
    after a crash epoch 1 is still committed for 'a' and rolls forward for 'b' only."""
    h = Harness(max_pending=3)
    for epoch in (1, 2):
        d = h.core.open_epoch(epoch)
        assert h.precommit_all(epoch, d.attempt)
        step = h.core.next_commit("a")
        assert step is not None and step.epoch == epoch
        commit_sink(h.core, step.epoch, "a")
    assert h.core.pending_epochs() == [1, 2]
    h.crash()
    assert h.core.next_commit("a") is None
    h.commit_all()
    assert h.core.last_committed == 2
    _visible_once(h, [1, 2])
    assert h.targets["a"].commits == 2 and h.targets["b"].commits == 2


@pytest.mark.parametrize("readded", [False, True])
def test_a_sink_added_while_an_epoch_is_pending_is_not_part_of_it(readded: bool) -> None:
    """Epoch 2 is decided while 'a' cannot commit; the runtime restarts with sink 'b'
    added (new, or dropped earlier and added back). 'b' was not part of epoch 2's
    decision and has no record of it: epoch 2 rolls forward into 'a' alone (it used to
    wedge: 'b''s commit worker found no record to mark COMMITTED and retried forever,
    and backpressure then failed every write), and epoch 3 reaches both."""
    h = Harness(sinks=("a", "b") if readded else ("a",))
    h.write_epoch()
    if readded:
        b = h.targets.pop("b")
        h.drop = ("b",)
        h.crash()
    h.targets["a"].fail_commits = 1_000
    decision = h.core.open_epoch(None)
    assert h.precommit_all(decision.epoch, decision.attempt)
    with pytest.raises(ConnectionError):
        commit_sink(h.core, 2, "a")
    h.targets["b"] = b if readded else MemoryTarget()
    h.add, h.drop = ("b",), ()
    h.targets["a"].fail_commits = 0
    h.crash()
    assert h.core.pending_epochs() == [2]
    assert h.core.next_commit("b") is None  # nothing of epoch 2 is 'b''s
    h.commit_all()
    assert h.core.last_committed == 2
    assert h.write_epoch() == 3
    assert sorted({e for e, _, _ in h.targets["a"].visible}) == [1, 2, 3]
    assert sorted({e for e, _, _ in h.targets["b"].visible}) == ([1, 3] if readded else [3])


class _StoreFailingCommitRecords(InMemoryMetaStore):
    """Refuses the next ``failures`` COMMITTED records (a meta store that was down)."""

    failures = 0

    def put_committed(self, runtime: str, generation: int, epoch: int, sink: str, *,
                      marked: bool = True) -> None:
        if self.failures > 0:
            self.failures -= 1
            raise MetaStoreError("meta store unreachable (injected)", runtime=runtime)
        super().put_committed(runtime, generation, epoch, sink, marked=marked)


@pytest.mark.parametrize("failure", ["answer_lost", "record_failed"])
def test_a_commit_retried_after_it_landed_is_no_skip(failure: str) -> None:
    """The sink's commit of epoch 1 landed, but its answer was lost (or recording it
    COMMITTED failed): the retry finds the epoch's marker. Those are this epoch's own
    rows, committed once: the outcome is not *skipped* (``skipped_sinks`` used to name
    the sink, as if its rows had not landed)."""
    h = Harness(sinks=("a",))
    store = _StoreFailingCommitRecords()
    h.store = store
    h.crash()
    decision = h.core.open_epoch(None)
    assert h.precommit_all(decision.epoch, decision.attempt)
    step = h.core.next_commit("a")
    assert step is not None
    if failure == "answer_lost":
        h.targets["a"].fail_after_commits = 1
        with pytest.raises(ConnectionError):
            h.core.run_commit(step)
    else:
        store.failures = 1
        with pytest.raises(MetaStoreError):
            h.core.record_commit(h.core.run_commit(step))
    outcome = h.core.run_commit(step)
    assert not outcome.skipped
    h.core.record_commit(outcome)
    assert h.core.skipped_sinks(1) == () and h.core.last_committed == 1
    assert h.targets["a"].commits == 1
    _visible_once(h, [1])


def test_a_sweep_that_fails_never_reuses_the_attempt() -> None:
    """The writers' attempt of an epoch failed and its sweep cannot reach a target: the
    attempt still resolves ABORTED and its number counts as used (the epoch opened again
    used to get the same attempt number, whose messages its writers drop as stale, so
    every later write of it failed); the epoch is swept before it is opened again, and
    while the target refuses that, opening it is a ``SinkUnavailableError``."""
    h = Harness()
    h.write_epoch()
    decision = h.core.open_epoch(None)
    h.targets["b"].fail_aborts = 2
    assert h.core.resolve(decision.epoch) is Resolution.ABORTED
    with pytest.raises(SinkUnavailableError, match="could not be swept"):
        h.core.open_epoch(decision.epoch)
    again = h.core.open_epoch(decision.epoch)
    assert again.attempt > decision.attempt
    assert h.precommit_all(again.epoch, again.attempt)
    h.commit_all()
    _visible_once(h, [1, 2])


# --------------------------------------------------------------------------- schemas


_OLD = pa.schema([("v", pa.int64())])
_NEW = pa.schema([("v", pa.int64()), ("extra", pa.string())])


def with_schema(request: CommitRequest, schema: pa.Schema) -> CommitRequest:
    """``request`` reporting ``schema`` (what its writer's batches had, as the writer actor
    reports it) in itself and in its manifest."""
    text = _schema.encode(schema)
    manifest = dict(request.manifest or {}, schema=text)
    return CommitRequest(sink=request.sink, writer=request.writer, epoch=request.epoch,
                         attempt=request.attempt, manifest=manifest,  # type: ignore[arg-type]
                         schema=text)


def _with_schemas(requests: list[CommitRequest], schemas: list[pa.Schema]
                  ) -> list[CommitRequest]:
    """Writer k of each sink reporting ``schemas[k]``."""
    return [with_schema(r, schemas[r.writer]) for r in requests]


def _evolving(h: Harness, evolution: SchemaEvolution = "add_columns") -> Harness:
    for name, sink in h.core.sinks.items():
        h.evolution[name] = sink.schema_evolution = evolution
    return h


def _gather(h: Harness, epoch: int, schemas: list[pa.Schema]) -> int:
    decision = h.core.open_epoch(epoch)
    h.core.gather(epoch, decision.attempt,
                  _with_schemas(h.requests(epoch, decision.attempt), schemas))
    return decision.attempt


def test_writers_disagreeing_on_the_schema_are_refused_without_add_columns() -> None:
    h = _evolving(Harness(sinks=("a",)), "fail")
    with pytest.raises(SchemaMismatchError, match="schema_evolution='add_columns'"):
        _gather(h, 1, [_OLD, _NEW])
    assert h.core.epoch_state(1) is EpochState.OPEN  # recorded OPEN, never decided
    assert not h.core.persist_pending(1, 0)


def test_writers_disagreeing_commit_the_union_with_add_columns() -> None:
    """One writer saw the new column, one did not: the epoch's schema is the union."""
    h = _evolving(Harness(sinks=("a",)))
    attempt = _gather(h, 1, [_OLD, _NEW])
    assert _schema.decode(h.core._epochs[1].schemas["a"]).names == ["v", "extra"]
    assert h.core.persist_pending(1, attempt)
    h.commit_all()
    assert h.core.last_committed == 1


def test_writers_without_a_union_are_refused_naming_the_column() -> None:
    h = _evolving(Harness(sinks=("a",)))
    with pytest.raises(SchemaMismatchError, match=r"writers of one epoch disagree.*'v'") as info:
        _gather(h, 1, [_OLD, pa.schema([("v", pa.string())])])
    assert info.value.column == "v" and info.value.epoch == 1


@pytest.mark.parametrize("crash", [False, True])
def test_an_epoch_is_checked_against_the_epochs_decided_before_it(crash: bool) -> None:
    """Epoch 1 (decided, not yet committed: its change has not reached the target, so
    epoch 2's writers could not see it) added ``extra`` as a string; epoch 2 sending it as
    an integer is refused before it is decided, also after a coordinator restart (the
    decided schema is read back from the manifests)."""
    h = _evolving(Harness(sinks=("a",)))
    assert h.core.persist_pending(1, _gather(h, 1, [_NEW, _NEW]))
    if crash:
        h.crash()
    conflicting = pa.schema([("v", pa.int64()), ("extra", pa.int64())])
    with pytest.raises(SchemaMismatchError, match="'extra'") as info:
        _gather(h, 2, [conflicting, conflicting])
    assert info.value.column == "extra" and info.value.epoch == 2
    h.commit_all()
    assert h.core.persist_pending(2, _gather(h, 2, [_OLD, _NEW]))  # nulls are fine
    h.commit_all()
    assert h.core.last_committed == 2
