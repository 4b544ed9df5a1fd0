"""The chaos plan (``tests.chaos.plan``): every block covers the ways in and the
producer kills, every block after the first restarts the Kafka broker mid-epoch and
mid-commit, plans are prefixes of longer plans, the default sample stays cheap."""

from __future__ import annotations

import pytest

from raysink._faults import MAINTENANCE_POINTS
from tests.chaos.plan import (
    BLOCK,
    BROKER_MID_COMMIT,
    BROKER_MID_EPOCH,
    LATER_BLOCKS,
    PRODUCER_WAYS,
    SPARK_WAYS,
    WAYS_IN,
    make_plan,
    sample,
)

SEEDS = (1, 2, 21, 97)


def _blocks(seed: int, count: int) -> list[list[tuple[str, str]]]:
    """The plan's first ``count`` blocks as (fault, way in), the later blocks' additions
    (node losses, broker restarts) left out."""
    later = {kind for kind, _ in LATER_BLOCKS}
    plan = [(t.fault, t.via)
            for t in make_plan(seed, count * (len(BLOCK) + len(LATER_BLOCKS)))]
    plain = [item for item in plan if item[0] not in later]
    return [plain[k * len(BLOCK):(k + 1) * len(BLOCK)] for k in range(count)]


@pytest.mark.parametrize("seed", SEEDS)
def test_every_block_kills_producers_and_kills_actors_during_streams_and_datasinks(
        seed: int) -> None:
    for block in _blocks(seed, 3):
        for way in PRODUCER_WAYS:
            assert ("producer_kill", way) in block, (way, block)
        for kind in ("writer_point", "coordinator_point"):
            assert (kind, "stream") in block and (kind, "datasink") in block, block
        killed = {way for kind, way in block
                  if kind in ("writer_point", "coordinator_point", "point_external")}
        assert killed >= set(WAYS_IN), (killed, block)


@pytest.mark.parametrize("seed", SEEDS)
def test_the_first_block_holds_every_way_in_with_writer_or_coordinator_kills(
        seed: int) -> None:
    first = make_plan(seed, len(BLOCK))
    assert not {t.fault for t in first} & {"node_loss", "broker_restart"}
    assert "kafka" not in {t.sink for t in first}
    killed = {t.via for t in first if t.victim in ("writer", "coordinator")}
    assert killed >= set(WAYS_IN)


def test_a_plan_is_a_prefix_of_any_longer_plan() -> None:
    short, long = make_plan(5, 30), make_plan(5, 90)
    assert [t.as_dict() for t in short] == [t.as_dict() for t in long[:30]]


@pytest.mark.parametrize("seed", SEEDS)
def test_the_sample_is_the_first_block_without_spark_or_driver_kills(seed: int) -> None:
    chosen = sample(seed)
    assert all(t.index < len(BLOCK) for t in chosen)
    assert not any(t.via in SPARK_WAYS or t.fault in ("driver_kill", "executor_kill")
                   for t in chosen)
    kinds = {(t.fault, t.via) for t in chosen}
    for way in PRODUCER_WAYS:
        assert ("producer_kill", way) in kinds
    assert {("writer_point", "stream"), ("coordinator_point", "stream"),
            ("writer_point", "datasink"), ("coordinator_point", "datasink")} <= kinds


def test_producer_kills_name_their_victim() -> None:
    victims = {t.via: t.victim for t in make_plan(3, 60) if t.fault == "producer_kill"}
    assert victims["stream"] == "stream_producer"
    assert victims["datasink"] == "write_task"
    assert victims["feeds"] in ("feed_task", "feed_actor")


@pytest.mark.parametrize("seed", SEEDS)
def test_every_later_block_restarts_the_broker_mid_epoch_and_mid_commit(seed: int) -> None:
    size = len(BLOCK) + len(LATER_BLOCKS)
    plan = make_plan(seed, len(BLOCK) + 3 * size)
    for k in range(3):
        block = plan[len(BLOCK) + k * size:len(BLOCK) + (k + 1) * size]
        restarts = [t for t in block if t.fault == "broker_restart"]
        assert [t.sink for t in restarts] == ["kafka", "kafka"], block
        assert sorted(str(t.variant) for t in restarts) == ["mid_commit", "mid_epoch"]
        for t in restarts:
            points = BROKER_MID_COMMIT if t.variant == "mid_commit" else BROKER_MID_EPOCH
            assert t.point in points and t.victim == "broker"
        assert [t.fault for t in block].count("node_loss") == 1


