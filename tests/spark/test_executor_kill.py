"""A RayDP executor SIGKILLed in the middle of a Spark epoch: the epoch ends exact, and so
do the epochs after it (whose cached blocks Spark places under the restarted executor's
new id, or on the executors left).

This module has its own RayDP session (``SPARK_SESSION``): the kill leaves it changed for
good.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow.dataset as ds
import pytest
from pyspark.sql import DataFrame, SparkSession

from raysink import SinkRuntime
from raysink.sinks import ParquetSink
from raysink.testing import arm_fault, disarm_faults
from tests.chaos.faults import kill_executor
from tests.integration.helpers import run_in_thread, wait_fired

pytestmark = pytest.mark.timeout(420)

SPARK_SESSION = "own"  # tests/spark/conftest.py

NAME = "sw-executorkill"


def _ids(spark: SparkSession, start: int, end: int, partitions: int) -> DataFrame:
    return spark.range(start, end, 1, partitions).selectExpr("id", "CAST(id AS STRING) AS s")


def test_executor_killed_mid_epoch(spark: SparkSession, tmp_path: Path) -> None:
    disarm_faults(NAME)
    table = tmp_path / "table"
    try:
        with SinkRuntime(NAME, ParquetSink(str(table)), writers=2, progress=False,
                         metastore=f"sqlite:///{tmp_path / 'meta.db'}") as rt:
            rt.write(_ids(spark, 0, 10_000, 4))
            # epoch 2 holds still once writer 0 applied a partition; an executor dies then,
            # with partitions cached on it not fetched yet
            arm_fault(NAME, "writer.during_write", action="sleep", seconds=2.0,
                      when={"epoch": 2, "writer": 0, "sink": "main"})
            thread, box = run_in_thread(lambda: rt.write(_ids(spark, 10_000, 60_000, 8)))
            wait_fired(NAME, "writer.during_write")
            assert kill_executor(0).startswith("sigkill raydp-executor-")
            thread.join(timeout=360)
            assert not thread.is_alive(), "the epoch never finished"
            if "error" in box:
                raise box["error"]
            assert box["result"].epoch == 2 and box["result"].committed
            # later epochs: block locations may name the restarted executor's new id
            for epoch, (start, end) in enumerate([(60_000, 70_000), (70_000, 90_000)], 3):
                report = rt.write(_ids(spark, start, end, 6))
                assert report.epoch == epoch and report.committed
    finally:
        disarm_faults(NAME)
    ids = ds.dataset(str(table), format="parquet").to_table(columns=["id"]).column("id")
    assert sorted(ids.to_pylist()) == list(range(90_000))
