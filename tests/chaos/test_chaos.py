"""The seeded chaos trials (see ``tests.chaos.plan``): each ends exact, row by row."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.chaos.harness import TrialEnv, TrialResult, run_trial
from tests.chaos.plan import SPARK_WAYS, TrialSpec
from tests.chaos.resume import code_of_session

pytestmark = pytest.mark.usefixtures("ray_session")


def _needs_postgres(trial: TrialSpec) -> bool:
    return trial.sink == "postgres" or trial.pg_metastore


@pytest.fixture(scope="module")
def spark_sessions() -> Iterator[dict[str, Any]]:
    """One RayDP session for the module's Spark trials, started at the first of them and
    stopped with the module (the Spark tests start their own)."""
    holder: dict[str, Any] = {}
    yield holder
    if "session" in holder:
        from raysink.spark import stop_spark

        stop_spark()


def _spark(trial: TrialSpec, holder: dict[str, Any]) -> Any:
    if trial.via not in SPARK_WAYS:
        return None
    if "session" not in holder:
        from raysink.spark import init_spark

        # a new app name per session: the stopped one's master actor may keep its name a
        # little while (a restart after an executor kill)
        holder["sessions"] = holder.get("sessions", 0) + 1
        holder["session"] = init_spark(
            f"raysink-chaos-{holder['sessions']}", executors=2, executor_cores=1,
            executor_memory="1g",
            configs={"spark.ui.showConsoleProgress": "false"})
        holder["session"].sparkContext.setLogLevel("ERROR")
    return holder["session"]


def _restart_spark(holder: dict[str, Any]) -> None:
    """After an executor was killed: the next Spark trial starts a fresh session. (RayDP
    registers a restarted executor under a new id and does not always start it, so the
    session may have lost capacity for good.)"""
    from raysink.spark import stop_spark

    if holder.pop("session", None) is not None:
        stop_spark()


@pytest.mark.timeout(600)
def test_trial(trial: TrialSpec, tmp_path: Path, request: pytest.FixtureRequest,
               chaos_results: list[TrialResult], spark_sessions: dict[str, Any],
               trial_log: Path) -> None:
    import ray

    pg = request.getfixturevalue("pg_server") if _needs_postgres(trial) else None
    kafka = (request.getfixturevalue("chaos_kafka_cluster") if trial.fault == "leader_kill"
             else request.getfixturevalue("kafka_broker") if trial.sink == "kafka" else None)

    def restart_spark() -> Any:
        _restart_spark(spark_sessions)
        return _spark(trial, spark_sessions)

    env = TrialEnv(root=tmp_path, ray_address=ray.get_runtime_context().gcs_address, pg=pg,
                   kafka=kafka,
                   spark=_spark(trial, spark_sessions), restart_spark=restart_spark)
    result = run_trial(trial, env)
    chaos_results.append(result)
    with trial_log.open("a") as log:
        line = {**result.as_dict(), "commit": code_of_session(request.config)}
        log.write(json.dumps(line, default=str) + "\n")
    if trial.fault == "executor_kill":
        _restart_spark(spark_sessions)
    assert result.failure is None, f"{trial.name}: {result.failure}\nnotes: {result.notes}"
    for outcome in result.checks:
        assert outcome.ok, (f"{trial.name} sink {outcome.sink}: lost {outcome.lost}, "
                            f"duplicated {outcome.duplicated}, from aborted attempts "
                            f"{outcome.aborted}, uncommitted {outcome.uncommitted}; "
                            f"{outcome.problems}\nnotes: {result.notes}")
