"""Structured Streaming through ``foreach_batch`` with the driver process SIGKILLed.

The driver (``tests/spark/streaming_driver.py``) runs in its own process with its own local
Ray and RayDP, over a Parquet file source (one file per micro-batch, ``availableNow``).
The runs of a test share one checkpoint location, runtime name and meta store.

Both tests are ``slow``: each driver run starts a Ray and a RayDP session of its own. The
default run proves their PENDING case with the Kafka pipeline's driver instead
(``tests/spark/test_kafka_pipeline.py``: killed with micro-batch 1's epoch PENDING and no
sink committed, rolled forward at the next start, Spark's replay of the batch skipped,
every record once).

The short test, two runs: the first is killed once batch 1's epoch is PENDING, before any
sink commit and before Spark recorded the batch; the second rolls the epoch forward at its
start, is handed batch 1 again by Spark (the runtime must skip it) and runs to the end.

The full sequence, four runs:

1. killed after ``foreach_batch`` wrote batch 1, before Spark recorded it (Spark replays
   it: the runtime must skip it);
2. (two files added) killed in the middle of batch 3: its writers staged their data and
   sleep before the commit request (epoch OPEN: recovery discards it, the replay rewrites);
3. killed in the middle of batch 4 once its epoch is PENDING (recovery rolls it forward,
   the replay is skipped);
4. (two more files added) runs to the end.

Either way the table then holds every input row exactly once. A killed driver's orphans
are SIGKILLed by pid (``tests/support/driver.py``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from raysink._faults import ENV_VAR, fault_dir
from raysink.testing import arm_fault, disarm_faults
from tests.integration.helpers import wait_fired
from tests.support.driver import Driver, batches, is_batch

pytestmark = pytest.mark.timeout(600)

ROWS = 150  # rows per input file
NAME = "stream-driverkill"
DRIVER = "tests.spark.streaming_driver"


def _feed(directory: Path, index: int) -> None:
    """Input file ``index``: ids ``index * 1000 + [0, ROWS)``, written atomically."""
    ids = list(range(index * 1000, index * 1000 + ROWS))
    table = pa.table({"id": pa.array(ids, pa.int64()),
                      "payload": pa.array([f"event-{i}" for i in ids])})
    tmp = directory / f".part-{index:04d}.parquet.tmp"
    pq.write_table(table, tmp)
    tmp.rename(directory / f"part-{index:04d}.parquet")


@pytest.fixture
def layout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    # the drivers inherit this process's fault directory (read once, when raysink is
    # imported): arms written here reach their actors
    monkeypatch.setenv(ENV_VAR, str(fault_dir()))
    (tmp_path / "input").mkdir()
    config = {"name": NAME, "metastore": f"sqlite:///{tmp_path / 'meta.db'}",
              "table": str(tmp_path / "table"), "input": str(tmp_path / "input"),
              "checkpoint": str(tmp_path / "checkpoint")}
    disarm_faults(NAME)
    yield config
    disarm_faults(NAME)


def _assert_every_row_once(table: str, files: int) -> None:
    ids = Counter(ds.dataset(table, format="parquet").to_table(columns=["id"])
                  .column("id").to_pylist())
    expected = Counter(i * 1000 + r for i in range(files) for r in range(ROWS))
    assert ids == expected, (
        f"doubled: {sorted(k for k, v in ids.items() if v > 1)[:10]}, "
        f"missing: {sorted(set(expected) - set(ids))[:10]}")


@pytest.mark.slow
def test_driver_killed_with_a_micro_batch_pending_resumes_it_once(
        layout: dict[str, Any], tmp_path: Path) -> None:
    """The PENDING case alone, for ParquetSink over a file source. In the default run
    ``tests/spark/test_kafka_pipeline.py::
    test_driver_killed_mid_stream_each_record_once_in_delta_and_kafka`` proves it (the same
    kill, roll-forward and skipped replay, with each run's batches checked the same way);
    the full sequence below repeats it as its runs 3 and 4."""
    source = Path(layout["input"])
    for index in range(3):
        _feed(source, index)
    log = tmp_path / "driver.log"

    # batch 1 (epoch 2) decided PENDING, no sink committed, Spark has not recorded it
    arm_fault(NAME, "coordinator.after_pending", action="sleep", seconds=600,
              when={"epoch": 2})
    first = Driver(DRIVER, layout, log)
    wait_fired(NAME, "coordinator.after_pending", timeout=240)
    first.kill()
    assert batches(first) == {0: (1, ROWS, False)}

    # rolled forward at the start; Spark's replay of batch 1 is skipped; one more file
    disarm_faults(NAME)
    _feed(source, 3)
    second = Driver(DRIVER, layout, log)
    done = second.wait_for(lambda line: line.startswith("DONE"))
    second.finish()
    assert done == "DONE 4"
    assert batches(second) == {1: (2, 0, True), 2: (3, ROWS, False), 3: (4, ROWS, False)}
    _assert_every_row_once(layout["table"], files=4)


@pytest.mark.slow
def test_driver_killed_between_and_inside_microbatches(layout: dict[str, Any],
                                                        tmp_path: Path) -> None:
    source = Path(layout["input"])
    for index in range(4):
        _feed(source, index)
    log = tmp_path / "driver.log"

    # 1: killed after batch 1 was written, before Spark recorded it
    first = Driver(DRIVER, {**layout, "hold_after": 1}, log)
    first.wait_for(is_batch(1))
    first.kill()
    assert batches(first) == {0: (1, ROWS, False), 1: (2, ROWS, False)}

    # 2: two more files; killed while batch 3's writers hold staged data (epoch 4 OPEN)
    for index in (4, 5):
        _feed(source, index)
    arm_fault(NAME, "writer.after_pre_commit", action="sleep", seconds=600,
              when={"epoch": 4, "writer": 0})
    second = Driver(DRIVER, layout, log)
    wait_fired(NAME, "writer.after_pre_commit", timeout=240)
    second.kill()
    assert batches(second) == {1: (2, 0, True), 2: (3, ROWS, False)}  # 1 replayed, skipped

    # 3: killed once batch 4's epoch is PENDING, before any sink commit
    disarm_faults(NAME)
    arm_fault(NAME, "coordinator.after_pending", action="sleep", seconds=600,
              when={"epoch": 5})
    third = Driver(DRIVER, layout, log)
    wait_fired(NAME, "coordinator.after_pending", timeout=240)
    third.kill()
    assert batches(third) == {3: (4, ROWS, False)}  # epoch 4 rewritten after the abort

    # 4: two more files; runs to the end
    disarm_faults(NAME)
    for index in (6, 7):
        _feed(source, index)
    fourth = Driver(DRIVER, layout, log)
    done = fourth.wait_for(lambda line: line.startswith("DONE"))
    fourth.finish()
    assert done == "DONE 8"
    assert batches(fourth) == {4: (5, 0, True), 5: (6, ROWS, False), 6: (7, ROWS, False),
                                7: (8, ROWS, False)}

    _assert_every_row_once(layout["table"], files=8)
