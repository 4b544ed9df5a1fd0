"""Options and fixtures of the chaos suite.

``--chaos-seed`` (default 1) and ``--chaos-trials`` choose the trials: without
``--chaos-trials``, the default test run's sample (``tests.chaos.plan.sample``: the first
block of the seed's plan, its trials that need no RayDP session and no second driver);
with it, the plan's first N trials. ``--chaos-report`` names the directory the report
goes to (default ``bench/out/chaos``). ``make chaos SEED=1 TRIALS=200`` runs the full
suite. ``--chaos-resume`` (``make chaos ... RESUME=1``) runs only the trials the trial log
does not hold yet for this commit and reports on all of them (``tests.chaos.resume``): a
1000-trial run in pieces.
The report (JSON and Markdown) is written and printed at the end of the session.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.chaos.harness import TrialResult
from tests.chaos.plan import TrialSpec, make_plan, sample
from tests.chaos.report import markdown, summarise, write_report
from tests.chaos.resume import code_of_session, finished

DEFAULT_SEED = 1
_REPO = Path(__file__).resolve().parents[2]
_RESULTS = pytest.StashKey[list[TrialResult]]()
_EARLIER = pytest.StashKey[dict[str, TrialResult]]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("chaos", "raysink chaos suite")
    group.addoption("--chaos-seed", type=int, default=None,
                    help=f"seed of the chaos trials (default {DEFAULT_SEED})")
    group.addoption("--chaos-trials", type=int, default=None,
                    help="the plan's first N trials (default: the sample of the default "
                         "test run, from the first block)")
    group.addoption("--chaos-report", default=None,
                    help="directory for the chaos report (default bench/out/chaos)")
    group.addoption("--chaos-resume", action="store_true", default=False,
                    help="skip the trials the trial log holds for this commit; report on "
                         "all of them")
    group.addoption("--chaos-resume-from", default=None,
                    help="with --chaos-resume: earlier commits (comma-separated) whose "
                         "passed trials count too (a harness change that cannot alter a "
                         "passed trial); their failed trials run again")


def _option(config: pytest.Config, name: str, default: Any) -> Any:
    try:
        value = config.getoption(name)
    except (ValueError, AttributeError):
        value = None
    return default if value is None else value


def chaos_seed(config: pytest.Config) -> int:
    return int(_option(config, "--chaos-seed", DEFAULT_SEED))


def chaos_plan(config: pytest.Config) -> list[TrialSpec]:
    trials = _option(config, "--chaos-trials", None)
    seed = chaos_seed(config)
    return sample(seed) if trials is None else make_plan(seed, int(trials))


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "trial" in metafunc.fixturenames:
        plan = chaos_plan(metafunc.config)
        earlier = _earlier(metafunc.config, plan)
        plan = [spec for spec in plan if spec.name not in earlier]
        metafunc.parametrize("trial", plan, ids=[spec.name for spec in plan])


def _earlier(config: pytest.Config, plan: list[TrialSpec]) -> dict[str, TrialResult]:
    """With ``--chaos-resume``: the plan's trials the log holds for this commit."""
    if not _option(config, "--chaos-resume", False):
        return config.stash.setdefault(_EARLIER, {})
    if _EARLIER not in config.stash:
        log = report_dir(config) / f"trials-seed{chaos_seed(config)}.jsonl"
        earlier = str(_option(config, "--chaos-resume-from", "") or "")
        config.stash[_EARLIER] = finished(log, code_of_session(config),
                                          [spec.name for spec in plan],
                                          [c for c in earlier.split(",") if c])
    return config.stash[_EARLIER]


@pytest.fixture(scope="session")
def chaos_results(request: pytest.FixtureRequest) -> list[TrialResult]:
    """Every trial's result, for the report at the end of the session."""
    return request.config.stash.setdefault(_RESULTS, [])


@pytest.fixture(scope="session")
def chaos_kafka_cluster_session() -> Iterator[Any]:
    """The ``leader_kill`` trials' three-broker cluster: started at the first of them
    (``request.getfixturevalue``), so a session without one starts none."""
    from tests.support.kafka_cluster import started_cluster

    cluster = started_cluster(brokers=3)
    try:
        yield cluster
    finally:
        cluster.cleanup()


@pytest.fixture
def chaos_kafka_cluster(chaos_kafka_cluster_session: Any) -> Any:
    """The session's cluster whole again (every node up, every partition in sync)."""
    chaos_kafka_cluster_session.restore()
    return chaos_kafka_cluster_session


def report_dir(config: pytest.Config) -> Path:
    return Path(_option(config, "--chaos-report", _REPO / "bench" / "out" / "chaos"))


@pytest.fixture(scope="session")
def trial_log(request: pytest.FixtureRequest) -> Path:
    """One JSON line per finished trial, appended as it ends (a long run that stops
    half-way keeps what it found): ``trials-seed<N>.jsonl`` in the report directory."""
    directory = report_dir(request.config)
    directory.mkdir(parents=True, exist_ok=True)
    return directory / f"trials-seed{chaos_seed(request.config)}.jsonl"


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    earlier = config.stash.get(_EARLIER, {})
    results = list(earlier.values()) + config.stash.get(_RESULTS, [])
    if not results:
        return
    if earlier:
        terminalreporter.write_line(f"chaos: {len(earlier)} trials from earlier sessions "
                                    f"on this commit, {len(results) - len(earlier)} now")
    summary = summarise(results, seed=chaos_seed(config), trials=len(chaos_plan(config)))
    json_path, md_path = write_report(summary, report_dir(config))
    terminalreporter.write_sep("=", "raysink chaos report")
    terminalreporter.write_line(markdown(summary))
    terminalreporter.write_line(f"report: {json_path} and {md_path}")
