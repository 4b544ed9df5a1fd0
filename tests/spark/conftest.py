"""The Spark layer's shared fixture: one RayDP session for the modules that can share it.

The session shares the test session's Ray (``ray_session``, 8 logical CPUs) and is kept
small: 2 executors x 1 core, 1 GB each, 4 shuffle partitions, the session zone UTC, no UI.
It is started once, with every package a module of the layer names (``SHARED_PACKAGES``,
Maven coordinates cached by ``make setup``), and handed to each module that asks for
``spark`` while it still runs: a RayDP start took 50-70 s here at load 20-60. A module's
``SPARK_CONFIGS`` must be runtime settings (SQL confs); they are set for the module and
unset after it.

A module that leaves the session changed for good (a killed executor, a stopped session)
sets ``SPARK_SESSION = "last"``: it runs after every other module of the layer
(``pytest_collection_modifyitems`` below), on the same session, which is stopped after it,
so no other module sees the change and none pays a second start. A test that stops the
shared session elsewhere costs only its successors a new start.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from pyspark.sql import SparkSession

from raysink.spark import active_spark, init_spark, stop_spark
from tests.spark.packages import SHARED_PACKAGES

CONFIGS = {
    "spark.ui.showConsoleProgress": "false",
    "spark.ui.enabled": "false",
    "spark.sql.shuffle.partitions": "4",
    "spark.sql.session.timeZone": "UTC",
}


def _start(name: str) -> SparkSession:
    session = init_spark(f"raysink-test-{name}", executors=2, executor_cores=1,
                         executor_memory="1g", configs=CONFIGS, packages=SHARED_PACKAGES)
    session.sparkContext.setLogLevel("ERROR")
    assert active_spark() is session
    return session


def _runs_last(module: object) -> bool:
    return getattr(module, "SPARK_SESSION", "shared") == "last"


@pytest.hookimpl(trylast=True)  # after tests/conftest.py marked the layers
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The tests of ``SPARK_SESSION = "last"`` modules move behind the layer's last other
    test (stable: each keeps its order)."""
    last = [item for item in items if _runs_last(getattr(item, "module", None))]
    if last:
        end = max(i for i, item in enumerate(items) if item.get_closest_marker("spark")) + 1
        items[:] = [item for item in items[:end] if item not in last] + last + items[end:]


@pytest.fixture(scope="session")
def _spark_layer(ray_session: None) -> Iterator[None]:
    """Whatever session is left running ends with the test session, before its Ray."""
    yield
    stop_spark()


@pytest.fixture(scope="module")
def spark(request: pytest.FixtureRequest, _spark_layer: None) -> Iterator[SparkSession]:
    last = _runs_last(request.module)
    session = active_spark() or _start("shared")
    configs = getattr(request.module, "SPARK_CONFIGS", {})
    for key, value in configs.items():
        session.conf.set(key, value)
    yield session
    if last:
        stop_spark()
        assert active_spark() is None
    elif active_spark() is session:
        for key in configs:
            session.conf.unset(key)
