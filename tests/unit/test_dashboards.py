"""The shipped dashboard and alert rules, without Ray: generated from their definitions,
every metric charted, every query filtered by the variables, the exported form asks for
a data source, the README answers for every panel; the ``raysink dashboard`` commands.
(Prometheus itself evaluates them in ``tests/integration/test_dashboard.py``.)"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from raysink._metrics import METRICS
from raysink.cli import main
from raysink.dashboards import ALERTS_FILE, DASHBOARD_FILE, alerts_text, dashboard_text
from raysink.dashboards.alerts import AlertSettings, alert_rules
from raysink.dashboards.definition import VARIABLES, panels
from raysink.dashboards.install import DASHBOARD_NAME
from raysink.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
_SELECTOR = re.compile(r"(ray_raysink_\w+)\{([^}]*)\}")
_REGENERATE = "regenerate with: .venv/bin/python -m raysink.dashboards"


def _queries() -> list[str]:
    return [q.expr for p in panels() for q in p.queries]


def test_the_shipped_files_are_generated_from_the_definitions() -> None:
    assert DASHBOARD_FILE.read_text() == dashboard_text(), _REGENERATE
    assert ALERTS_FILE.read_text() == alerts_text(), _REGENERATE


def test_every_metric_is_charted_and_only_raysink_metrics() -> None:
    charted = {name for expr in _queries() for name, _ in _SELECTOR.findall(expr)}
    exported = {m.series + ("_bucket" if m.kind == "histogram" else "")
                for m in METRICS.values()}
    assert charted == exported


def test_every_selector_filters_by_the_variables() -> None:
    sink_series = {m.series for m in METRICS.values() if "sink" in m.tags}
    for expr in _queries():
        for series, filters in _SELECTOR.findall(expr):
            assert 'SessionName=~"$SessionName"' in filters, expr
            assert 'runtime=~"$runtime"' in filters, expr
            has_sink = series.removesuffix("_bucket") in sink_series
            assert ('sink=~"$sink"' in filters) == has_sink, expr


def test_every_panel_says_what_it_answers_and_the_readme_too() -> None:
    readme = (ROOT / "README.md").read_text()
    monitoring = readme[readme.index("## Monitoring"):]
    for panel in panels():
        assert panel.question.endswith("?"), panel.title
        assert f"| {panel.title} | {panel.question} |" in monitoring, panel.title


def _layout(model: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in model["panels"] if p["type"] != "row"]


def test_panels_fit_the_grid_without_overlapping() -> None:
    model = json.loads(dashboard_text())
    taken: set[tuple[int, int]] = set()
    for panel in model["panels"]:
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24, panel["title"]
        cells = {(x, y) for x in range(pos["x"], pos["x"] + pos["w"])
                 for y in range(pos["y"], pos["y"] + pos["h"])}
        assert not cells & taken, panel["title"]
        taken |= cells
    assert len({p["id"] for p in model["panels"]}) == len(model["panels"])
    assert [p["title"] for p in _layout(model)] == [p.title for p in panels()]


def test_the_exported_dashboard_asks_for_a_prometheus_data_source() -> None:
    exported = json.loads(dashboard_text(exported=True))
    assert [i["name"] for i in exported["__inputs"]] == ["DS_PROMETHEUS"]
    assert exported["__inputs"][0]["pluginId"] == "prometheus"
    text = json.dumps(exported)
    assert "${datasource}" not in text
    sources = [p["datasource"] for p in _layout(exported)]
    sources += [t["datasource"] for p in _layout(exported) for t in p["targets"]]
    sources += [v["datasource"] for v in exported["templating"]["list"]]
    assert all(s == {"type": "prometheus", "uid": "${DS_PROMETHEUS}"} for s in sources)
    provisioned = dashboard_text()
    assert "DS_PROMETHEUS" not in provisioned and "__inputs" not in provisioned
    names = [v["name"] for v in json.loads(provisioned)["templating"]["list"]]
    assert names == ["datasource", *(v.name for v in VARIABLES)]


@pytest.mark.parametrize("settings", [
    AlertSettings(),                                        # the defaults that ship
    AlertSettings(stalled_for="90s", commit_p99_seconds=2.5, replacements=5,
                  rewinds_window="1h30m"),                  # every threshold moved
])
def test_the_rules_file_reads_back_as_the_rules(settings: AlertSettings) -> None:
    loaded = yaml.safe_load(alerts_text(settings))
    rules = loaded["groups"][0]["rules"]
    assert [(r["alert"], r["expr"], r["for"], r["labels"]["severity"],
             r["annotations"]["summary"], r["annotations"]["description"]) for r in rules] == [
        (r.name, r.expr, r.for_, r.severity, r.summary, r.description)
        for r in alert_rules(settings)]
    stalled = rules[0]
    assert stalled["alert"] == "RaysinkSinkStalled" and stalled["for"] == settings.stalled_for


@pytest.mark.parametrize("options", [
    {"stalled_for": "5 minutes"},   # not Prometheus's notation
    {"rewinds_window": "10"},       # a unit is required
    {"commit_p99_seconds": 0},      # thresholds are above zero
    {"replacements": -1},
])
def test_alert_settings_refuse_what_prometheus_would_not_take(options: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match=next(iter(options))):
        AlertSettings(**options)


# ---------------------------------------------------------------------------- commands


def _session(tmp_path: Path, *, provisioned: bool) -> Path:
    """A head's session dir as Ray's dashboard leaves it (or without Grafana's files)."""
    session = tmp_path / "ray" / "session_2026-01-01_00-00-00_000000_1"
    grafana = session / "metrics" / "grafana"
    (grafana / "dashboards").mkdir(parents=True)
    if provisioned:
        (grafana / "provisioning" / "dashboards").mkdir(parents=True)
    (tmp_path / "ray" / "session_latest").symlink_to(session)
    return session


def test_install_puts_it_beside_rays_dashboards_and_again_changes_nothing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    session = _session(tmp_path, provisioned=True)
    installed = session / "metrics" / "grafana" / "dashboards" / DASHBOARD_NAME
    assert main(["dashboard", "install", "--temp-dir", str(tmp_path / "ray")]) == 0
    first = capsys.readouterr().out
    assert f"installed: {installed}" in first and "Ray rewrites" in first
    assert installed.read_text() == dashboard_text()
    assert main(["dashboard", "install", "--session-dir", str(session)]) == 0
    again = capsys.readouterr().out
    assert "already installed (unchanged)" in again
    assert sorted(p.name for p in installed.parent.iterdir()) == [DASHBOARD_NAME]


def test_install_without_rays_grafana_files_says_to_import_instead(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    session = _session(tmp_path, provisioned=False)
    assert main(["dashboard", "install", "--session-dir", str(session)]) == 0
    assert "raysink dashboard export" in capsys.readouterr().out


def test_install_follows_rays_folder_variable(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    session = _session(tmp_path, provisioned=True)
    elsewhere = tmp_path / "dashboards"
    monkeypatch.setenv("RAY_METRICS_GRAFANA_DASHBOARD_OUTPUT_DIR", str(elsewhere))
    assert main(["dashboard", "install", "--session-dir", str(session)]) == 0
    assert (elsewhere / DASHBOARD_NAME).read_text() == dashboard_text()


def test_install_without_a_ray_session_is_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["dashboard", "install", "--temp-dir", str(tmp_path)]) == 2
    assert "ray start --head" in capsys.readouterr().err


def test_export_and_alerts_write_their_files(tmp_path: Path) -> None:
    exported, rules = tmp_path / "raysink.json", tmp_path / "alerts.yaml"
    assert main(["dashboard", "export", str(exported)]) == 0
    assert exported.read_text() == dashboard_text(exported=True)
    assert main(["dashboard", "alerts", str(rules), "--stalled-for", "1m"]) == 0
    assert rules.read_text() == alerts_text(AlertSettings(stalled_for="1m"))
    assert main(["dashboard", "alerts", str(rules), "--stalled-for", "soon"]) == 2
