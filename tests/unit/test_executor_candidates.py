"""Which RayDP executor actors a partition fetch asks, and in what order."""

from __future__ import annotations

import contextlib
import time

import pytest

from raysink.spark import partitions as pull
from raysink.spark.handoff import executor_candidates

NAMED = ["raysink-coordinator", "raydp-executor-1", "raydp-executor-0", "RayDPSparkMaster",
         "raydp-executor-3"]


def test_the_located_executor_is_asked_first_then_every_other_live_one() -> None:
    assert executor_candidates("raydp-executor-0", 0, NAMED) == [
        "raydp-executor-0", "raydp-executor-1", "raydp-executor-3"]


def test_others_rotate_by_partition_index() -> None:
    assert executor_candidates("raydp-executor-0", 1, NAMED)[1:] == [
        "raydp-executor-3", "raydp-executor-1"]


def test_a_location_without_an_actor_still_leads_to_the_live_ones() -> None:
    # a restarted executor re-registers with Spark as "2"; its actor keeps the name "-0"
    assert executor_candidates("raydp-executor-2", 0, NAMED) == [
        "raydp-executor-2", "raydp-executor-0", "raydp-executor-1", "raydp-executor-3"]


def test_no_other_executor_leaves_only_the_located_one() -> None:
    assert executor_candidates("raydp-executor-0", 5, ["raydp-executor-0"]) == [
        "raydp-executor-0"]


# ---------------------------------------------------------------- lately unavailable

class _Names:
    """Stands in for ``ray.util.list_named_actors`` (counts its calls)."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> list[str]:
        self.calls += 1
        return NAMED


@pytest.fixture
def names(monkeypatch: pytest.MonkeyPatch) -> _Names:
    import ray.util

    listing = _Names()
    monkeypatch.setattr(ray.util, "list_named_actors", listing)
    monkeypatch.setattr(pull, "_unavailable", {})
    return listing


def test_the_located_executor_alone_is_asked_without_listing_the_others(names: _Names) -> None:
    candidates = pull._candidates("raydp-executor-0", 0)
    assert next(candidates) == "raydp-executor-0"
    assert names.calls == 0


def test_an_executor_that_failed_lately_is_asked_last(names: _Names) -> None:
    pull._unavailable["raydp-executor-0"] = time.monotonic()
    assert list(pull._candidates("raydp-executor-0", 0)) == [
        "raydp-executor-1", "raydp-executor-3", "raydp-executor-0"]
    pull._unavailable["raydp-executor-1"] = time.monotonic()
    assert list(pull._candidates("raydp-executor-3", 0)) == [
        "raydp-executor-3", "raydp-executor-0", "raydp-executor-1"]


def test_a_failure_while_listing_does_not_ask_the_located_one_twice(names: _Names) -> None:
    candidates = pull._candidates("raydp-executor-0", 0)
    assert next(candidates) == "raydp-executor-0"
    pull._unavailable["raydp-executor-0"] = time.monotonic()  # its call just failed
    assert list(candidates) == ["raydp-executor-1", "raydp-executor-3"]


def test_an_old_failure_is_forgotten(names: _Names) -> None:
    pull._unavailable["raydp-executor-0"] = time.monotonic() - pull.UNAVAILABLE_SECONDS - 1
    assert next(pull._candidates("raydp-executor-0", 0)) == "raydp-executor-0"
    assert pull._unavailable == {}


class _SlowExecutor:
    """An executor actor whose calls never answer in time (restarted, no Spark in it)."""

    class _Method:
        def remote(self, *args: object) -> str:
            return "ref"

    getRDDPartition = _Method()  # RayDP's Java method name


@pytest.mark.parametrize("failure", ["timeout", "actor_died"])
def test_an_executor_that_timed_out_or_died_is_asked_last_afterwards(
        names: _Names, monkeypatch: pytest.MonkeyPatch, failure: str) -> None:
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError

    def get(ref: object, timeout: float | None = None) -> object:
        raise GetTimeoutError("timed out") if failure == "timeout" else RayActorError()

    monkeypatch.setattr(ray, "get_actor", lambda name: _SlowExecutor())
    monkeypatch.setattr(ray, "get", get)
    monkeypatch.setattr(pull, "cross_language_calls", contextlib.nullcontext)
    problems: list[str] = []
    assert pull._ask("raydp-executor-0", 1, 0, "{}", "", "", problems, 0.01) is None
    assert problems and problems[0].startswith("raydp-executor-0: ")
    # the next partition located on it asks the others first
    assert list(pull._candidates("raydp-executor-0", 1)) == [
        "raydp-executor-3", "raydp-executor-1", "raydp-executor-0"]
