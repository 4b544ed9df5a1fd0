"""raysink's Grafana dashboard and Prometheus alert rules, shipped in the package.

==================  ==============================================================
``definition``      the dashboard as data: panels, their questions, queries, units
``grafana``         the definition as Grafana's JSON model (provisioned, exported)
``alerts``          the alert rules and their settings, in Prometheus's rule format
``install``         where a running Ray head's Grafana provisioning reads dashboards
``raysink.json``    generated: the provisioned dashboard
``alerts.yaml``     generated: the rules with the default settings
==================  ==============================================================

Regenerate the two files after changing a definition with ``python -m
raysink.dashboards`` (``make dashboards``); a unit test fails while they differ.
"""

from __future__ import annotations

import json
from pathlib import Path

from raysink.dashboards.alerts import AlertSettings, alert_rules, render
from raysink.dashboards.grafana import dashboard_model

__all__ = ["ALERTS_FILE", "DASHBOARD_FILE", "alerts_text", "dashboard_text", "write_files"]

HERE = Path(__file__).resolve().parent
DASHBOARD_FILE = HERE / "raysink.json"
ALERTS_FILE = HERE / "alerts.yaml"
_GENERATED = ("generated from raysink/dashboards/alerts.py by `python -m raysink.dashboards`;"
              " do not edit.\nWrite them with other thresholds: raysink dashboard alerts FILE "
              "--help")


def dashboard_text(*, exported: bool = False) -> str:
    """The dashboard's JSON text: provisioned, or ``exported`` for Grafana's import."""
    return json.dumps(dashboard_model(exported=exported), indent=2) + "\n"


def alerts_text(settings: AlertSettings | None = None) -> str:
    """The alert rules' YAML text (default settings when ``None``)."""
    return render(alert_rules(settings), header=_GENERATED)


def write_files() -> list[Path]:
    """Regenerate ``raysink.json`` and ``alerts.yaml`` from the definitions."""
    DASHBOARD_FILE.write_text(dashboard_text())
    ALERTS_FILE.write_text(alerts_text())
    return [DASHBOARD_FILE, ALERTS_FILE]
