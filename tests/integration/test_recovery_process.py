"""A fresh process recovers a runtime from its meta store after the driver was SIGKILLed.

A child driver (this module run as a script) connects to the test session's Ray cluster,
opens a runtime with two Parquet sinks and writes epochs 1..3. A ``sleep`` fault holds
epoch 3 at one protocol point; once it fired, the child is SIGKILLed, and the actors it
owns die with it. The test process then opens the same runtime name and meta store: the
new coordinator rolls a PENDING epoch forward, or aborts an OPEN one and sweeps its
staging. The test re-writes epoch 3 (skipped when it was decided, written again when it
was not) and writes epoch 4; both sinks must then hold epochs 1..4 row by row, once.

The child inherits this process's environment, so with Ray's token authentication on it
finds the same token (``RAY_AUTH_TOKEN`` / ``RAY_AUTH_TOKEN_PATH`` or ``~/.ray/auth_token``)
and joins the cluster by its GCS address alone.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import ray

from raysink import RuntimeInUseError, SinkRuntime
from raysink.sinks import ParquetSink
from raysink.testing import arm_fault, disarm_faults, fired
from tests.integration.helpers import assert_exactly, epoch_table

pytestmark = pytest.mark.usefixtures("ray_session")

ROWS = 300
SINKS = ("main", "copy")
_REPO = Path(__file__).resolve().parents[2]


def _sinks(root: Path) -> dict[str, ParquetSink]:
    return {name: ParquetSink(str(root / name)) for name in SINKS}


# --------------------------------------------------------------------------- the child


def child_main(config: dict[str, Any]) -> None:
    """The doomed driver: write epochs 1..n, printing ``DONE <e>`` after each, then wait."""
    ray.init(address=config["address"], namespace="raysink", log_to_driver=False)
    root = Path(config["root"])
    rt = SinkRuntime(config["name"], _sinks(root), writers=2, metastore=config["metastore"],
                     progress=False).start()
    print("STARTED", flush=True)
    for epoch in range(1, int(config["epochs"]) + 1):
        report = rt.write_arrow(epoch_table(epoch, ROWS), epoch=epoch)
        print(f"DONE {epoch} {report.committed}", flush=True)
    time.sleep(600)  # the test kills us before this ends


class _Child:
    """The child driver process (``module`` run as a script) and what it printed."""

    module = "tests.integration.test_recovery_process"

    def __init__(self, config: dict[str, Any], log: Path) -> None:
        self._log = log
        with open(log, "wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", self.module, json.dumps(config)], cwd=_REPO,
                stdout=err, stderr=subprocess.STDOUT)

    def output(self) -> str:
        return self._log.read_text(errors="replace")

    def wait_until(self, condition: Any, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if self.proc.poll() is not None:
                raise AssertionError(f"the child driver exited early:\n{self.output()[-3000:]}")
            if time.monotonic() > deadline:
                raise AssertionError(f"the child never got there:\n{self.output()[-3000:]}")
            time.sleep(0.02)

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)


def _reopen(name: str, root: Path, meta: str, timeout: float = 60.0) -> SinkRuntime:
    """The same name and meta store, as soon as the dead driver's actor names are free."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return SinkRuntime(name, _sinks(root), writers=2, metastore=meta,
                               progress=False).start()
        except RuntimeInUseError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _committed_attempts(path: Path, epoch: int) -> set[str]:
    """The attempt numbers in the names of the committed files of ``epoch``."""
    prefix = f"part-e{epoch:012d}-a"
    return {p.name[len(prefix):len(prefix) + 4] for p in path.glob(f"{prefix}*.parquet")}


def _crash_child(tmp_path: Path, name: str, point: str, when: dict[str, Any]) -> None:
    """Run the child until ``point`` fired in epoch 3, then SIGKILL it."""
    meta = f"sqlite:///{tmp_path / 'meta.db'}"
    config = {"address": ray.get_runtime_context().gcs_address, "root": str(tmp_path),
              "name": name, "metastore": meta, "epochs": 3}
    disarm_faults(name)
    arm_fault(name, point, action="sleep", seconds=60.0, when={"epoch": 3, **when})
    child = _Child(config, tmp_path / "child.log")
    try:
        child.wait_until(lambda: fired(name, point), timeout=120)
        assert "DONE 2 True" in child.output()
    finally:
        child.kill()
        disarm_faults(name)


# (protocol point, its context filter) where epoch 3 was decided before the driver died
AFTER_PENDING = [
    ("coordinator.after_pending", {}),  # PENDING recorded, no sink committed yet
    ("sink.mid_commit", {"sink": "main"}),  # main's files moved, its marker not written
]
# ... and where it was not: the epoch is OPEN when the driver dies
BEFORE_PENDING = [
    ("writer.after_pre_commit", {"writer": 0, "sink": "main"}),  # staged, no request yet
    ("coordinator.after_open", {}),  # OPEN recorded, nothing written yet
]


@pytest.mark.parametrize(("point", "when"), AFTER_PENDING)
def test_driver_killed_after_pending(tmp_path: Path, point: str,
                                     when: dict[str, Any]) -> None:
    name = f"rp-after-{point.split('.')[1].replace('_', '')}"
    meta = f"sqlite:///{tmp_path / 'meta.db'}"
    _crash_child(tmp_path, name, point, when)
    rt = _reopen(name, tmp_path, meta)
    try:
        again = rt.write_arrow(epoch_table(3, ROWS), epoch=3)
        assert again.skipped and again.committed  # rolled forward, not written twice
        status = rt.status()
        assert status.last_committed_epoch == 3 and status.pending_epochs == []
        fourth = rt.write_arrow(epoch_table(4, ROWS))
        assert (fourth.epoch, fourth.committed, fourth.skipped) == (4, True, False)
    finally:
        rt.close()
    for sink in SINKS:
        assert_exactly(tmp_path / sink, [1, 2, 3, 4], ROWS)
        assert _committed_attempts(tmp_path / sink, 3) == {"0000"}


@pytest.mark.parametrize(("point", "when"), BEFORE_PENDING)
def test_driver_killed_before_pending(tmp_path: Path, point: str,
                                      when: dict[str, Any]) -> None:
    name = f"rp-before-{point.split('.')[1].replace('_', '')}"
    meta = f"sqlite:///{tmp_path / 'meta.db'}"
    _crash_child(tmp_path, name, point, when)
    rt = _reopen(name, tmp_path, meta)
    try:
        assert ray.get(rt._require_started().coordinator.resolve.remote(3)) == "ABORTED"
        for sink in SINKS:  # the undecided epoch is absent, its staging swept
            assert_exactly(tmp_path / sink, [1, 2], ROWS)
            staging = tmp_path / sink / "_raysink" / "staging" / f"{3:012d}"
            assert not staging.exists() or not any(staging.rglob("*.parquet"))
        again = rt.write_arrow(epoch_table(3, ROWS), epoch=3)
        assert (again.committed, again.skipped) == (True, False)
        fourth = rt.write_arrow(epoch_table(4, ROWS))
        assert fourth.epoch == 4 and fourth.committed
    finally:
        rt.close()
    for sink in SINKS:
        assert_exactly(tmp_path / sink, [1, 2, 3, 4], ROWS)
        # the aborted attempt 0 never mixes with the re-written one
        assert _committed_attempts(tmp_path / sink, 3) == {"0001"}


if __name__ == "__main__":
    child_main(json.loads(sys.argv[1]))
