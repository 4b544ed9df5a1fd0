"""The shipped dashboard and alert rules against a real Prometheus scraping the test's Ray.

One runtime with a Parquet and a PostgreSQL sink writes six epochs. A Parquet writer is
killed before epoch 4 (Ray restarts it); PostgreSQL stops right after epoch 5 is decided
and stays down until the stalled-sink alert fires. Then every query of every panel, and
every variable, is evaluated through Prometheus's HTTP API: each answers with series that
carry its labels, and the values agree with ``rt.status()`` and the epochs' reports.

Ray's metrics reach Prometheus late: each process reports to its node's metrics agent
every ``metrics_report_interval_ms`` (10 s, Ray's default, kept), so the checks poll.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import ray

from raysink import SinkRuntime
from raysink.dashboards import ALERTS_FILE, alerts_text
from raysink.dashboards.alerts import AlertSettings, alert_rules
from raysink.dashboards.definition import RATE, VARIABLES, Panel, panels
from raysink.reports import EpochReport
from raysink.testing import arm_fault
from tests.integration.helpers import epoch_table, run_in_thread, sigkill, wait_fired
from tests.integration.real_targets import ParquetTarget, PostgresTarget, assert_ids_exact
from tests.support.postgres import PostgresServer
from tests.support.prometheus import PrometheusServer, promtool, ray_metrics_targets

T = TypeVar("T")
ROWS = 300
SINKS = ("db", "lake")
FAST = AlertSettings(stalled_for="2s")  # the stalled-sink alert fires soon in the test
WAIT = 60.0  # seconds a metric may take to show (a 10 s report interval, then a scrape)


@pytest.fixture(scope="module")
def prometheus(ray_session: None) -> Iterator[PrometheusServer]:
    """Prometheus scraping the session's Ray every second, with the rules of ``FAST``."""
    server = PrometheusServer(ray_metrics_targets(), [])
    rules = server.root / "alerts.yaml"
    rules.write_text(alerts_text(FAST))
    server.rule_files.append(rules)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.parametrize("rules", [
    ALERTS_FILE,  # what ships: the default settings
    None,         # the test's: a stalled sink fires after 2 s
])
def test_the_alert_rules_pass_promtool(rules: Path | None, tmp_path: Path) -> None:
    if rules is None:
        rules = tmp_path / "alerts.yaml"
        rules.write_text(alerts_text(FAST))
    checked = promtool("check", "rules", str(rules))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"SUCCESS: {len(alert_rules())} rules found" in checked.stdout, checked.stdout


def test_every_panel_answers_and_agrees_with_status(
        prometheus: PrometheusServer, pg_server: PostgresServer, schema: str,
        tmp_path: Path, name: str, meta: str) -> None:
    lake, db = ParquetTarget(tmp_path / "lake"), PostgresTarget(pg_server, schema)
    substitute = _variables(name)
    with SinkRuntime(name, {"db": db.sink(), "lake": lake.sink()}, writers=2, metastore=meta,
                     retry_cap=1.0, progress=False) as rt:
        reports = [rt.write_arrow(epoch_table(epoch, ROWS)) for epoch in (1, 2, 3)]
        _kill_and_await_restart(rt, "lake", 0)
        reports.append(rt.write_arrow(epoch_table(4, ROWS)))
        reports.append(_epoch_5_with_postgres_down(rt, prometheus, pg_server, substitute))
        reports.append(rt.write_arrow(epoch_table(6, ROWS)))
        assert all(r.committed for r in reports), reports
        _until(lambda: not _stalled_alerts(prometheus, name), WAIT,
               "the stalled-sink alert resolved once PostgreSQL was back")
        _until(lambda: _agrees(prometheus, rt, reports, substitute), WAIT,
               "Prometheus's values agree with rt.status() and the reports")
        _check_every_query(prometheus, substitute)
        restarts = _sum(prometheus, f'ray_raysink_actor_restarts_total{{runtime="{name}", '
                                    'role="writer"}')
        assert restarts == 1.0
        retries = _by_sink(prometheus, f'sum by (sink) (ray_raysink_commit_retries_total'
                                       f'{{runtime="{name}"}})')
        assert retries["db"] >= 1 and retries["lake"] == 0, retries
    for target in (lake, db):
        assert_ids_exact(target.ids(), [1, 2, 3, 4, 5, 6], ROWS)


