"""Each maintenance crash point through the chaos harness, on Delta and on partitioned
Iceberg: the coordinator SIGKILLed in a pass forced while the fault epoch is written
(``tests.chaos.maintenance``), then every row exactly once, the marker at the last epoch,
every retained version readable, and nothing left that the policy expires or no retained
version references. ``slow``: six runtimes with a coordinator restart each (about two
minutes), left out of the default run and of ``make chaos`` (whose plan has the kind's
trials); run them by path: ``pytest tests/chaos/test_maintenance_points.py``."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from raysink._faults import MAINTENANCE_POINTS
from tests.chaos.harness import TrialEnv, run_trial
from tests.chaos.plan import TrialSpec, make_plan

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.slow,
              pytest.mark.timeout(300)]

SEED = 37


def maintenance_trial(point: str, sink: str) -> TrialSpec:
    """The first ``maintenance_point`` trial of seed ``SEED``'s plan at ``point`` on
    ``sink``, made to kill the coordinator in a forced pass of an ``arrow`` trial (the
    plan's other draws, rows, epochs, policy, kept)."""
    spec = next(t for t in make_plan(SEED, 400)
                if t.fault == "maintenance_point" and (t.point, t.sink) == (point, sink))
    # two versions kept: time travel past the newest is checked too
    policy = {**spec.extra["maintenance"], "every_epochs": 1000, "keep_snapshots": 2}
    return dataclasses.replace(spec, name=f"{spec.name.rsplit('-', 1)[0]}-arrow", via="arrow",
                               how="self", variant="forced", extra={"maintenance": policy})


@pytest.mark.parametrize("sink", ["delta", "iceberg"])
@pytest.mark.parametrize("point", MAINTENANCE_POINTS)
def test_the_coordinator_killed_at_a_maintenance_point_loses_and_doubles_nothing(
        point: str, sink: str, tmp_path: Path) -> None:
    import ray

    spec = maintenance_trial(point, sink)
    env = TrialEnv(root=tmp_path, ray_address=ray.get_runtime_context().gcs_address)
    result = run_trial(spec, env)
    assert result.failure is None, f"{result.failure}\nnotes: {result.notes}"
    assert result.fired, result.notes
    for outcome in result.checks:
        assert outcome.ok, (f"sink {outcome.sink}: lost {outcome.lost}, duplicated "
                            f"{outcome.duplicated}; {outcome.problems}\nnotes: {result.notes}")
