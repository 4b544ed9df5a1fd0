"""A commit that cannot complete because its data is lost (issue 36: a Kafka replay after
retention raises ``DataLossError``): the sink reads ``failed``, not ``stalled``, in
``status()`` and in the ``sink_state`` metric, with the error; its commits are tried again
at ``retry_cap`` only, and the error is logged once, not at every try. Before, the
coordinator's sink worker retried it like any error (backoff from 10 ms, a WARNING each
time) and the sink read ``stalled``. Without Ray: ``CoordinatorActor`` in one asyncio
loop over a SQLite store, a memory sink whose commits raise ``DataLossError``."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from pathlib import Path

import pytest

from raysink.coordinator.coordinator import CoordinatorActor, CoordinatorConfig
from raysink.coordinator.retries import BACKOFF_START, REMIND_EVERY, CommitRetries
from raysink.errors import DataLossError, SinkUnavailableError
from raysink.sinks.base import CommitResult, Manifest
from tests.support.staging import writer_request
from tests.unit.memsink import MemorySink, MemoryTarget
from tests.unit.test_metrics import _Fake, fakes  # noqa: F401

RUNTIME = "lossrt"


class _LostSink(MemorySink):
    """Every commit finds the epoch's data gone."""

    def commit(self, epoch: int, manifests: Sequence[Manifest]) -> CommitResult:
        self.target.commits += 1
        raise DataLossError(f"epoch {epoch} cannot be replayed: its records are gone "
                            "(injected)", runtime=self.runtime, sink=self.name, epoch=epoch)


def test_a_lost_epoch_makes_the_sink_failed_in_status_and_metrics(
        tmp_path: Path, fakes: dict[str, _Fake]) -> None:  # noqa: F811
    target = MemoryTarget()

    async def scenario() -> None:
        actor = CoordinatorActor(CoordinatorConfig(
            runtime=RUNTIME, metastore=f"sqlite:///{tmp_path / 'meta.db'}",
            sinks={"main": _LostSink(target).bind(RUNTIME, "main")}, writers=1,
            retry_cap=0.2))
        opened = await actor.open_epoch(1, 5.0)
        target.staged[(1, opened.attempt, 0)] = [1, 2, 3]
        wait = await actor.commit_epoch(1, opened.attempt, [writer_request(1, opened.attempt, 3)],
                                        timeout=0.5)
        assert not wait.committed
        for _ in range(100):
            status = (await actor.status()).sinks["main"]
            if status.state == "failed":
                break
            await asyncio.sleep(0.05)
        assert status.state == "failed", status
        assert (status.last_error or "").startswith("DataLossError: epoch 1 cannot be "
                                                    "replayed"), status
        assert 1 in (await actor.status()).pending_epochs
        assert fakes["sink_state"].get(runtime=RUNTIME, sink="main", state="failed") == 1.0
        assert fakes["sink_state"].get(runtime=RUNTIME, sink="main", state="stalled") == 0.0
        assert (fakes["commit_retries"].get(runtime=RUNTIME, sink="main") or 0) >= 1
        for task in actor._tasks:
            task.cancel()

    asyncio.run(scenario())


def test_data_loss_is_retried_at_the_cap_and_logged_once(
        caplog: pytest.LogCaptureFixture) -> None:
    retries = CommitRetries(RUNTIME, "main", cap=30.0)
    lost = DataLossError("epoch 4 cannot be replayed (injected)", epoch=4)
    caplog.set_level(logging.DEBUG, logger="raysink.coordinator")
    delays = [retries.failed(4, lost) for _ in range(2 * REMIND_EVERY + 1)]
    assert min(delays) >= 15.0  # at the cap (jitter 0.5-1.0) from the first try
    levels = [r.levelno for r in caplog.records]
    assert levels.count(logging.ERROR) == 1
    assert levels.count(logging.WARNING) == 2  # a reminder every REMIND_EVERY tries
    assert "failed: epoch 4 cannot be committed, its data is lost" in caplog.records[0].message
    retries.succeeded()
    caplog.clear()
    down = SinkUnavailableError("the broker is down (injected)")
    assert retries.failed(5, down) <= BACKOFF_START  # other errors: backoff from the start
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
