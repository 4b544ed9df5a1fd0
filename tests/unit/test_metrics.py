"""Metrics are best effort: recording never fails, with or without a Ray worker. What the
recorders record, with fake metrics in place of Ray's."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from raysink import _metrics
from raysink._metrics import (
    SINK_STATES,
    CoordinatorMetrics,
    DriverMetrics,
    WriterMetrics,
    spark_pulled,
)
from raysink.coordinator.epochs import CommitOutcome
from raysink.protocol.messages import CommitRequest
from raysink.reports import RuntimeStatus, SinkStatus


class _Fake:
    """Stands for a Ray metric: keeps what it was given, per tag set."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.values: dict[tuple[tuple[str, str], ...], float] = {}
        self.sets = 0

    def _key(self, tags: dict[str, str]) -> tuple[tuple[str, str], ...]:
        return tuple(sorted(tags.items()))

    def inc(self, value: float, tags: dict[str, str]) -> None:
        key = self._key(tags)
        self.values[key] = self.values.get(key, 0.0) + value

    def _record(self, value: float, tags: dict[str, str]) -> None:
        self.inc(value, tags)

    def set(self, value: float, tags: dict[str, str]) -> None:
        self.values[self._key(tags)] = value
        self.sets += 1

    def observe(self, value: float, tags: dict[str, str]) -> None:
        self.inc(1, tags)

    def get(self, **tags: str) -> float | None:
        return self.values.get(self._key(tags))


@pytest.fixture
def fakes(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, _Fake]]:
    made: dict[str, _Fake] = {}

    def make(name: str) -> _Fake:
        return made.setdefault(name, _Fake(name))

    monkeypatch.setattr(_metrics, "_make", make)
    monkeypatch.setattr(_metrics, "_GAUGES", _metrics._GaugeBook(refreshing=False))
    _metrics._spark_metrics.cache_clear()
    yield made
    _metrics._spark_metrics.cache_clear()


def test_recording_never_fails_outside_an_actor() -> None:
    writer = WriterMetrics("rt", "main", 0, max_buffer_bytes=1024)
    writer.applied(10, 1_000)
    writer.applied(0, 0)
    writer.mailbox(3, 300)
    writer.refused()
    coordinator = CoordinatorMetrics("rt", ["main"], max_pending_epochs=2)
    coordinator.decided(1, [CommitRequest(sink="main", writer=0, epoch=1, attempt=0,
                                          manifest=None, rows=10)])
    coordinator.committed(CommitOutcome(epoch=1, sink="main", skipped=False), 0.02)
    coordinator.retried("main")
    coordinator.waited()
    driver = DriverMetrics("rt")
    driver.replaced(["writer"])
    driver.attempt_failed()
    driver.rewound()
    spark_pulled("rt", fallback=True)


def test_counters_start_at_zero_for_what_each_process_knows(fakes: dict[str, _Fake]) -> None:
    WriterMetrics("rt", "lake", 1)
    CoordinatorMetrics("rt", ["lake", "db"])
    DriverMetrics("rt")
    writer = {"runtime": "rt", "sink": "lake", "writer": "1"}
    for name in ("rows_written", "bytes_written", "backpressure_refusals"):
        assert fakes[name].get(**writer) == 0.0, name
    for sink in ("lake", "db"):
        assert fakes["commit_retries"].get(runtime="rt", sink=sink) == 0.0
        assert fakes["rows_committed"].get(runtime="rt", sink=sink) == 0.0
    for role in ("writer", "coordinator"):
        assert fakes["actor_replacements"].get(runtime="rt", role=role) == 0.0
        assert fakes["actor_restarts"].get(runtime="rt", role=role) == 0.0
    for name in ("epoch_failures", "stream_rewinds", "backpressure_waits",
                 "spark_partitions_pulled", "spark_executor_fallbacks"):
        assert fakes[name].get(runtime="rt") == 0.0, name


def test_rows_count_when_each_sink_commits_them(fakes: dict[str, _Fake]) -> None:
    metrics = CoordinatorMetrics("rt", ["lake", "db"])
    metrics.decided(4, [
        CommitRequest(sink=s, writer=w, epoch=4, attempt=0, manifest=None, rows=rows)
        for s, w, rows in (("lake", 0, 30), ("lake", 1, 70), ("db", 0, 30), ("db", 1, 70))])
    metrics.committed(CommitOutcome(epoch=4, sink="lake", skipped=False), 0.1)
    assert fakes["rows_committed"].get(runtime="rt", sink="lake") == 100
    assert fakes["rows_committed"].get(runtime="rt", sink="db") == 0
    metrics.committed(CommitOutcome(epoch=4, sink="db", skipped=True), 0.1)  # marker had it
    assert fakes["rows_committed"].get(runtime="rt", sink="db") == 0
    metrics.committed(CommitOutcome(epoch=4, sink="lake", skipped=False), 0.1)  # again
    assert fakes["rows_committed"].get(runtime="rt", sink="lake") == 100
    assert fakes["epoch_commit_seconds"].get(runtime="rt", sink="lake") == 2


