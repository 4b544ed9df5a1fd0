"""The killer's tools: killing actors, a small tmpfs that can turn read-only or full,
a watcher that notes when a self-firing fault point fired; ``run_in_thread`` comes from
``tests.integration.helpers``."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from raysink.testing import fired
from tests.integration.helpers import run_in_thread

__all__ = ["FiredWatch", "Tmpfs", "kill_actor", "kill_executor", "kill_marked", "run_in_thread",
           "wait_fired"]

log = logging.getLogger(__name__)


def kill_actor(rt: Any, victim: str, how: str, writer: int = 0) -> str:
    """SIGKILL (``how="sigkill"``) or ``ray.kill`` the coordinator or writer ``writer`` of
    sink ``main``. Returns what was done (or why nothing was)."""
    import ray

    actors = rt._actors
    if actors is None:
        return "no actors"
    handle = actors.coordinator if victim == "coordinator" else actors.writers["main"][writer]
    if how == "ray.kill":
        ray.kill(handle)
        return f"ray.kill {victim}"
    try:
        pid = _pid(rt, victim, writer)
    except Exception as exc:  # not started, or closing: nothing to kill
        return f"no pid for {victim}: {type(exc).__name__}"
    if pid is None:  # already restarting: nothing to kill
        return f"no pid for {victim}: not answering"
    os.kill(pid, signal.SIGKILL)
    return f"sigkill {victim} pid {pid}"


def _pid(rt: Any, victim: str, writer: int) -> int | None:
    """The victim's process id by ``rt.processes()`` (``None``: it did not answer)."""
    for process in rt.processes(timeout=15):
        if process.role == victim and (victim == "coordinator"
                                       or (process.sink, process.writer) == ("main", writer)):
            return process.pid
    return None


def kill_executor(which: int, wait: float = 60.0) -> str:
    """SIGKILL the process of RayDP executor actor number ``which`` (modulo the live ones,
    by name), waiting up to ``wait`` seconds for one to be up (RayDP starts executors
    after ``init_spark`` returns). Returns what was done."""
    from ray._private.state import actors

    deadline = time.monotonic() + wait
    while True:
        alive = sorted((info["Name"], int(info["Pid"]))
                       for info in actors(actor_state_name="ALIVE").values()
                       if str(info.get("Name") or "").startswith("raydp-executor-"))
        if alive or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    if not alive:
        return "no live RayDP executor"
    name, pid = alive[which % len(alive)]
    os.kill(pid, signal.SIGKILL)
    return f"sigkill {name} pid {pid}"


def kill_marked(marker: Path, timeout: float, box: dict[str, Any], *, delay: float,
                note: Callable[[Callable[[], str]], None]) -> bool:
    """Once a producer announced its pid in ``marker`` (see ``tests.chaos.producers.Hold``),
    wait ``delay`` and SIGKILL it, through ``note`` (which records the moment and what was
    done). ``False`` when ``box``'s call ended, or ``timeout`` passed, with no announcement."""
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(OSError, ValueError):
            pid = int(marker.read_text())
            break
        if time.monotonic() > deadline or "ended" in box:
            return False
        time.sleep(0.01)
    time.sleep(delay)

    def kill() -> str:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return f"producer pid {pid} already gone"
        return f"sigkill producer pid {pid}"

    note(kill)
    return True


def wait_fired(runtime: str, point: str, timeout: float, box: dict[str, Any] | None = None
               ) -> bool:
    """Wait until ``point`` fired; ``False`` on timeout or when ``box``'s call ended first."""
    deadline = time.monotonic() + timeout
    while not fired(runtime, point):
        if time.monotonic() > deadline or (box is not None and "ended" in box):
            return fired(runtime, point)
        time.sleep(0.01)
    return True


class FiredWatch:
    """Notes the moment a self-firing (``kill``) fault point fires, from a thread."""

    def __init__(self, runtime: str, point: str) -> None:
        self.at: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, args=(runtime, point), daemon=True)
        self._thread.start()

    def _poll(self, runtime: str, point: str) -> None:
        while not self._stop.is_set():
            if fired(runtime, point):
                self.at = time.monotonic()
                return
            time.sleep(0.005)

    def stop(self) -> float | None:
        self._stop.set()
        self._thread.join(timeout=5)
        return self.at


def _mount(*args: str) -> None:
    subprocess.run(["mount", *args], check=True, capture_output=True, text=True, timeout=30)


class Tmpfs:
    """A small tmpfs at ``path`` that the killer can make read-only or full, and heal."""

    def __init__(self, path: Path, size: str = "4m") -> None:
        self.path = path
        self.size = size
        self._filler = path / ".filler"
        self.mounted = False

    @staticmethod
    def allowed() -> bool:
        return os.geteuid() == 0

    def mount(self) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        _mount("-t", "tmpfs", "-o", f"size={self.size}", "tmpfs", str(self.path))
        self.mounted = True

    def readonly(self) -> None:
        """Remount read-only (retried: a file open for writing makes the remount busy)."""
        deadline = time.monotonic() + 10
        while True:
            try:
                _mount("-o", "remount,ro", str(self.path))
                return
            except subprocess.CalledProcessError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def writable(self) -> None:
        _mount("-o", "remount,rw", str(self.path))

    def fill(self) -> None:
        """Write zeros until the filesystem is full."""
        chunk = b"\0" * 65536
        with open(self._filler, "ab", buffering=0) as handle:
            while True:
                try:
                    handle.write(chunk)
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    break
        with contextlib.suppress(OSError), open(self.path / ".filler2", "ab",
                                                buffering=0) as more:
            for _ in range(64):
                more.write(b"\0" * 512)

    def unfill(self) -> None:
        for name in (".filler", ".filler2"):
            (self.path / name).unlink(missing_ok=True)

    def unmount(self) -> None:
        if not self.mounted:
            return
        with contextlib.suppress(subprocess.CalledProcessError):
            self.writable()
        try:
            subprocess.run(["umount", str(self.path)], check=True, capture_output=True,
                           timeout=30)
        except subprocess.CalledProcessError:
            subprocess.run(["umount", "-l", str(self.path)], check=False,
                           capture_output=True, timeout=30)
        self.mounted = False

    @contextlib.contextmanager
    def mounted_at(self) -> Iterator[Tmpfs]:
        self.mount()
        try:
            yield self
        finally:
            self.unmount()
