"""The Grafana dashboard model (JSON) of ``raysink.dashboards.definition``.

Two forms of one dashboard:

* provisioned (``raysink.json``, what ``raysink dashboard install`` copies next to
  Ray's own dashboards): panels use the ``$datasource`` variable, a choice among the
  Prometheus data sources (Ray provisions one named ``Prometheus``);
* exported (``raysink dashboard export``): for Grafana's *Import dashboard*, which asks
  for a Prometheus data source through the ``__inputs`` entry ``DS_PROMETHEUS``.

Layout: each row is a collapsible row header, then its panels left to right, two per
line unless a panel is wider.
"""

from __future__ import annotations

from typing import Any

from raysink._metrics import SINK_STATES
from raysink.dashboards.definition import (
    ROWS,
    STATE_COLOURS,
    VARIABLES,
    Panel,
    Query,
    Variable,
)

__all__ = ["GRAFANA_MIN_VERSION", "UID", "dashboard_model"]

UID = "raysink"
GRAFANA_MIN_VERSION = "10.0.0"
_PANEL_HEIGHT = 8
_GRID_WIDTH = 24
_INPUT = "DS_PROMETHEUS"


def _datasource(exported: bool) -> dict[str, str]:
    uid = f"${{{_INPUT}}}" if exported else "${datasource}"
    return {"type": "prometheus", "uid": uid}


def _target(query: Query, ref: str, exported: bool) -> dict[str, Any]:
    return {"datasource": _datasource(exported), "editorMode": "code", "expr": query.expr,
            "legendFormat": query.legend, "range": True, "refId": ref}


def _style_override(query: Query, ref: str) -> dict[str, Any] | None:
    matcher = {"id": "byFrameRefID", "options": ref}
    if query.style == "bars":
        return {"matcher": matcher, "properties": [
            {"id": "custom.drawStyle", "value": "bars"},
            {"id": "custom.fillOpacity", "value": 60}]}
    if query.style == "limit":
        return {"matcher": matcher, "properties": [
            {"id": "custom.lineStyle", "value": {"fill": "dash", "dash": [10, 10]}},
            {"id": "custom.fillOpacity", "value": 0},
            {"id": "color", "value": {"mode": "fixed", "fixedColor": "red"}}]}
    return None


def _timeseries_config(panel: Panel, refs: list[str]) -> dict[str, Any]:
    overrides = [o for q, ref in zip(panel.queries, refs, strict=True)
                 if (o := _style_override(q, ref)) is not None]
    defaults = {"unit": panel.unit, "min": 0, "color": {"mode": "palette-classic"},
                "custom": {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 10,
                           "showPoints": "never", "spanNulls": False}}
    return {"defaults": defaults, "overrides": overrides}


def _state_config() -> dict[str, Any]:
    options = {str(code): {"text": state, "color": STATE_COLOURS[state], "index": code}
               for code, state in enumerate(SINK_STATES)}
    return {"defaults": {"color": {"mode": "thresholds"},
                         "mappings": [{"type": "value", "options": options}],
                         "thresholds": {"mode": "absolute",
                                        "steps": [{"color": "text", "value": None}]},
                         "custom": {"lineWidth": 0, "fillOpacity": 80}},
            "overrides": []}


def _panel(panel: Panel, ident: int, pos: dict[str, int], exported: bool) -> dict[str, Any]:
    refs = [chr(ord("A") + i) for i in range(len(panel.queries))]
    model: dict[str, Any] = {
        "id": ident, "type": panel.kind, "title": panel.title,
        "description": panel.question, "datasource": _datasource(exported), "gridPos": pos,
        "targets": [_target(q, ref, exported) for q, ref in zip(panel.queries, refs,
                                                                  strict=True)]}
    legend = {"showLegend": True, "displayMode": "list", "placement": "bottom"}
    if panel.kind == "state-timeline":
        model["fieldConfig"] = _state_config()
        model["options"] = {"showValue": "auto", "mergeValues": True, "rowHeight": 0.9,
                            "alignValue": "left", "legend": legend,
                            "tooltip": {"mode": "single"}}
    else:
        model["fieldConfig"] = _timeseries_config(panel, refs)
        model["options"] = {"legend": legend, "tooltip": {"mode": "multi", "sort": "desc"}}
    return model


def _panels(exported: bool) -> list[dict[str, Any]]:
    models: list[dict[str, Any]] = []
    y = 0
    for row in ROWS:
        models.append({"id": len(models) + 1, "type": "row", "title": row.title,
                       "collapsed": False, "panels": [],
                       "gridPos": {"h": 1, "w": _GRID_WIDTH, "x": 0, "y": y}})
        y += 1
        x = 0
        for panel in row.panels:
            if x + panel.width > _GRID_WIDTH:
                x, y = 0, y + _PANEL_HEIGHT
            pos = {"h": _PANEL_HEIGHT, "w": panel.width, "x": x, "y": y}
            models.append(_panel(panel, len(models) + 1, pos, exported))
            x += panel.width
        y += _PANEL_HEIGHT
    return models


def _variable(variable: Variable, exported: bool) -> dict[str, Any]:
    query = f"label_values({variable.series}, {variable.name})"
    return {"name": variable.name, "label": variable.label, "type": "query",
            "datasource": _datasource(exported), "definition": query,
            "query": {"query": query, "refId": "StandardVariableQuery"},
            "refresh": 2, "includeAll": True, "allValue": ".+", "multi": variable.multi,
            "sort": 2 if variable.name == "SessionName" else 1, "regex": "", "hide": 0,
            "current": {}, "options": []}


def _templating(exported: bool) -> dict[str, Any]:
    variables = [_variable(v, exported) for v in VARIABLES]
    if not exported:
        variables.insert(0, {"name": "datasource", "label": "Prometheus", "type": "datasource",
                             "query": "prometheus", "refresh": 1, "regex": "", "hide": 0,
                             "current": {}, "options": []})
    return {"list": variables}


def _export_header() -> dict[str, Any]:
    kinds = sorted({p.kind for row in ROWS for p in row.panels})
    return {
        "__inputs": [{"name": _INPUT, "label": "Prometheus", "type": "datasource",
                      "pluginId": "prometheus", "pluginName": "Prometheus",
                      "description": "the Prometheus that scrapes Ray's metrics"}],
        "__requires": [
            {"type": "grafana", "id": "grafana", "name": "Grafana",
             "version": GRAFANA_MIN_VERSION},
            {"type": "datasource", "id": "prometheus", "name": "Prometheus", "version": ""},
            *({"type": "panel", "id": kind, "name": kind, "version": ""} for kind in kinds)],
    }


def dashboard_model(*, exported: bool = False) -> dict[str, Any]:
    """The dashboard as Grafana's JSON model: provisioned, or ``exported`` for import."""
    model: dict[str, Any] = _export_header() if exported else {}
    model.update({
        "id": None, "uid": UID, "title": "raysink",
        "description": "raysink's exactly-once sinks on Ray: throughput, epochs and "
                       "commits, sink health, writers' mailboxes and backpressure, Spark "
                       "pulls.",
        "tags": ["raysink", "ray"], "editable": True, "graphTooltip": 1,
        "refresh": "30s", "schemaVersion": 39, "version": 1,
        "time": {"from": "now-1h", "to": "now"}, "timepicker": {}, "timezone": "",
        "annotations": {"list": []}, "links": [],
        "templating": _templating(exported), "panels": _panels(exported)})
    return model
