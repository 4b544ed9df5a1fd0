"""A RayDP executor SIGKILLed while a writer is pulling a partition from it.

The writer chose the executor Spark placed the partition on and stops at the
``spark.mid_pull`` fault point; the test kills that executor there, then lets the pull
go on. The pull asks the dead (restarting) executor, then the other live one, whose
block manager reads the partition or has Spark cache the RDD again: the epoch ends
exact, and so do an unkeyed and a keyed epoch after it (keyed ones pull in their split
tasks).

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
from raysink.testing import arm_fault, disarm_faults, fired
from tests.chaos.faults import kill_executor
from tests.integration.helpers import run_in_thread, wait_fired

pytestmark = pytest.mark.timeout(420)

SPARK_SESSION = "own"  # tests/spark/conftest.py

NAME = "sw-pullkill"


def _ids(spark: SparkSession, start: int, end: int, partitions: int) -> DataFrame:
    return spark.range(start, end, 1, partitions).selectExpr(
        "id", "concat('k', CAST(id % 41 AS STRING)) AS k")


def _alive_executors() -> list[str]:
    """Live executor actor names, in the order ``kill_executor`` numbers them."""
    from ray._private.state import actors

    return sorted(str(info["Name"]) for info in actors(actor_state_name="ALIVE").values()
                  if str(info.get("Name") or "").startswith("raydp-executor-"))


def _ids_in(path: Path) -> list[int]:
    table = ds.dataset(str(path), format="parquet").to_table(columns=["id"])
    return sorted(table.column("id").to_pylist())


def test_executor_killed_while_a_writer_pulls_from_it(spark: SparkSession,
                                                        tmp_path: Path) -> None:
    disarm_faults(NAME)
    table, keyed = tmp_path / "table", tmp_path / "keyed"
    try:
        with SinkRuntime(NAME, ParquetSink(str(table)), writers=2, progress=False,
                         metastore=f"sqlite:///{tmp_path / 'meta.db'}") as rt:
            rt.write(_ids(spark, 0, 10_000, 4))
            victim = _alive_executors()[0]
            arm_fault(NAME, "spark.mid_pull", action="sleep", seconds=3.0,
                      when={"executor": victim})
            thread, box = run_in_thread(lambda: rt.write(_ids(spark, 10_000, 60_000, 8)))
            wait_fired(NAME, "spark.mid_pull", timeout=120)
            assert kill_executor(0).startswith(f"sigkill {victim} ")
            thread.join(timeout=360)
            assert not thread.is_alive(), "the epoch never finished"
            if "error" in box:
                raise box["error"]
            assert fired(NAME, "spark.mid_pull")
            assert box["result"].epoch == 2 and box["result"].committed
            assert box["result"].rows == 50_000
            later = rt.write(_ids(spark, 60_000, 70_000, 6))
            assert later.epoch == 3 and later.committed
        with SinkRuntime(NAME + "-keyed", ParquetSink(str(keyed)), writers=2, key=["k"],
                         progress=False, metastore=f"sqlite:///{tmp_path / 'keyed.db'}") as kt:
            report = kt.write(_ids(spark, 0, 20_000, 5))
            assert report.committed and report.rows == 20_000
    finally:
        disarm_faults(NAME)
    assert _ids_in(table) == list(range(70_000))
    assert _ids_in(keyed) == list(range(20_000))
