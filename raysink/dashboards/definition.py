"""The raysink dashboard as data: rows of panels, each with the question it answers, its
unit and its PromQL queries, and the variables the queries filter by.

``raysink/dashboards/raysink.json`` is generated from this module (``python -m
raysink.dashboards``, or ``make dashboards``); a unit test fails when they differ. Every
metric of ``raysink._metrics.METRICS`` is charted, and a query naming any other fails at
import.

Every query filters by the three variables: ``$SessionName`` (Ray's label: one Ray
cluster's run), ``$runtime`` and, where the metric has a sink, ``$sink``; and sums or
takes the maximum over Ray's per-process labels (``WorkerId``, ``NodeAddress``), so a
restarted writer or a replaced coordinator does not split a line. ``Query.by`` names the
labels each of its series carries.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from raysink._metrics import METRICS, SINK_STATES

__all__ = ["ROWS", "STATE_COLOURS", "VARIABLES", "Panel", "Query", "Row", "Variable",
           "panels", "selector"]

RATE = "$__rate_interval"
"""Grafana's window for ``rate`` and ``increase`` (at least four scrape intervals)."""

STATE_COLOURS = {"starting": "blue", "running": "green", "stalled": "red",
                 "paused": "text", "dropped": "purple", "failed": "dark-red"}


@dataclass(frozen=True, kw_only=True, slots=True)
class Query:
    """One PromQL query: its series carry the labels ``by``; ``style`` draws it as a line,
    as bars (counts of events), or as a dashed red limit."""

    expr: str
    legend: str
    by: tuple[str, ...]
    style: Literal["line", "bars", "limit"] = "line"


@dataclass(frozen=True, kw_only=True, slots=True)
class Panel:
    """One chart. ``question``: what it answers (its description in Grafana, and the
    README's). ``unit``: a Grafana unit id."""

    title: str
    question: str
    unit: str
    queries: tuple[Query, ...]
    kind: Literal["timeseries", "state-timeline"] = "timeseries"
    width: int = 12


