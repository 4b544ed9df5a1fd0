"""A streaming driver in a process of its own, for tests that SIGKILL it.

``Driver(module, config, log)`` runs ``python -m <module> '<json config>'`` from the
repository root; the driver prints protocol lines starting with ``@@`` (``READY``,
``BATCH <batch_id> <epoch> <rows> <skipped>``, ``DONE <last committed epoch>``), which
arrive on a queue. A killed driver that started its own Ray leaves orphans (raylet, GCS,
agents, workers, the Java executors): ``kill()`` SIGKILLs every process of the driver's
tree, and any process carrying the run's marker in its environment, by pid, and waits
for them.
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

__all__ = ["Driver", "batches", "is_batch"]

_MARKER = "RAYSINK_TEST_DRIVER"
_REPO = Path(__file__).resolve().parents[2]


class Driver:
    """One run of the streaming driver; its stdout protocol lines arrive on a queue."""

    def __init__(self, module: str, config: dict[str, Any], log: Path) -> None:
        self.marker = uuid.uuid4().hex
        env = {**os.environ, _MARKER: self.marker, "PYTHONPATH": str(_REPO)}
        self._log = log.open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, json.dumps(config)],
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

    def wait_fired(self, runtime: str, point: str, timeout: float = 240.0) -> None:
        """Wait until fault ``point`` of ``runtime`` fired; fails at once if the driver
        ends first."""
        from raysink.testing import fired

        deadline = time.monotonic() + timeout
        while not fired(runtime, point):
            if self.proc.poll() is not None:
                raise AssertionError(f"driver exited {self.proc.returncode} before "
                                     f"{point} fired; see {self._log.name}")
            if time.monotonic() > deadline:
                raise AssertionError(f"fault point {point} never fired for {runtime}")
            time.sleep(0.05)

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


def is_batch(batch_id: int) -> Callable[[str], bool]:
    def wanted(line: str) -> bool:
        parsed = _batch(line)
        return parsed is not None and parsed[0] == batch_id
    return wanted


def batches(driver: Driver) -> dict[int, tuple[int, int, bool]]:
    """``batch_id -> (epoch, rows, skipped)`` of every BATCH line the driver printed."""
    out = {}
    for line in driver.seen:
        parsed = _batch(line)
        if parsed is not None:
            out[parsed[0]] = parsed[1:]
    return out