def test_the_status_becomes_gauges(fakes: dict[str, _Fake]) -> None:
    metrics = CoordinatorMetrics("rt", ["lake", "db"], max_pending_epochs=3)
    metrics.status(RuntimeStatus(
        name="rt", metastore="", last_committed_epoch=4, pending_epochs=[5, 6], sinks={
            "lake": SinkStatus(state="running", last_committed_epoch=6, last_error=None),
            "db": SinkStatus(state="stalled", last_committed_epoch=4, last_error="down")}))
    assert fakes["max_pending_epochs"].get(runtime="rt") == 3
    assert fakes["last_committed_epoch"].get(runtime="rt", sink="db") == 4
    assert fakes["pending_epochs"].get(runtime="rt", sink="db") == 2
    assert fakes["pending_epochs"].get(runtime="rt", sink="lake") == 0
    for state in SINK_STATES:
        expected = 1.0 if state == "stalled" else 0.0
        assert fakes["sink_state"].get(runtime="rt", sink="db", state=state) == expected


def test_gauges_are_set_again_until_replaced(fakes: dict[str, _Fake]) -> None:
    """Ray's metrics agent forgets a gauge value not set again within two report
    intervals: the book sets each last value again."""
    writer = WriterMetrics("rt", "lake", 0, max_buffer_bytes=1024)
    writer.mailbox(2, 200)
    depth = fakes["mailbox_depth"]
    before = depth.sets
    assert _metrics._GAUGES.refresh() == 3  # depth, bytes, limit: one value each
    assert depth.sets == before + 1 and depth.get(runtime="rt", sink="lake", writer="0") == 2
    writer.mailbox(0, 0)
    _metrics._GAUGES.refresh()
    assert depth.get(runtime="rt", sink="lake", writer="0") == 0


def test_spark_pulls_count_only_inside_a_runtime(fakes: dict[str, Any]) -> None:
    spark_pulled("rt", fallback=False)
    spark_pulled("rt", fallback=True)
    spark_pulled("", fallback=True)
    assert fakes["spark_partitions_pulled"].get(runtime="rt") == 2
    assert fakes["spark_executor_fallbacks"].get(runtime="rt") == 1
    assert fakes["spark_partitions_pulled"].get(runtime="") is None


def test_maintenance_counts_and_the_table_size_becomes_gauges(fakes: dict[str, _Fake]) -> None:
    from raysink.sinks._maintenance import MaintenanceReport, MaintenanceTotals, TableStats

    metrics = CoordinatorMetrics("rt", ["lake", "db"])
    tags = {"runtime": "rt", "sink": "lake"}
    assert fakes["maintenance_passes"].get(**tags) == 0.0
    assert fakes["maintenance_failures"].get(runtime="rt", sink="db") == 0.0
    report = MaintenanceReport(sink="lake", files_compacted=20, files_deleted=30)
    table = TableStats(data_files=2, data_bytes=900, snapshots=7, metadata_files=9,
                       metadata_bytes=4000)
    metrics.maintained(report, table)
    metrics.maintenance_failed("lake")
    assert fakes["maintenance_passes"].get(**tags) == 1
    assert fakes["maintenance_files_compacted"].get(**tags) == 20
    assert fakes["maintenance_files_deleted"].get(**tags) == 30
    assert fakes["maintenance_failures"].get(**tags) == 1
    metrics.status(RuntimeStatus(name="rt", metastore="", last_committed_epoch=4,
                                 pending_epochs=[], sinks={
        "lake": SinkStatus(state="running", last_committed_epoch=4, last_error=None,
                           maintenance=MaintenanceTotals(passes=1, last_pass_at=1.7e9),
                           table=table),
        "db": SinkStatus(state="running", last_committed_epoch=4, last_error=None)}))
    assert fakes["table_data_files"].get(**tags) == 2
    assert fakes["table_data_bytes"].get(**tags) == 900
    assert fakes["table_snapshots"].get(**tags) == 7
    assert fakes["table_metadata_bytes"].get(**tags) == 4000
    assert fakes["maintenance_last_timestamp"].get(**tags) == 1.7e9
    assert fakes["table_data_files"].get(runtime="rt", sink="db") is None  # not a table
