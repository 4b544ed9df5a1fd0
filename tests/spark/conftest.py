"""The Spark layer's shared fixture: one RayDP session per test module.

The session shares the test session's Ray (``ray_session``, 8 logical CPUs) and is kept
small: 2 executors x 1 core, 1 GB each, 4 shuffle partitions, the session zone UTC, no UI.
A module that leaves its session changed (a killed executor, a stopped session) harms no
other module: the next one starts its own. A module may name Spark packages for its
session (``SPARK_PACKAGES``, Maven coordinates, cached after the first download) and extra
settings (``SPARK_CONFIGS``).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from pyspark.sql import SparkSession

from raysink.spark import active_spark, init_spark, stop_spark

CONFIGS = {
    "spark.ui.showConsoleProgress": "false",
    "spark.ui.enabled": "false",
    "spark.sql.shuffle.partitions": "4",
    "spark.sql.session.timeZone": "UTC",
}


@pytest.fixture(scope="module")
def spark(request: pytest.FixtureRequest, ray_session: None) -> Iterator[SparkSession]:
    module = request.module.__name__.rsplit(".", 1)[-1].removeprefix("test_")
    configs = {**CONFIGS, **getattr(request.module, "SPARK_CONFIGS", {})}
    session = init_spark(f"raysink-test-{module.replace('_', '-')}", executors=2,
                         executor_cores=1, executor_memory="1g", configs=configs,
                         packages=getattr(request.module, "SPARK_PACKAGES", ()))
    session.sparkContext.setLogLevel("ERROR")
    assert active_spark() is session
    yield session
    stop_spark()
    stop_spark()  # safe twice
    assert active_spark() is None
