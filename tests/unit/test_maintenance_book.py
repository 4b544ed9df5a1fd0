"""When the coordinator runs a sink's maintenance pass (``MaintenanceBook``, no Ray): after
``every_epochs`` committed epochs and ``min_interval_s``, at once when asked, never for a
sink switched off unless asked, and after a failure only once its backoff has passed."""

from __future__ import annotations

import asyncio

import pytest

from raysink import Maintenance
from raysink.coordinator.maintenance import MaintenanceBook
from raysink.sinks._maintenance import MaintenanceReport
from raysink.sinks.delta import DeltaSink


def book() -> MaintenanceBook:
    return MaintenanceBook({
        "on": DeltaSink("/tmp/on", maintenance=Maintenance(every_epochs=3, min_interval_s=5))
        .bind("rt", "on"),
        "off": DeltaSink("/tmp/off", maintenance=False).bind("rt", "off")}, retry_cap=60)


def test_a_pass_is_due_after_every_epochs_and_min_interval() -> None:
    b = book()
    assert not b.due("on", 10, now=0.0)  # counted from the epoch found at the start
    assert not b.due("on", 12, now=0.0)
    assert b.due("on", 13, now=0.0)
    b.passed("on", 13, MaintenanceReport(sink="on", files_compacted=4), None, now=1.0)
    assert not b.due("on", 16, now=3.0)  # min_interval_s
    assert b.due("on", 16, now=6.0)
    totals = b.totals("on")
    assert totals is not None and (totals.passes, totals.files_compacted) == (1, 4)


def test_a_sink_switched_off_is_never_due_and_shows_no_totals() -> None:
    b = book()
    assert not b.due("off", 100, now=0.0) and not b.due("off", 1000, now=100.0)
    assert b.totals("off") is None


def test_a_failure_backs_off_and_counts() -> None:
    b = book()
    b.due("on", 0, now=0.0)
    delay = b.failed("on", RuntimeError("disk"), now=10.0)
    assert delay == 5.0  # min_interval_s first, then doubling
    assert not b.due("on", 100, now=14.0)
    assert b.due("on", 100, now=15.0)
    assert b.failed("on", RuntimeError("disk"), now=15.0) == 10.0
    totals = b.totals("on")
    assert totals is not None and totals.failures == 2 and "disk" in (totals.last_error or "")


def test_a_request_is_due_at_once_and_answered_by_a_complete_pass() -> None:
    async def scenario() -> MaintenanceReport:
        b = book()
        asked = b.request("off")  # asked by name: runs although switched off
        assert b.due("off", None, now=0.0) and b.forced("off")
        b.passed("off", None, MaintenanceReport(sink="off", steps=("compact",),
                                                files_compacted=2, complete=False), None, 1.0)
        assert not asked.done()  # stopped at its deadline: goes on after the commits
        b.passed("off", None, MaintenanceReport(sink="off", steps=("cleanup_log",),
                                                files_deleted=3), None, 2.0)
        return await asked

    report = asyncio.run(scenario())
    assert (report.steps, report.files_compacted, report.files_deleted) == (
        ("compact", "cleanup_log"), 2, 3)


def test_a_failed_request_gets_the_error() -> None:
    async def scenario() -> None:
        b = book()
        asked = b.request("on")
        b.failed("on", RuntimeError("disk"), now=0.0)
        await asked

    with pytest.raises(RuntimeError, match="disk"):
        asyncio.run(scenario())
