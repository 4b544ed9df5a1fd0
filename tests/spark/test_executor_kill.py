"""RayDP executors SIGKILLed under a Spark epoch, then the session stopped under a runtime.

The kills leave the session changed for good (an executor Ray restarted registers with
Spark under a new id), so this module is the shared session's last user
(``SPARK_SESSION = "last"``, ``tests/spark/conftest.py``): it runs after every other module
of the layer and the session is stopped after it. In order:

1. an executor killed in the middle of an epoch: the epoch ends exact, and so does the
   epoch after it (whose cached blocks Spark places under the restarted executor's new
   id, or on the executor left);
2. the executor that was not restarted killed while a writer pulls a partition from it:
   the writer chose it because Spark placed the partition there and stops at the
   ``spark.mid_pull`` fault point; the test kills it there, then lets the pull go on. The
   pull asks the dead (restarting) executor, then the other live one, whose block manager
   reads the partition or has Spark cache the RDD again: the epoch ends exact, and so do
   an unkeyed and a keyed epoch after it (keyed ones pull in their split tasks);
3. the session stopped: a write of one of its DataFrames is a ``ConfigError``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow.dataset as ds
import pytest
from pyspark.sql import DataFrame, SparkSession

from raysink import SinkRuntime
from raysink.errors import ConfigError
from raysink.sinks import ParquetSink
from raysink.spark import stop_spark
from raysink.testing import arm_fault, disarm_faults, fired
from tests.chaos.faults import kill_executor
from tests.integration.helpers import run_in_thread, sigkill, wait_fired

pytestmark = pytest.mark.timeout(420)

SPARK_SESSION = "last"  # tests/spark/conftest.py


def _runtime(name: str, table: Path, meta: Path, **options: Any) -> SinkRuntime:
    return SinkRuntime(name, ParquetSink(str(table)), writers=2, progress=False,
                       metastore=f"sqlite:///{meta}", **options)


def _ids(spark: SparkSession, start: int, end: int, partitions: int) -> DataFrame:
    return spark.range(start, end, 1, partitions).selectExpr(
        "id", "concat('k', CAST(id % 41 AS STRING)) AS k")


def _ids_in(path: Path) -> list[int]:
    table = ds.dataset(str(path), format="parquet").to_table(columns=["id"])
    return sorted(table.column("id").to_pylist())


def _never_restarted_executor() -> tuple[str, int]:
    """A live executor actor Ray never restarted (Spark still locates blocks under its
    name): its name and pid."""
    from ray._private.state import actors

    alive = sorted((str(info["Name"]), int(info["Pid"]), int(info["NumRestarts"]))
                   for info in actors(actor_state_name="ALIVE").values()
                   if str(info.get("Name") or "").startswith("raydp-executor-"))
    fresh = [(name, pid) for name, pid, restarts in alive if not restarts]
    assert fresh, f"every live executor was restarted: {alive}"
    return fresh[0]


def test_executor_killed_mid_epoch(spark: SparkSession, tmp_path: Path) -> None:
    name = "sw-executorkill"
    disarm_faults(name)
    table = tmp_path / "table"
    try:
        with _runtime(name, table, tmp_path / "meta.db") as rt:
            rt.write(_ids(spark, 0, 10_000, 4))
            # epoch 2 holds still once writer 0 applied a partition; an executor dies then,
            # with partitions cached on it not fetched yet
            arm_fault(name, "writer.during_write", action="sleep", seconds=2.0,
                      when={"epoch": 2, "writer": 0, "sink": "main"})
            thread, box = run_in_thread(lambda: rt.write(_ids(spark, 10_000, 60_000, 8)))
            wait_fired(name, "writer.during_write")
            assert kill_executor(0).startswith("sigkill raydp-executor-")
            thread.join(timeout=360)
            assert not thread.is_alive(), "the epoch never finished"
            if "error" in box:
                raise box["error"]
            assert box["result"].epoch == 2 and box["result"].committed
            # a later epoch: block locations may name the restarted executor's new id (the
            # next test's epochs run on this session too)
            report = rt.write(_ids(spark, 60_000, 70_000, 6))
            assert report.epoch == 3 and report.committed
    finally:
        disarm_faults(name)
    assert _ids_in(table) == list(range(70_000))


def test_executor_killed_while_a_writer_pulls_from_it(spark: SparkSession,
                                                        tmp_path: Path) -> None:
    name = "sw-pullkill"
    disarm_faults(name)
    table, keyed = tmp_path / "table", tmp_path / "keyed"
    try:
        with _runtime(name, table, tmp_path / "meta.db") as rt:
            rt.write(_ids(spark, 0, 10_000, 4))
            victim, pid = _never_restarted_executor()
            arm_fault(name, "spark.mid_pull", action="sleep", seconds=3.0,
                      when={"executor": victim})
            thread, box = run_in_thread(lambda: rt.write(_ids(spark, 10_000, 60_000, 8)))
            wait_fired(name, "spark.mid_pull", timeout=120)
            sigkill(pid)
            thread.join(timeout=360)
            assert not thread.is_alive(), "the epoch never finished"
            if "error" in box:
                raise box["error"]
            assert fired(name, "spark.mid_pull")
            assert box["result"].epoch == 2 and box["result"].committed
            assert box["result"].rows == 50_000
            later = rt.write(_ids(spark, 60_000, 70_000, 6))
            assert later.epoch == 3 and later.committed
        with _runtime(name + "-keyed", keyed, tmp_path / "keyed.db", key=["k"]) as kt:
            report = kt.write(_ids(spark, 0, 20_000, 5))
            assert report.committed and report.rows == 20_000
    finally:
        disarm_faults(name)
    assert _ids_in(table) == list(range(70_000))
    assert _ids_in(keyed) == list(range(20_000))


# --- last in the module: it stops the session -------------------------------------------


def test_write_after_spark_stopped_is_config_error(spark: SparkSession, tmp_path: Path) -> None:
    df = spark.range(0, 10, 1, 2)
    with _runtime("sw-stopped", tmp_path / "table", tmp_path / "meta.db") as rt:
        stop_spark()  # the fixture's teardown stops it again, harmlessly
        with pytest.raises(ConfigError, match="session is stopped"):
            rt.write(df)
        assert rt.status().last_committed_epoch is None
