"""Structured Streaming through ``foreach_batch`` with the driver process SIGKILLed.

The driver (``tests/spark/streaming_driver.py``) runs in its own process with its own local
Ray and RayDP, over a Parquet file source (one file per micro-batch, ``availableNow``).
The runs of a test share one checkpoint location, runtime name and meta store.

In the default run, two runs: the first is killed once batch 1's epoch is PENDING, before
any sink commit and before Spark recorded the batch; the second rolls the epoch forward at
its start, is handed batch 1 again by Spark (the runtime must skip it) and runs to the end.

The full sequence (``slow``, four runs):

1. killed after ``foreach_batch`` wrote batch 1, before Spark recorded it (Spark replays
   it: the runtime must skip it);
2. (two files added) killed in the middle of batch 3: its writers staged their data and
   sleep before the commit request (epoch OPEN: recovery discards it, the replay rewrites);
3. killed in the middle of batch 4 once its epoch is PENDING (recovery rolls it forward,
   the replay is skipped);
4. (two more files added) runs to the end.

Either way the table then holds every input row exactly once. A killed driver that started
its own Ray leaves orphans (raylet, GCS, agents, workers, the Java executors): every process
of the driver's tree, and any process carrying the run's marker in its environment, is
SIGKILLed by pid and waited for.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from raysink._faults import ENV_VAR, fault_dir
from raysink.testing import arm_fault, disarm_faults
from tests.integration.helpers import wait_fired

pytestmark = pytest.mark.timeout(600)

ROWS = 150  # rows per input file
NAME = "stream-driverkill"
_MARKER = "RAYSINK_TEST_DRIVER"
_REPO = Path(__file__).resolve().parents[2]


def _feed(directory: Path, index: int) -> None:
    """Input file ``index``: ids ``index * 1000 + [0, ROWS)``, written atomically."""
    ids = list(range(index * 1000, index * 1000 + ROWS))
    table = pa.table({"id": pa.array(ids, pa.int64()),
                      "payload": pa.array([f"event-{i}" for i in ids])})
    tmp = directory / f".part-{index:04d}.parquet.tmp"
    pq.write_table(table, tmp)
    tmp.rename(directory / f"part-{index:04d}.parquet")


class Driver:
    """One run of the streaming driver; its stdout protocol lines arrive on a queue."""

    def __init__(self, config: dict[str, Any], log: Path) -> None:
        self.marker = uuid.uuid4().hex
        env = {**os.environ, _MARKER: self.marker, "PYTHONPATH": str(_REPO)}
        self._log = log.open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.spark.streaming_driver", json.dumps(config)],
            cwd=_REPO, env=env, stdout=subprocess.PIPE, stderr=self._log, text=True,
            start_new_session=True)
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("@@"):
                self.lines.put(line[2:].strip())

    def wait_for(self, wanted: Callable[[str], bool], timeout: float = 240.0) -> str:
        """The first protocol line ``wanted`` accepts; fails if the driver ends first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=1.0)
            except queue.Empty:
                if self.proc.poll() is not None and self.lines.empty():
                    raise AssertionError(f"driver exited {self.proc.returncode}; see "
                                         f"{self._log.name}; saw {self.seen}") from None
                continue
            self.seen.append(line)
            if wanted(line):
                return line
        raise AssertionError(f"driver never printed the line wanted; saw {self.seen}")

    def kill(self) -> None:
        """SIGKILL the driver and everything it started, by pid, and wait for them."""
        victims = _tree(self.proc.pid)
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=60)
        _kill_all(victims)
        _kill_all(_marked(self.marker))  # started after the tree was collected
        self._drain()

    def _drain(self) -> None:
        """Take every protocol line printed before the end."""
        self._reader.join(timeout=30)
        while not self.lines.empty():
            self.seen.append(self.lines.get())
        self._log.close()

    def finish(self, timeout: float = 240.0) -> None:
        """Wait for a clean exit, then make sure nothing of it is left."""
        code = self.proc.wait(timeout=timeout)
        _kill_all(_marked(self.marker))
        self._drain()
        assert code == 0, f"driver exited {code}; see {self._log.name}"


