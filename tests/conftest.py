"""Shared fixtures: one local Ray per test session.

Layers (pytest markers) and their budgets in the default run:
unit (no Ray) 1 min, integration (real ray.init) 8 min, spark (RayDP) 8 min,
chaos sample 3 min. Modules under tests/<layer>/ get their layer's marker automatically.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# Spark's Python workers must run this interpreter; set before any Ray starts.
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("RAY_DEDUP_LOGS", "0")

_LAYERS = ("unit", "integration", "spark", "chaos")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        parts = Path(str(item.fspath)).parts
        for layer in _LAYERS:
            if layer in parts:
                item.add_marker(getattr(pytest.mark, layer))


@pytest.fixture(scope="session")
def ray_session() -> Iterator[None]:
    """One local Ray for the whole test session (8 logical CPUs so RayDP fits on 2 cores)."""
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()
from tests.support.postgres import pg_server  # noqa: E402,F401