def test_kafka_targets_come_under_other_faults_too() -> None:
    later = [t for seed in SEEDS for t in make_plan(seed, 120)[len(BLOCK):]]
    kinds = {t.fault for t in later if t.sink == "kafka"}
    assert kinds > {"broker_restart"}, kinds
    assert not kinds & {"stall_commit", "node_loss", "pg_restart", "fs_full", "fs_readonly"}


@pytest.mark.parametrize("seed", (*SEEDS, 1126))
def test_a_datasink_fault_epoch_carries_rows(seed: int) -> None:
    """A Ray Data write of an empty dataset stages nothing and its epoch commits without
    the sinks, so a fault at a commit point of it would never fire (seed 1126, trial 218)."""
    trials = [t for t in make_plan(seed, 700) if t.via == "datasink"]
    assert trials
    assert all(t.rows[t.fault_epoch - 1] >= 1 for t in trials)


@pytest.mark.parametrize("seed", SEEDS)
def test_every_later_block_kills_a_leader_on_the_cluster(seed: int) -> None:
    """One ``leader_kill`` per block from the second on, on a Kafka target; never in the
    first block (the default sample starts no cluster)."""
    size = len(BLOCK) + len(LATER_BLOCKS)
    plan = make_plan(seed, len(BLOCK) + 3 * size)
    assert "leader_kill" not in {t.fault for t in plan[:len(BLOCK)]}
    assert "leader_kill" not in {t.fault for t in sample(seed)}
    for k in range(3):
        block = plan[len(BLOCK) + k * size:len(BLOCK) + (k + 1) * size]
        kills = [t for t in block if t.fault == "leader_kill"]
        assert len(kills) == 1 and kills[0].sink == "kafka", block
        kill = kills[0]
        points = BROKER_MID_COMMIT if kill.variant == "mid_commit" else BROKER_MID_EPOCH
        assert kill.point in points and kill.victim in ("progress", "data")
        assert kill.fault_epoch >= 2  # both topics exist by then


def test_seed_29s_t0021_is_still_its_broker_restart() -> None:
    """``make chaos SEED=29 TRIALS=40 -k t0021`` runs the trial issue 36 was found with:
    kinds added to the later blocks go last, so the trials drawn before stay put."""
    trial = make_plan(29, 40)[21]
    assert trial.name == "chaos-s29-t0021-brokerrestart-feeds"
    assert (trial.sink, trial.variant, trial.point) == ("kafka", "mid_epoch", None)


@pytest.mark.parametrize("seed", (*SEEDS, 29, 4242))
def test_maintenance_points_come_on_delta_and_iceberg_with_every_point(seed: int) -> None:
    """A 1,000-trial plan kills or fails a maintenance pass at every maintenance crash
    point on Delta and on Iceberg (each pair in every six such trials), in forced and
    automatic passes, and never on another target or in the default sample."""
    trials = [t for t in make_plan(seed, 1000) if t.fault == "maintenance_point"]
    assert {t.sink for t in trials} == {"delta", "iceberg"}
    assert {(t.sink, t.point) for t in trials} == {
        (sink, point) for sink in ("delta", "iceberg") for point in MAINTENANCE_POINTS}
    for k in range(0, len(trials) - 5, 6):
        assert len({(t.sink, t.point) for t in trials[k:k + 6]}) == 6
    assert {t.variant for t in trials} == {"forced", "auto"}
    assert {t.how for t in trials} == {"self", "raise"}
    for t in trials:
        assert t.victim == "coordinator" and 2 <= t.fault_epoch < t.epochs
        policy = t.extra["maintenance"]
        assert policy["min_interval_s"] == 0 and policy["keep_seconds"] == 0
        assert policy["every_epochs"] == (1 if t.variant == "auto" else 1000)
        assert all(rows >= 20 for rows in t.rows[:t.fault_epoch - 1])
        if (t.sink, t.point) == ("iceberg", "maintenance.mid_cleanup"):
            assert policy["keep_snapshots"] == 1  # an expiry deletes two files or more
    assert "maintenance_point" not in {t.fault for t in sample(seed)}
    size = len(BLOCK) + len(LATER_BLOCKS)
    plan = make_plan(seed, len(BLOCK) + 3 * size)
    for k in range(3):  # one in each block from the second on
        block = plan[len(BLOCK) + k * size:len(BLOCK) + (k + 1) * size]
        assert [t.fault for t in block].count("maintenance_point") == 1