# ---------------------------------------------------------------------------- the run


def _kill_and_await_restart(rt: SinkRuntime, sink: str, index: int) -> None:
    """SIGKILL one writer's process and wait until Ray restarted it (a new pid)."""
    actors = rt._actors
    assert actors is not None
    writer = actors.writers[sink][index]
    pid = ray.get(writer.ping.remote())
    sigkill(pid)
    _until(lambda: _new_pid(writer, pid), WAIT, f"Ray restarted {sink} writer {index}")


def _new_pid(writer: Any, old: int) -> bool:
    try:
        return bool(ray.get(writer.ping.remote(), timeout=5) != old)
    except Exception:  # still restarting
        return False


def _epoch_5_with_postgres_down(rt: SinkRuntime, prometheus: PrometheusServer,
                                pg: PostgresServer, substitute: Callable[[str], str]
                                ) -> EpochReport:
    """Epoch 5 is decided, then PostgreSQL stops before its commit: the Parquet sink
    commits it, the PostgreSQL sink stalls. While it is down the stalled-sink alert fires
    (for it alone) and Prometheus shows what ``rt.status()`` shows. Then it comes back and
    the epoch commits there too."""
    arm_fault(rt.name, "coordinator.after_pending", action="sleep", seconds=2.0,
              when={"epoch": 5})
    thread, box = run_in_thread(lambda: rt.write_arrow(epoch_table(5, ROWS)))
    wait_fired(rt.name, "coordinator.after_pending")
    pg.stop("immediate")
    try:
        alerts = _until(lambda: [a for a in _stalled_alerts(prometheus, rt.name)
                                 if a["state"] == "firing"], WAIT,
                        "the stalled-sink alert fires while PostgreSQL is down")
        assert {a["labels"]["sink"] for a in alerts} == {"db"}, alerts
        status = rt.status()
        assert status.sinks["db"].state == "stalled", status
        assert status.sinks["lake"].state == "running", status
        _until(lambda: _agrees_while_stalled(prometheus, rt, substitute), WAIT,
               "Prometheus shows the stalled sink, its pending epoch and the committed ones")
    finally:
        pg.start()
    thread.join(timeout=120)
    assert not thread.is_alive() and "error" not in box, box.get("error")
    report: EpochReport = box["result"]
    return report


# ---------------------------------------------------------------------------- checks


def _stalled_alerts(prometheus: PrometheusServer, runtime: str) -> list[dict[str, Any]]:
    return [a for a in prometheus.alerts()
            if a["labels"].get("alertname") == "RaysinkSinkStalled"
            and a["labels"].get("runtime") == runtime]


def _agrees_while_stalled(prometheus: PrometheusServer, rt: SinkRuntime,
                          substitute: Callable[[str], str]) -> bool:
    status = rt.status()
    states = _by_sink(prometheus, substitute(_panel("Sink state").queries[0].expr))
    pending = _by_sink(prometheus, substitute(_panel(
        "Epochs pending, against max_pending_epochs").queries[0].expr))
    behind = {sink: sum(1 for e in status.pending_epochs
                        if info.last_committed_epoch is None or e > info.last_committed_epoch)
              for sink, info in status.sinks.items()}
    return (states == {s: float(_code(i.state)) for s, i in status.sinks.items()}
            and pending == {s: float(n) for s, n in behind.items()} and behind["db"] == 1
            and _last_committed_agree(prometheus, rt, substitute))


