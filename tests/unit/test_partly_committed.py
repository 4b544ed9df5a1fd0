"""An epoch partly in its target above the marker (``Sink.partly_committed``: Kafka's
writers commit their parts before the epoch record) and a meta store that does not know
it: the coordinator refuses to decide it again (its parts would be written twice) until
``epoch_offset`` goes past it, and rolls it forward as before when the store has it
pending."""

from __future__ import annotations

import pytest

from raysink.coordinator.epochs import Resolution
from raysink.errors import ConfigError
from raysink.testing import InMemoryMetaStore
from tests.unit.memsink import MemorySink, MemoryTarget
from tests.unit.test_epochs import Harness

_PARTIAL: dict[int, tuple[int, tuple[int, ...]]] = {}


@pytest.fixture(autouse=True)
def _partial_memory_sink(monkeypatch: pytest.MonkeyPatch) -> None:
    """Memory sinks answer ``partly_committed`` from ``_PARTIAL`` (by target)."""
    _PARTIAL.clear()

    def partly_committed(self: MemorySink) -> tuple[int, tuple[int, ...]] | None:
        return _PARTIAL.get(id(self.target))

    monkeypatch.setattr(MemorySink, "partly_committed", partly_committed, raising=False)


def _cut_at_three(target: MemoryTarget) -> None:
    """Writers 0 and 1 committed their parts of epoch 3, the marker stayed at 2."""
    _PARTIAL[id(target)] = (3, (0, 1))


def _fresh_store_over_a_cut_epoch(offset: int | None = None) -> Harness:
    h = Harness(sinks=("a",))
    h.write_epoch()
    h.write_epoch()
    _cut_at_three(h.targets["a"])
    h.store = InMemoryMetaStore()  # the default SQLite file lost with the driver
    h.epoch_offset = offset
    h.crash()
    return h


def test_a_fresh_store_refuses_to_decide_a_partly_committed_epoch_again() -> None:
    h = _fresh_store_over_a_cut_epoch()
    for requested in (None, 3):
        with pytest.raises(ConfigError, match=r"epoch 3 is partly in .*writers \[0, 1\].*"
                                              r"metastore=.*epoch_offset=3") as refused:
            h.core.open_epoch(requested)
        assert refused.value.epoch == 3 and refused.value.sink == "a"
    with pytest.raises(ConfigError, match="epoch 3 is partly in"):
        h.core.check_alignment("query", epoch_offset=2)
    assert h.targets["a"].commits == 2  # nothing of epoch 3 was decided


def test_an_epoch_offset_below_the_cut_epoch_is_refused() -> None:
    h = _fresh_store_over_a_cut_epoch(offset=2)  # the marker's epoch: not enough
    with pytest.raises(ConfigError, match="epoch 3 is partly in"):
        h.core.open_epoch(None)


def test_an_epoch_offset_at_the_cut_epoch_goes_on_after_it() -> None:
    """``epoch_offset=3``: the caller accepts epoch 3 as it is; a replay of it is skipped,
    and implicit numbering goes on at 4."""
    h = _fresh_store_over_a_cut_epoch(offset=3)
    assert h.core.open_epoch(3).skip
    assert h.core.resolve(3) is Resolution.COMMITTED
    assert h.write_epoch() == 4
    assert sorted({e for e, _, _ in h.targets["a"].visible}) == [1, 2, 4]


def test_the_store_that_decided_the_epoch_rolls_it_forward() -> None:
    """With the epoch PENDING in the meta store, parts above the marker are a commit in
    progress, not a refusal: the restarted coordinator completes it."""
    h = Harness(sinks=("a",))
    h.write_epoch()
    h.write_epoch()
    decision = h.core.open_epoch(3)
    assert h.precommit_all(decision.epoch, decision.attempt)
    _cut_at_three(h.targets["a"])
    h.crash()
    assert h.core._marks.partial == {}
    h.commit_all()
    assert h.write_epoch() == 4
    assert sorted({e for e, _, _ in h.targets["a"].visible}) == [1, 2, 3, 4]
