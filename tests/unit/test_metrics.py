"""Metrics are best effort: recording never fails, with or without a Ray worker."""

from __future__ import annotations

from raysink._metrics import CoordinatorMetrics, WriterMetrics


def test_recording_never_fails_outside_an_actor() -> None:
    writer = WriterMetrics("rt", "main", 0)
    writer.applied(10, 1_000)
    writer.applied(0, 0)
    writer.depth(3)
    coordinator = CoordinatorMetrics("rt")
    coordinator.committed("main", 0.02)
    coordinator.retried("main")
    coordinator.waited()
