"""Format versions of manifests and markers (``raysink.sinks._format``) and the
coordinator's check of a decided epoch's manifests before its recovery commits or sweeps
anything: one without a version (raysink 0.1.0's) is version 1 and committed as it is; one
of a newer format stops the recovery with ``NewerVersionError``, nothing touched."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from raysink.coordinator.epochs import EpochCoordinator
from raysink.coordinator.metastore import SqliteMetaStore
from raysink.coordinator.metastore.base import EpochState
from raysink.errors import MetaStoreError, NewerVersionError
from raysink.protocol.vnodes import assign
from raysink.sinks._format import (
    MANIFEST_FORMAT,
    MARKER_FORMAT,
    check_manifests,
    check_marker,
    format_of,
    stamp,
)
from tests.unit.memsink import MemorySink, MemoryTarget

pytestmark = pytest.mark.unit

RUNTIME = "fmt"


def test_a_stamped_manifest_is_a_copy_carrying_the_format() -> None:
    manifest = {"writer": 0, "rows": 3}
    assert stamp(manifest) == {"writer": 0, "rows": 3, "format": MANIFEST_FORMAT}
    assert manifest == {"writer": 0, "rows": 3}


def test_no_format_reads_as_version_1_and_a_bad_one_is_corrupt() -> None:
    assert format_of({"writer": 0}, "m") == 1
    assert format_of({"format": 1}, "m") == 1
    for bad in ("2", 0, True, None):
        with pytest.raises(MetaStoreError, match="corrupt"):
            format_of({"format": bad}, "m")


def test_newer_manifests_and_markers_are_refused_naming_both_versions() -> None:
    check_manifests([{"writer": 0, "rows": 1}], written_by=None, runtime="r", sink="s",
                    epoch=2)
    with pytest.raises(NewerVersionError) as info:
        check_manifests([{"writer": 0, "rows": 1, "format": MANIFEST_FORMAT + 1}],
                        written_by="9.0.0", runtime="r", sink="s", epoch=2)
    assert (info.value.what, info.value.found, info.value.epoch) == (
        "manifest", MANIFEST_FORMAT + 1, 2)
    assert "raysink 9.0.0" in str(info.value) and f"up to {MANIFEST_FORMAT}" in str(info.value)
    check_marker(None, runtime="r", sink="s", where="x")
    check_marker({"epoch": 3}, runtime="r", sink="s", where="x")
    with pytest.raises(NewerVersionError, match=f"format {MARKER_FORMAT + 1}"):
        check_marker({"epoch": 3, "format": MARKER_FORMAT + 1}, runtime="r", sink="s",
                     where="x")


def _store_with_pending(tmp_path: Path, manifest: dict[str, Any]
                        ) -> tuple[SqliteMetaStore, int]:
    """Epoch 1 OPEN (staged, undecided) and epoch 2 PENDING with ``manifest``."""
    store = SqliteMetaStore(tmp_path / "meta.db")
    generation = store.claim(RUNTIME, {"a": "memory"}).generation
    store.put_open(RUNTIME, generation, 1, 0, ["a"], {})
    store.put_open(RUNTIME, generation, 2, 0, ["a"], {})
    store.put_pending(RUNTIME, generation, 2, 0, {"a": [manifest]})
    return store, generation


def _recovered(store: SqliteMetaStore, target: MemoryTarget) -> EpochCoordinator:
    generation = store.claim(RUNTIME, {"a": "memory"}).generation
    core = EpochCoordinator(runtime=RUNTIME, store=store,
                            sinks={"a": MemorySink(target).bind(RUNTIME, "a")},
                            generation=generation, bitmaps={"a": assign(1)},
                            max_pending_epochs=2)
    core.recover()
    return core


def test_recovery_refuses_a_newer_manifest_before_it_sweeps_or_commits(
        tmp_path: Path) -> None:
    target = MemoryTarget()
    target.staged[(1, 0, 0)] = [7]
    target.staged[(2, 0, 0)] = [8]
    store, _ = _store_with_pending(tmp_path, {"writer": 0, "rows": 1, "epoch": 2,
                                              "attempt": 0, "format": MANIFEST_FORMAT + 1})
    with pytest.raises(NewerVersionError, match="epoch 2 was decided by raysink"):
        _recovered(store, target)
    assert [(r.epoch, r.state) for r in store.records(RUNTIME)] == [
        (1, EpochState.OPEN), (2, EpochState.PENDING)]
    assert sorted(target.staged) == [(1, 0, 0), (2, 0, 0)] and target.visible == []


def test_recovery_commits_a_manifest_without_a_format_as_it_is(tmp_path: Path) -> None:
    target = MemoryTarget()
    target.staged[(1, 0, 0)] = [7]
    target.staged[(2, 0, 0)] = [8]
    store, _ = _store_with_pending(tmp_path, {"writer": 0, "rows": 1, "epoch": 2,
                                              "attempt": 0})
    core = _recovered(store, target)
    step = core.next_commit("a")
    assert step is not None and step.epoch == 2
    assert list(step.manifests) == [{"writer": 0, "rows": 1, "epoch": 2, "attempt": 0}]
    core.record_commit(core.run_commit(step))
    assert target.visible == [(2, 0, 8)] and (1, 0, 0) not in target.staged


def test_the_coordinator_stops_on_a_newer_manifest_instead_of_retrying(
        tmp_path: Path) -> None:
    """A meta store error in recovery is retried (a failover passes); a newer raysink's
    manifest never becomes readable, so the coordinator stops at once and says why."""
    import asyncio

    from raysink.coordinator.coordinator import CoordinatorActor, CoordinatorConfig

    store, _ = _store_with_pending(tmp_path, {"writer": 0, "rows": 1, "epoch": 2,
                                              "attempt": 0, "format": MANIFEST_FORMAT + 1})
    store.close()

    async def scenario() -> None:
        actor = CoordinatorActor(CoordinatorConfig(
            runtime=RUNTIME, metastore=f"sqlite:///{tmp_path / 'meta.db'}",
            sinks={"a": MemorySink(MemoryTarget()).bind(RUNTIME, "a")}, writers=1,
            retry_cap=0.05))
        state = await actor.recovery(10.0)
        assert not state.recovered and state.retrying is None
        assert state.fatal is not None and state.fatal.startswith("NewerVersionError")
        await actor.close()

    asyncio.run(scenario())


def test_a_kafka_epoch_record_carries_its_format_and_a_newer_one_is_refused() -> None:
    import json

    from raysink.sinks import KafkaSink
    from raysink.sinks.kafka._progress import ProgressReader, epoch_key, record_value

    assert json.loads(record_value(3, 0))["format"] == MARKER_FORMAT
    sink = KafkaSink("127.0.0.1:9", "events").bind("rt", "main")
    reader = ProgressReader(sink.settings, "rt", "main")
    reader.latest[epoch_key("rt", "main")] = {"epoch": 3, "attempt": 0}  # raysink 0.1.0's
    assert reader.committed_epoch(cached=True) == 3
    reader.latest[epoch_key("rt", "main")] = {"epoch": 4, "attempt": 0,
                                             "format": MARKER_FORMAT + 1}
    with pytest.raises(NewerVersionError, match="progress topic"):
        reader.committed_epoch(cached=True)
