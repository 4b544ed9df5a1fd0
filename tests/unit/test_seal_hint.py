"""The writers' hint on epochs opened for producers (``EpochHandle``): the coordinator's
open answer says which epochs every sink holds (``OpenedEpoch.committed_through``), and
the seals carry it, so a writer that holds transactions (Kafka) pre-commits without first
asking the coordinator whether the earlier epochs are committed
(``raysink.writer.ordering``). No Ray: a coordinator run in this process, and writer
handles that note their calls."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from raysink.coordinator.coordinator import CoordinatorActor, CoordinatorConfig
from raysink.coordinator.producers import FeedsState
from raysink.driver.handle import seal_writers
from raysink.protocol.barrier import BarrierFlags, CheckpointBarrier
from tests.support.staging import writer_request
from tests.unit.memsink import MemorySink, MemoryTarget
from tests.unit.test_metrics import _Fake, fakes  # noqa: F401

RUNTIME = "seal-hint"


class _Handle:
    """A writer handle noting each ``seal`` sent to it."""

    def __init__(self) -> None:
        self.seals: list[tuple[Any, ...]] = []
        self.seal = SimpleNamespace(remote=self._seal)

    def _seal(self, *args: Any) -> str:
        self.seals.append(args)
        return "ref"


def test_the_seals_carry_the_epochs_the_driver_knows_committed() -> None:
    handles = [_Handle(), _Handle()]
    actors: Any = SimpleNamespace(writers={"main": handles})
    barrier = CheckpointBarrier(7, 5, BarrierFlags.NONE)
    state = FeedsState(closed={1: {0: 3}, 2: {0: 1}})
    barriers = seal_writers(actors, barrier, 0, state, committed_through=4)
    assert handles[0].seals == [(barrier, 0, [1, 2], 4)]
    assert handles[1].seals == [] and barriers.idle == [("main", 1)]
    seal_writers(actors, barrier, 0, state)
    assert handles[0].seals[-1] == (barrier, 0, [1, 2], None)  # nothing known: it asks


def test_an_opened_epoch_says_which_epochs_every_sink_holds(
        tmp_path: Path, fakes: dict[str, _Fake]) -> None:  # noqa: F811
    target = MemoryTarget()

    async def scenario() -> tuple[int | None, int | None]:
        actor = CoordinatorActor(CoordinatorConfig(
            runtime=RUNTIME, metastore=f"sqlite:///{tmp_path / 'meta.db'}",
            sinks={"main": MemorySink(target).bind(RUNTIME, "main")}, writers=1))
        try:
            first = await actor.open_epoch(1, 5.0)
            target.staged[(1, first.attempt, 0)] = [1, 2, 3]
            wait = await actor.commit_epoch(1, first.attempt,
                                            [writer_request(1, first.attempt, 3)], timeout=5.0)
            assert wait.committed
            second = await actor.open_epoch(2, 5.0)
            return first.committed_through, second.committed_through
        finally:
            for task in actor._tasks:
                task.cancel()

    assert asyncio.run(scenario()) == (None, 1)