def _tree(pid: int) -> list[psutil.Process]:
    try:
        parent = psutil.Process(pid)
        return [parent, *parent.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _marked(marker: str) -> list[psutil.Process]:
    """Processes whose environment carries this run's marker (only ours can)."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get(_MARKER) == marker:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def _kill_all(procs: list[psutil.Process]) -> None:
    for proc in procs:
        try:
            proc.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            continue
    _, alive = psutil.wait_procs(procs, timeout=30)
    assert not alive, f"processes survived SIGKILL: {alive}"


def _batch(line: str) -> tuple[int, int, int, bool] | None:
    parts = line.split()
    if parts[0] != "BATCH":
        return None
    return int(parts[1]), int(parts[2]), int(parts[3]), parts[4] == "True"


def _is_batch(batch_id: int) -> Callable[[str], bool]:
    def wanted(line: str) -> bool:
        parsed = _batch(line)
        return parsed is not None and parsed[0] == batch_id
    return wanted


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


def _batches(driver: Driver) -> dict[int, tuple[int, int, bool]]:
    out = {}
    for line in driver.seen:
        parsed = _batch(line)
        if parsed is not None:
            out[parsed[0]] = parsed[1:]
    return out


def _assert_every_row_once(table: str, files: int) -> None:
    ids = Counter(ds.dataset(table, format="parquet").to_table(columns=["id"])
                  .column("id").to_pylist())
    expected = Counter(i * 1000 + r for i in range(files) for r in range(ROWS))
    assert ids == expected, (
        f"doubled: {sorted(k for k, v in ids.items() if v > 1)[:10]}, "
        f"missing: {sorted(set(expected) - set(ids))[:10]}")


def test_driver_killed_with_a_micro_batch_pending_resumes_it_once(
        layout: dict[str, Any], tmp_path: Path) -> None:
    source = Path(layout["input"])
    for index in range(3):
        _feed(source, index)
    log = tmp_path / "driver.log"

    # batch 1 (epoch 2) decided PENDING, no sink committed, Spark has not recorded it
    arm_fault(NAME, "coordinator.after_pending", action="sleep", seconds=600,
              when={"epoch": 2})
    first = Driver(layout, log)
    wait_fired(NAME, "coordinator.after_pending", timeout=240)
    first.kill()
    assert _batches(first) == {0: (1, ROWS, False)}

    # rolled forward at the start; Spark's replay of batch 1 is skipped; one more file
    disarm_faults(NAME)
    _feed(source, 3)
    second = Driver(layout, log)
    done = second.wait_for(lambda line: line.startswith("DONE"))
    second.finish()
    assert done == "DONE 4"
    assert _batches(second) == {1: (2, 0, True), 2: (3, ROWS, False), 3: (4, ROWS, False)}
    _assert_every_row_once(layout["table"], files=4)


@pytest.mark.slow
def test_driver_killed_between_and_inside_micro_batches(layout: dict[str, Any],
                                                        tmp_path: Path) -> None:
    source = Path(layout["input"])
    for index in range(4):
        _feed(source, index)
    log = tmp_path / "driver.log"

    # 1: killed after batch 1 was written, before Spark recorded it
    first = Driver({**layout, "hold_after": 1}, log)
    first.wait_for(_is_batch(1))
    first.kill()
    assert _batches(first) == {0: (1, ROWS, False), 1: (2, ROWS, False)}

    # 2: two more files; killed while batch 3's writers hold staged data (epoch 4 OPEN)
    for index in (4, 5):
        _feed(source, index)
    arm_fault(NAME, "writer.after_pre_commit", action="sleep", seconds=600,
              when={"epoch": 4, "writer": 0})
    second = Driver(layout, log)
    wait_fired(NAME, "writer.after_pre_commit", timeout=240)
    second.kill()
    assert _batches(second) == {1: (2, 0, True), 2: (3, ROWS, False)}  # 1 replayed, skipped

    # 3: killed once batch 4's epoch is PENDING, before any sink commit
    disarm_faults(NAME)
    arm_fault(NAME, "coordinator.after_pending", action="sleep", seconds=600,
              when={"epoch": 5})
    third = Driver(layout, log)
    wait_fired(NAME, "coordinator.after_pending", timeout=240)
    third.kill()
    assert _batches(third) == {3: (4, ROWS, False)}  # epoch 4 rewritten after the abort

    # 4: two more files; runs to the end
    disarm_faults(NAME)
    for index in (6, 7):
        _feed(source, index)
    fourth = Driver(layout, log)
    done = fourth.wait_for(lambda line: line.startswith("DONE"))
    fourth.finish()
    assert done == "DONE 8"
    assert _batches(fourth) == {4: (5, 0, True), 5: (6, ROWS, False), 6: (7, ROWS, False),
                                7: (8, ROWS, False)}

    _assert_every_row_once(layout["table"], files=8)
