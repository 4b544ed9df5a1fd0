"""A coordinator's recovery on a meta store that fails, without Ray: ``CoordinatorActor``
driven in one asyncio loop over a SQLite store whose reads fail on demand (issue 36,
item 7). A ``MetaStoreError`` while recovering is retried with backoff; calls waiting for
recovery give up after a while naming the store's error; ``recovery()`` says whether the
coordinator recovered and knows the decided epochs (what ``rt.close()`` trusts)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from raysink.coordinator import coordinator as coordinator_module
from raysink.coordinator.coordinator import CoordinatorActor, CoordinatorConfig
from raysink.errors import MetaStoreError
from tests.unit.memsink import MemorySink, MemoryTarget

RUNTIME = "recoverrt"


def _actor(tmp_path: Path, failures: int) -> CoordinatorActor:
    """A coordinator whose meta store's ``records`` (recovery's first read) fails the
    first ``failures`` times."""
    actor = CoordinatorActor(CoordinatorConfig(
        runtime=RUNTIME, metastore=f"sqlite:///{tmp_path / 'meta.db'}",
        sinks={"main": MemorySink(MemoryTarget()).bind(RUNTIME, "main")}, writers=1,
        retry_cap=0.05))
    store: Any = actor._store
    records = store.records
    left = [failures]

    def failing_records(runtime: str) -> Any:
        if left[0] > 0:
            left[0] -= 1
            raise MetaStoreError("the meta store is failing over (injected)", runtime=runtime)
        return records(runtime)

    store.records = failing_records
    return actor


def test_recovery_is_retried_until_the_meta_store_answers(tmp_path: Path) -> None:
    async def scenario() -> None:
        actor = _actor(tmp_path, failures=5)
        state = await actor.recovery(10.0)
        assert state.recovered and state.fatal is None and state.retrying is None
        assert (await actor.status()).error is None
        await actor.close()

    asyncio.run(scenario())


def test_while_the_meta_store_stays_down_calls_and_close_are_told_why(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before, the first error stopped the coordinator for good (``_fatal``) while it
    answered pings, and ``recovery`` did not exist: ``status()`` showed no pending epoch."""
    monkeypatch.setattr(coordinator_module, "_RECOVERY_WAIT", 0.3)
    monkeypatch.setattr(coordinator_module, "_STATUS_WAITS_FOR_RECOVERY", 0.3)

    async def scenario() -> None:
        actor = _actor(tmp_path, failures=1_000_000)
        state = await actor.recovery(0.3)
        assert not state.recovered and state.fatal is None
        assert state.retrying is not None and "failing over" in state.retrying
        with pytest.raises(MetaStoreError, match=r"has not recovered.*failing over"):
            await actor.committed_through()
        assert "recovering" in ((await actor.status()).error or "")
        for task in actor._tasks:
            task.cancel()

    asyncio.run(scenario())
