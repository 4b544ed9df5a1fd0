"""Which RayDP executor actors a partition fetch asks, and in what order."""

from __future__ import annotations

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