def _agrees(prometheus: PrometheusServer, rt: SinkRuntime, reports: list[EpochReport],
            substitute: Callable[[str], str]) -> bool:
    """Rows committed per sink are the reports' rows; the last committed epochs and the
    states are the status's."""
    status = rt.status()
    rows = _by_sink(prometheus, f'sum by (sink) (ray_raysink_rows_committed_total'
                                f'{{runtime="{rt.name}"}})')
    states = _by_sink(prometheus, substitute(_panel("Sink state").queries[0].expr))
    expected_rows = float(sum(r.rows for r in reports))
    return (rows == dict.fromkeys(SINKS, expected_rows)
            and states == {s: float(_code(i.state)) for s, i in status.sinks.items()}
            and _last_committed_agree(prometheus, rt, substitute))


def _last_committed_agree(prometheus: PrometheusServer, rt: SinkRuntime,
                          substitute: Callable[[str], str]) -> bool:
    status = rt.status()
    shown = _by_sink(prometheus, substitute(_panel("Last committed epoch").queries[0].expr))
    return shown == {s: float(i.last_committed_epoch or 0) for s, i in status.sinks.items()}


TABLE_ONLY = ("table_", "maintenance_last_timestamp")
"""Gauges set only for a sink that maintains a table (Delta, Iceberg) once a pass ran:
this runtime's Parquet and PostgreSQL sinks have none (``test_maintenance`` shows them in
``status()``, which the gauges are set from)."""


def _check_every_query(prometheus: PrometheusServer, substitute: Callable[[str], str]) -> None:
    """Every query of every panel answers with at least one series carrying its labels
    (this runtime's, and one of its sinks, roles or writers); every variable has values."""
    allowed = {"sink": set(SINKS), "role": {"writer", "coordinator"}, "writer": {"0", "1"}}
    for panel in panels():
        for query in panel.queries:
            result = prometheus.query(substitute(query.expr))
            where = f"{panel.title!r}: {query.expr}"
            if not result and any(f"ray_raysink_{g}" in query.expr for g in TABLE_ONLY):
                continue  # a table's size: none of this runtime's sinks maintains a table
            assert result, f"no series for {where}"
            for series in result:
                labels = series["metric"]
                assert set(query.by) <= set(labels), f"{labels} lack {query.by} in {where}"
                assert labels["runtime"] == substitute("$runtime"), where
                for label, values in allowed.items():
                    assert label not in query.by or labels[label] in values, (labels, where)
    for variable in VARIABLES:
        found = prometheus.series(substitute(variable.series))
        assert found and all(variable.name in s for s in found), variable


# ---------------------------------------------------------------------------- helpers


def _variables(runtime: str) -> Callable[[str], str]:
    """A query as Grafana sends it with this session, this runtime and every sink chosen
    (``$__rate_interval`` a window long enough for the whole run)."""
    session = ray._private.worker.global_worker.node.session_name
    values = {"$SessionName": session, "$runtime": runtime, "$sink": ".+", RATE: "5m"}

    def substitute(expr: str) -> str:
        for variable in sorted(values, key=len, reverse=True):
            expr = expr.replace(variable, values[variable])
        return expr

    return substitute


def _panel(title: str) -> Panel:
    return next(p for p in panels() if p.title == title)


def _code(state: str) -> int:
    from raysink._metrics import SINK_STATES

    return SINK_STATES.index(state)


def _by_sink(prometheus: PrometheusServer, expr: str) -> dict[str, float]:
    found = {s["metric"]["sink"]: float(s["value"][1]) for s in prometheus.query(expr)}
    return {sink: value for sink, value in found.items() if not math.isnan(value)}


def _sum(prometheus: PrometheusServer, selector: str) -> float:
    result = prometheus.query(f"sum({selector})")
    return float(result[0]["value"][1]) if result else 0.0


def _until(condition: Callable[[], T], seconds: float, what: str) -> T:
    deadline = time.monotonic() + seconds
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {seconds:g} s: {what}")
        time.sleep(1.0)
