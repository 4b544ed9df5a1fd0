"""raysink's Prometheus alert rules, from ``AlertSettings``; ``render`` writes them in
Prometheus's rule file format.

``raysink/dashboards/alerts.yaml`` holds the rules with the default settings (generated
with the dashboard: ``python -m raysink.dashboards``; a unit test fails when they
differ); ``raysink dashboard alerts FILE`` writes them with settings of your own. Each
rule groups by ``SessionName`` and ``runtime`` (and ``sink`` where it is about one), over
the same series the dashboard charts.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Literal

from raysink._metrics import METRICS
from raysink.errors import ConfigError

__all__ = ["AlertRule", "AlertSettings", "alert_rules", "render"]

_DURATION = re.compile(r"^(\d+(ms|s|m|h|d|w|y))+$")
_SESSION = ("SessionName", "runtime")


@dataclass(frozen=True, kw_only=True, slots=True)
class AlertSettings:
    """The thresholds of the rules; durations in Prometheus's notation (``90s``, ``5m``,
    ``1h30m``)."""

    stalled_for: str = "5m"
    """A sink stalled this long fires ``RaysinkSinkStalled``."""
    pending_for: str = "5m"
    """A sink holding ``max_pending_epochs`` decided epochs this long (new epochs wait)."""
    commit_p99_seconds: float = 10.0
    """The p99 of one sink's epoch commits over this, for ``commit_p99_for``."""
    commit_p99_for: str = "10m"
    replacements: int = 3
    """This many actor restarts and replacements of one runtime within
    ``replacements_window``."""
    replacements_window: str = "15m"
    rewinds: int = 3
    """This many rewinds of one runtime's stream within ``rewinds_window``."""
    rewinds_window: str = "10m"

    def __post_init__(self) -> None:
        for name in ("stalled_for", "pending_for", "commit_p99_for", "replacements_window",
                     "rewinds_window"):
            value = getattr(self, name)
            if not isinstance(value, str) or not _DURATION.match(value):
                raise ConfigError(f"{name} must be a Prometheus duration such as 90s, 5m or "
                                  f"1h30m; got {value!r}")
        for name in ("commit_p99_seconds", "replacements", "rewinds"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or value <= 0:
                raise ConfigError(f"{name} must be a number above 0; got {value!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class AlertRule:
    """One alerting rule: it fires once ``expr`` has had results for ``for_``."""

    name: str
    expr: str
    for_: str
    severity: Literal["critical", "warning"]
    summary: str
    description: str


def _by(*labels: str) -> str:
    return f"by ({', '.join(labels)})"


def alert_rules(settings: AlertSettings | None = None) -> list[AlertRule]:
    """The rules with ``settings`` (the defaults when ``None``)."""
    s = settings or AlertSettings()
    series = {name: spec.series for name, spec in METRICS.items()}
    where = "runtime {{ $labels.runtime }}"
    sink = f"sink {{{{ $labels.sink }}}} of {where}"
    return [
        AlertRule(
            name="RaysinkSinkStalled", for_=s.stalled_for, severity="critical",
            expr=f'max {_by(*_SESSION, "sink")} '
                 f'({series["sink_state"]}{{state=~"stalled|failed"}}) == 1',
            summary=f"raysink {sink} stalled for more than {s.stalled_for}",
            description="Its commits fail, or a writer cannot reach its target. The other "
                        "sinks go on; this one catches up once its target is back, within "
                        "max_pending_epochs. `raysink status {{ $labels.runtime }}` shows "
                        "the last error. State failed: the data a decided epoch needs is "
                        "lost (DataLossError); it does not come back by itself."),
        AlertRule(
            name="RaysinkTransactionHeld", for_="1m", severity="critical",
            expr=f"max {_by(*_SESSION, 'sink')} ({series['held_seconds']}) > 0",
            summary=f"raysink {sink}: a transaction left open on its target holds its "
                    "commits back",
            description="A Kafka transaction is open on the sink's progress partition "
                        "(a hanging transaction when its marker was never written). "
                        "`raysink status {{ $labels.runtime }}` names the partition, "
                        "producer id, first offset and the kafka-transactions.sh command "
                        "that ends it; raysink ends it itself where it can prove how."),
        AlertRule(
            name="RaysinkPendingEpochsAtLimit", for_=s.pending_for, severity="warning",
            expr=f"max {_by(*_SESSION, 'sink')} ({series['pending_epochs']})\n"
                 f"  >= on ({', '.join(_SESSION)}) group_left ()\n"
                 f"max {_by(*_SESSION)} ({series['max_pending_epochs']})",
            summary=f"raysink {sink} holds max_pending_epochs decided epochs: new epochs "
                    "wait",
            description="Epochs are decided but this sink has not committed them for "
                        f"{s.pending_for}: producers wait for it (backpressure). See "
                        "whether the sink is stalled."),
        AlertRule(
            name="RaysinkCommitLatencyHigh", for_=s.commit_p99_for, severity="warning",
            expr=f"histogram_quantile(0.99, sum {_by(*_SESSION, 'sink', 'le')} "
                 f"(rate({series['epoch_commit_seconds']}_bucket[5m])))\n"
                 f"  > {s.commit_p99_seconds:g}",
            summary=f"raysink {sink}: p99 of epoch commits over "
                    f"{s.commit_p99_seconds:g} s",
            description="One sink's commits of an epoch take long: its target is slow or "
                        "overloaded, or the epochs are large."),
        AlertRule(
            name="RaysinkActorsReplacedRepeatedly", for_="0s", severity="warning",
            expr=f"sum {_by(*_SESSION)} (increase({series['actor_restarts']}"
                 f"[{s.replacements_window}]))\n"
                 f"  + sum {_by(*_SESSION)} (increase({series['actor_replacements']}"
                 f"[{s.replacements_window}]))\n"
                 f"  >= {s.replacements}",
            summary=f"raysink {where}: {s.replacements} or more writer or coordinator "
                    f"restarts and replacements within {s.replacements_window}",
            description="Its actors keep crashing (Ray restarts them) or stop answering (the "
                        "driver replaces them): see the actors' logs and the nodes."),
        AlertRule(
            name="RaysinkStreamRewindLoop", for_="0s", severity="warning",
            expr=f"sum {_by(*_SESSION)} (increase({series['stream_rewinds']}"
                 f"[{s.rewinds_window}]))\n"
                 f"  >= {s.rewinds}",
            summary=f"raysink {where}: its stream rewound {s.rewinds} or more times within "
                    f"{s.rewinds_window}",
            description="Stream epochs keep failing (a producer lost, a target down past "
                        "the retries) and the producers replay from the last committed "
                        "epoch, over and over."),
    ]


def render(rules: list[AlertRule], header: str = "") -> str:
    """The rules as a Prometheus rule file (YAML: expressions as literal blocks, other
    strings JSON-quoted, which YAML reads as they are)."""
    lines = [f"# {line}" for line in header.splitlines()]
    lines += ["groups:", "  - name: raysink", "    rules:"]
    for rule in rules:
        lines.append(f"      - alert: {rule.name}")
        lines.append("        expr: |-")
        lines += [f"          {line}" for line in rule.expr.splitlines()]
        lines.append(f"        for: {rule.for_}")
        lines += ["        labels:", f"          severity: {rule.severity}"]
        lines.append("        annotations:")
        lines.append(f"          summary: {json.dumps(rule.summary)}")
        lines.append(f"          description: {json.dumps(rule.description)}")
    return "\n".join(lines) + "\n"
