"""The Spark layer's shared fixture: one RayDP session for the modules that can share it.

The session shares the test session's Ray (``ray_session``, 8 logical CPUs) and is kept
small: 2 executors x 1 core, 1 GB each, 4 shuffle partitions, the session zone UTC, no UI.
It is started once, with every package a module of the layer names (``SHARED_PACKAGES``,
Maven coordinates cached by ``make setup``), and handed to each module that asks for
``spark`` while it still runs: a RayDP start took 50-70 s here at load 20-60. A module's
``SPARK_CONFIGS`` must be runtime settings (SQL confs); they are set for the module and
unset after it.

A module that leaves its session changed for good (a killed executor) sets
``SPARK_SESSION = "own"``: it gets a session of its own, stopped after it, so no other
module sees the change. A test that stops the shared session costs only its successors a
new start.
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


@pytest.fixture(scope="session")
def _spark_layer(ray_session: None) -> Iterator[None]:
    """Whatever session is left running ends with the test session, before its Ray."""
    yield
    stop_spark()


@pytest.fixture(scope="module")
def spark(request: pytest.FixtureRequest, _spark_layer: None) -> Iterator[SparkSession]:
    module = request.module.__name__.rsplit(".", 1)[-1].removeprefix("test_")
    own = getattr(request.module, "SPARK_SESSION", "shared") == "own"
    if own:
        stop_spark()
    session = active_spark() or _start(module.replace("_", "-") if own else "shared")
    configs = getattr(request.module, "SPARK_CONFIGS", {})
    for key, value in configs.items():
        session.conf.set(key, value)
    yield session
    if own:
        stop_spark()
        assert active_spark() is None
    elif active_spark() is session:
        for key in configs:
            session.conf.unset(key)