@dataclass(frozen=True, kw_only=True, slots=True)
class Row:
    title: str
    panels: tuple[Panel, ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class Variable:
    """A dashboard variable: the values of label ``name`` on ``series``."""

    name: str
    label: str
    series: str
    multi: bool = True


# ---------------------------------------------------------------------------- PromQL


def selector(metric: str, suffix: str = "", **match: str) -> str:
    """``metric``'s series (``suffix``: ``_bucket`` of a histogram), filtered by the
    dashboard's variables and ``match`` (label="value" pairs)."""
    spec = METRICS[metric]
    filters = ['SessionName=~"$SessionName"', 'runtime=~"$runtime"']
    if "sink" in spec.tags:
        filters.append('sink=~"$sink"')
    filters += [f'{label}="{value}"' for label, value in match.items()]
    return f"{spec.series}{suffix}{{{', '.join(filters)}}}"


def _by(labels: tuple[str, ...]) -> str:
    return f"by ({', '.join(labels)})"


def _rate(metric: str, by: tuple[str, ...]) -> str:
    return f"sum {_by(by)} (rate({selector(metric)}[{RATE}]))"


def _increase(metric: str, by: tuple[str, ...]) -> str:
    return f"sum {_by(by)} (increase({selector(metric)}[{RATE}]))"


def _latest(metric: str, by: tuple[str, ...]) -> str:
    return f"max {_by(by)} ({selector(metric)})"


def _quantile(q: float, metric: str, by: tuple[str, ...]) -> str:
    buckets = f"rate({selector(metric, '_bucket')}[{RATE}])"
    return f"histogram_quantile({q}, sum {_by((*by, 'le'))} ({buckets}))"


def _state_code(by: tuple[str, ...]) -> str:
    """One series per sink whose value numbers its state (``SINK_STATES`` order), from
    the one-hot ``sink_state``."""
    parts = [f"({selector('sink_state', state=state)} == 1) * {code}"
             for code, state in enumerate(SINK_STATES)]
    return f"max {_by(by)} ({' or '.join(parts)})"


RUNTIME = ("runtime",)
SINK = ("runtime", "sink")
WRITER = ("runtime", "sink", "writer")
ROLE = ("runtime", "role")

# ---------------------------------------------------------------------------- panels

_THROUGHPUT = Row(title="Throughput", panels=(
    Panel(title="Rows per second, written and committed",
          question="How fast does each sink take rows in, and how fast do they become "
                   "visible in its target?",
          unit="suffix: rows/s", queries=(
              Query(expr=_rate("rows_written", SINK), by=SINK,
                    legend="{{runtime}}/{{sink}} written"),
              Query(expr=_rate("rows_committed", SINK), by=SINK,
                    legend="{{runtime}}/{{sink}} committed"))),
    Panel(title="Bytes per second written",
          question="How many Arrow bytes per second do each sink's writers apply?",
          unit="Bps", queries=(
              Query(expr=_rate("bytes_written", SINK), by=SINK,
                    legend="{{runtime}}/{{sink}}"),)),
))

_EPOCHS = Row(title="Epochs and commits", panels=(
    Panel(title="Epoch commit latency, p50 and p99",
          question="How long does each sink take to commit one epoch?",
          unit="s", queries=(
              Query(expr=_quantile(0.5, "epoch_commit_seconds", SINK), by=SINK,
                    legend="{{runtime}}/{{sink}} p50"),
              Query(expr=_quantile(0.99, "epoch_commit_seconds", SINK), by=SINK,
                    legend="{{runtime}}/{{sink}} p99"))),
    Panel(title="Last committed epoch",
          question="Which epoch has each sink made visible, and is one sink behind the "
                   "others?",
          unit="none", queries=(
              Query(expr=_latest("last_committed_epoch", SINK), by=SINK,
                    legend="{{runtime}}/{{sink}}"),)),
    Panel(title="Epochs pending, against max_pending_epochs",
          question="How many decided epochs wait for each sink's commit, and how close is "
                   "that to the limit at which new epochs wait?",
          unit="none", queries=(
              Query(expr=_latest("pending_epochs", SINK), by=SINK,
                    legend="{{runtime}}/{{sink}}"),
              Query(expr=_latest("max_pending_epochs", RUNTIME), by=RUNTIME,
                    legend="{{runtime}} max_pending_epochs", style="limit"))),
    Panel(title="Commit retries and failed epoch attempts",
          question="Do a sink's commits fail and get retried (its target down), and do "
                   "epoch attempts fail (a writer lost, a target unreachable)?",
          unit="short", queries=(
              Query(expr=_increase("commit_retries", SINK), by=SINK, style="bars",
                    legend="{{runtime}}/{{sink}} commit retries"),
              Query(expr=_increase("epoch_failures", RUNTIME), by=RUNTIME, style="bars",
                    legend="{{runtime}} failed attempts"))),
))

_HEALTH = Row(title="Health", panels=(
    Panel(title="Sink state",
          question="Is each sink running, stalled (its commits fail or a writer cannot "
                   "reach its target), or paused (the runtime closed)?",
          unit="none", kind="state-timeline", width=24, queries=(
              Query(expr=_state_code(SINK), by=SINK, legend="{{runtime}}/{{sink}}"),)),
    Panel(title="Writer and coordinator restarts and replacements",
          question="Did Ray restart a crashed writer or coordinator, or did the driver "
                   "replace one that stopped answering?",
          unit="short", queries=(
              Query(expr=_increase("actor_restarts", ROLE), by=ROLE, style="bars",
                    legend="{{runtime}} {{role}} restarted"),
              Query(expr=_increase("actor_replacements", ROLE), by=ROLE, style="bars",
                    legend="{{runtime}} {{role}} replaced"))),
    Panel(title="Commits held back by an open transaction",
          question="Does a transaction left open on a sink's target (a Kafka hanging "
                   "transaction) hold its commits back, and for how long?",
          unit="s", queries=(
              Query(expr=_latest("held_seconds", SINK), by=SINK,
                    legend="{{runtime}}/{{sink}}"),)),
    Panel(title="Stream rewinds",
          question="Does a stream fail epochs and replay from the last committed one, "
                   "again and again?",
          unit="short", queries=(
              Query(expr=_increase("stream_rewinds", RUNTIME), by=RUNTIME, style="bars",
                    legend="{{runtime}}"),)),
))

_WRITERS = Row(title="Writers and backpressure", panels=(
    Panel(title="Bytes waiting in writers' mailboxes, against max_buffer_bytes",
          question="Is a writer's reorder buffer filling up toward the bound at which it "
                   "refuses writes?",
          unit="bytes", queries=(
              Query(expr=_latest("mailbox_bytes", WRITER), by=WRITER,
                    legend="{{runtime}}/{{sink}} writer {{writer}}"),
              Query(expr=_latest("mailbox_limit_bytes", SINK), by=SINK,
                    legend="{{runtime}}/{{sink}} max_buffer_bytes", style="limit"))),
    Panel(title="Messages waiting in writers' mailboxes",
          question="How many early messages wait in each writer for the ones before them?",
          unit="short", queries=(
              Query(expr=_latest("mailbox_depth", WRITER), by=WRITER,
                    legend="{{runtime}}/{{sink}} writer {{writer}}"),)),
    Panel(title="Backpressure",
          question="Do writers refuse writes for now (their mailbox full), and do epoch "
                   "opens wait on max_pending_epochs?",
          unit="short", queries=(
              Query(expr=_increase("backpressure_refusals", SINK), by=SINK, style="bars",
                    legend="{{runtime}}/{{sink}} writes refused"),
              Query(expr=_increase("backpressure_waits", RUNTIME), by=RUNTIME,
                    style="bars", legend="{{runtime}} epoch opens waited"))),
))

_SPARK = Row(title="Spark writes", panels=(
    Panel(title="Spark partitions pulled per second",
          question="How fast do the writers read Spark partitions from the RayDP "
                   "executors?",
          unit="suffix: partitions/s", queries=(
              Query(expr=_rate("spark_partitions_pulled", RUNTIME), by=RUNTIME,
                    legend="{{runtime}}"),)),
    Panel(title="Executor fallbacks",
          question="How many partitions came from another executor than the one Spark "
                   "placed them on (that executor lost or restarted)?",
          unit="short", queries=(
              Query(expr=_increase("spark_executor_fallbacks", RUNTIME), by=RUNTIME,
                    style="bars", legend="{{runtime}}"),)),
))

_TABLES = Row(title="Tables and maintenance", panels=(
    Panel(title="Live data files per table",
          question="Does maintenance keep each table's file count bounded over a long "
                   "stream, or do small files pile up?",
          unit="short", queries=(
              Query(expr=_latest("table_data_files", SINK), by=SINK,
                    legend="{{runtime}}/{{sink}}"),)),
    Panel(title="Table data and metadata bytes",
          question="How large are each table's data, and its metadata or log (which every "
                   "commit and every reader's open reads)?",
          unit="bytes", queries=(
              Query(expr=_latest("table_data_bytes", SINK), by=SINK,
                    legend="{{runtime}}/{{sink}} data"),
              Query(expr=_latest("table_metadata_bytes", SINK), by=SINK,
                    legend="{{runtime}}/{{sink}} metadata"))),
    Panel(title="Retained snapshots or log versions",
          question="Does expiry keep the snapshots (Iceberg) or log versions (Delta) each "
                   "table retains bounded?",
          unit="short", queries=(
              Query(expr=_latest("table_snapshots", SINK), by=SINK,
                    legend="{{runtime}}/{{sink}}"),)),
    Panel(title="Maintenance passes, failures and files",
          question="Does maintenance run, does it fail (retried with backoff), and how many "
                   "files does it compact and delete?",
          unit="short", queries=(
              Query(expr=_increase("maintenance_passes", SINK), by=SINK, style="bars",
                    legend="{{runtime}}/{{sink}} passes"),
              Query(expr=_increase("maintenance_failures", SINK), by=SINK, style="bars",
                    legend="{{runtime}}/{{sink}} failures"),
              Query(expr=_increase("maintenance_files_compacted", SINK), by=SINK,
                    style="bars", legend="{{runtime}}/{{sink}} files compacted"),
              Query(expr=_increase("maintenance_files_deleted", SINK), by=SINK,
                    style="bars", legend="{{runtime}}/{{sink}} files deleted"))),
    Panel(title="Last maintenance pass",
          question="When did each sink's last maintenance pass end (unix time)?",
          unit="dateTimeAsIso", queries=(
              Query(expr=f"{_latest('maintenance_last_timestamp', SINK)} * 1000", by=SINK,
                    legend="{{runtime}}/{{sink}}"),)),
))

ROWS: tuple[Row, ...] = (_THROUGHPUT, _EPOCHS, _HEALTH, _WRITERS, _TABLES, _SPARK)

VARIABLES: tuple[Variable, ...] = (
    Variable(name="SessionName", label="Ray session", multi=False,
             series=METRICS["max_pending_epochs"].series),
    Variable(name="runtime", label="runtime",
             series=f'{METRICS["max_pending_epochs"].series}{{SessionName=~"$SessionName"}}'),
    Variable(name="sink", label="sink",
             series=f'{METRICS["sink_state"].series}'
                    '{SessionName=~"$SessionName", runtime=~"$runtime"}'),
)


def panels() -> list[Panel]:
    """Every panel, row by row."""
    return [panel for row in ROWS for panel in row.panels]
