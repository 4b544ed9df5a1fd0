"""Driver-kill trials: a subprocess driver (``tests.chaos.driver_child``) on the test
session's Ray is SIGKILLed mid-epoch (when it started the fault epoch, or while a
protocol point of it holds); the runtime is then reopened in this process with the same
name and meta store, and the trial's epochs are written to the end the same way in
(``arrow``, ``feeds``, ``datasink``), or, for a stream, its producers resume after the
last committed epoch from their offset books (the dead driver's producer actors died
with it).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from raysink import SinkRuntime
from raysink.errors import RuntimeInUseError
from raysink.testing import arm_fault, disarm_faults, fired

__all__ = ["DriverChild", "kill_driver", "reopen"]

_REPO = Path(__file__).resolve().parents[2]


def kill_driver(trial: Any, config: dict[str, Any]) -> None:
    """Start the child driver, SIGKILL it at the trial's fault, note what it printed."""
    spec = trial.spec
    child = DriverChild(trial.dir, config)
    try:
        point, epoch = spec.point, spec.fault_epoch
        if point is not None:
            arm_fault(spec.name, point, action="sleep", seconds=5.0, when=trial.when(point))
            reached = child.wait_for(lambda: fired(spec.name, point), 120.0)
        else:
            started = "STREAMING" if spec.via == "stream" else f"START {epoch}"
            reached = child.wait_for(lambda: started in child.lines, 120.0)
        if not reached:
            raise AssertionError(f"the driver never reached its fault: {child.lines[-10:]} "
                                 f"{child.stderr_tail()}")
        time.sleep(spec.delay)
        trial.fault_at = time.monotonic()
        child.kill()
        trial.result.fired = True
        disarm_faults(spec.name)
    finally:
        child.stop()
    trial.result.notes.append(f"driver output: {child.lines[-6:]}")


def reopen(make: Any, timeout: float = 60.0) -> SinkRuntime:
    """The same name and meta store, once the dead driver's actors are gone."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            rt: SinkRuntime = make().start()
            return rt
        except RuntimeInUseError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


class DriverChild:
    """A driver subprocess on the shared Ray cluster (``tests.chaos.driver_child``)."""

    def __init__(self, directory: Path, config: dict[str, Any]) -> None:
        self.lines: list[str] = []
        self._stderr = directory / "driver.stderr"
        with open(self._stderr, "wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tests.chaos.driver_child", json.dumps(config)],
                cwd=_REPO, stdout=subprocess.PIPE, stderr=err, text=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.strip())

    def wait_for(self, condition: Any, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline or self.proc.poll() is not None:
                return bool(condition())
            time.sleep(0.01)
        return True

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, 9)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.kill()
        self.proc.wait(timeout=30)
        self._reader.join(timeout=5)

    def stderr_tail(self) -> str:
        try:
            return self._stderr.read_text(errors="replace")[-2000:]
        except OSError:
            return ""
