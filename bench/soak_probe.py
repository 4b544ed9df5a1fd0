"""What ``bench/soak.py`` watches while it runs: each process's memory (USS) and CPU
time, and per runtime its writers' mailbox depths, its outstanding epochs and its meta
store's rows.

A ``Watched`` runtime names its bounds; the ``Sampler`` thread probes every runtime each
``probe_seconds`` and samples memory and CPU every ``sample_seconds`` (the driver, every
raysink actor of every runtime, the extra processes a runtime names: the stream's
producers, and Ray's own processes under this driver: ``gcs_server``, ``raylet`` and its
agents), with one progress line on stderr per sample.
"""

from __future__ import annotations

import os
import sqlite3
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from raysink import SinkRuntime

MIB = 2**20


@dataclass
class Series:
    """One process's samples: USS as (seconds since start, bytes), CPU time (user and
    system, every thread) as (seconds since start, seconds of this pid so far)."""

    label: str
    pids: list[int] = field(default_factory=list)
    samples: list[tuple[float, int]] = field(default_factory=list)
    cpu: list[tuple[float, float]] = field(default_factory=list)

    def add(self, pid: int, at: float, uss: int, cpu: float) -> None:
        if not self.pids or self.pids[-1] != pid:
            self.pids.append(pid)
        self.samples.append((at, uss))
        self.cpu.append((at, cpu))

    @property
    def restarts(self) -> int:
        return max(0, len(self.pids) - 1)


@dataclass
class Bounds:
    """Highest values seen by one runtime's probes, and the probes over a bound."""

    mailbox_max: dict[str, int] = field(default_factory=dict)
    outstanding_max: int = 0
    pending_max: int = 0
    epoch_rows_max: int = 0
    status_rows_max: int = 0
    probes: int = 0
    probe_errors: int = 0
    violations: list[str] = field(default_factory=list)


@dataclass(kw_only=True)
class Watched:
    """A runtime under watch and its bounds."""

    label: str
    rt: SinkRuntime
    metastore: Path
    sinks: int
    mailbox_limit: int
    max_pending_epochs: int
    extra_pids: Callable[[], dict[str, int]] = dict
    bounds: Bounds = field(default_factory=Bounds)

    @property
    def epoch_rows_limit(self) -> int:
        """Epoch rows the meta store keeps at most: the outstanding epochs and the last
        committed ones, per sink."""
        return self.sinks * (self.max_pending_epochs + 2)


def uss_and_cpu(pid: int) -> tuple[int, float] | None:
    """A process's USS and its CPU seconds so far (user and system)."""
    try:
        process = psutil.Process(pid)
        value: int = process.memory_full_info().uss
        times = process.cpu_times()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None
    return value, times.user + times.system


_RAY_AGENTS = {"dashboard/agent.py": "ray dashboard agent",
               "runtime_env/agent": "ray runtime env agent",
               "log_monitor.py": "ray log monitor"}


def ray_system_pids() -> dict[str, int]:
    """Ray's own processes under this driver (its local Ray): the GCS, the raylet and the
    agents, by a readable label."""
    found: dict[str, int] = {}
    for child in psutil.Process().children(recursive=True):
        try:
            name, cmdline = child.name(), " ".join(child.cmdline())
        except psutil.Error:
            continue
        if name in ("gcs_server", "raylet"):
            found[f"ray {name}"] = child.pid
            continue
        for marker, label in _RAY_AGENTS.items():
            if marker in cmdline:
                found[label] = child.pid
    return found


def actor_pids(rt: SinkRuntime) -> dict[str, int]:
    """The pid of the coordinator and of every writer that answered, by a readable label."""
    return {(process.role if process.writer is None
             else f"writer {process.sink}-{process.writer}"): process.pid
            for process in rt.processes(timeout=30) if process.pid is not None}


def mailbox_depths(rt: SinkRuntime) -> dict[str, int]:
    return {f"{process.sink}-{process.writer}": process.mailbox.mailbox_depth
            for process in rt.processes(timeout=30) if process.mailbox is not None}


def outstanding_epochs(rt: SinkRuntime) -> tuple[int, int]:
    """(open plus pending, pending) epochs at the coordinator: what
    ``max_pending_epochs`` bounds."""
    status = rt.status()
    pending, opened = status.pending_epochs, status.open_epoch
    return len(pending) + (1 if opened is not None and opened not in pending else 0), len(pending)


def metastore_rows(path: Path, runtime: str) -> tuple[int, int] | None:
    """(epoch rows, sink status rows) of ``runtime``, read-only; None when unreadable."""
    if not path.exists():
        return None
    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)
        try:
            epochs = conn.execute("SELECT count(*) FROM raysink_epochs WHERE runtime = ?",
                                  (runtime,)).fetchone()[0]
            status = conn.execute("SELECT count(*) FROM raysink_sink_status "
                                  "WHERE runtime = ?", (runtime,)).fetchone()[0]
        finally:
            conn.close()
    except sqlite3.Error:
        return None
    return int(epochs), int(status)


class Sampler:
    """A thread: bounds every ``probe_seconds``; memory and a progress line every
    ``sample_seconds``. ``progress()`` gives the progress line's figures."""

    def __init__(self, watched: list[Watched], *, probe_seconds: float,
                 sample_seconds: float, progress: Callable[[], str]) -> None:
        self.watched = watched
        self.probe_seconds, self.sample_seconds = probe_seconds, sample_seconds
        self.progress = progress
        self.series: dict[str, Series] = {}
        self.started = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-sampler", daemon=True)

    def start(self) -> None:
        self.sample_memory()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        next_sample = time.monotonic() + self.sample_seconds
        while not self._stop.wait(self.probe_seconds):
            for watched in self.watched:
                self.probe_bounds(watched)
            if time.monotonic() >= next_sample:
                next_sample += self.sample_seconds
                self.sample_memory()
                self.print_progress()

    def sample_memory(self) -> None:
        at = time.monotonic() - self.started
        targets = {"driver": os.getpid(), **ray_system_pids()}
        for watched in self.watched:
            try:
                pids = {**actor_pids(watched.rt), **watched.extra_pids()}
            except Exception as exc:
                print(f"[soak] could not reach an actor of {watched.label}: {exc}",
                      file=sys.stderr)
                continue
            targets.update({f"{watched.label} {name}": pid for name, pid in pids.items()})
        for label, pid in targets.items():
            value = uss_and_cpu(pid)
            if value is not None:
                self.series.setdefault(label, Series(label)).add(pid, at, *value)

    def probe_bounds(self, watched: Watched) -> None:
        bounds = watched.bounds
        bounds.probes += 1
        at = time.monotonic() - self.started
        try:
            depths = mailbox_depths(watched.rt)
            outstanding, pending = outstanding_epochs(watched.rt)
        except Exception as exc:
            bounds.probe_errors += 1
            print(f"[soak] probe of {watched.label} failed: {exc}", file=sys.stderr)
            return
        for label, depth in depths.items():
            bounds.mailbox_max[label] = max(bounds.mailbox_max.get(label, 0), depth)
            if depth > watched.mailbox_limit:
                bounds.violations.append(f"{at:.0f}s: writer {label} mailbox depth {depth} "
                                         f"> {watched.mailbox_limit}")
        bounds.outstanding_max = max(bounds.outstanding_max, outstanding)
        bounds.pending_max = max(bounds.pending_max, pending)
        if outstanding > watched.max_pending_epochs:
            bounds.violations.append(f"{at:.0f}s: {outstanding} outstanding epochs > "
                                     f"max_pending_epochs {watched.max_pending_epochs}")
        self.probe_metastore(watched, at)

    def probe_metastore(self, watched: Watched, at: float) -> None:
        bounds = watched.bounds
        rows = metastore_rows(watched.metastore, watched.rt.name)
        if rows is None:
            bounds.probe_errors += 1
            return
        epochs, status = rows
        bounds.epoch_rows_max = max(bounds.epoch_rows_max, epochs)
        bounds.status_rows_max = max(bounds.status_rows_max, status)
        if epochs > watched.epoch_rows_limit:
            bounds.violations.append(f"{at:.0f}s: {epochs} meta store epoch rows > "
                                     f"{watched.epoch_rows_limit}")
        if status > watched.sinks:
            bounds.violations.append(f"{at:.0f}s: {status} sink status rows > "
                                     f"{watched.sinks}")

    def print_progress(self) -> None:
        elapsed = time.monotonic() - self.started
        driver = self.series.get("driver")
        driver_mib = driver.samples[-1][1] / MIB if driver and driver.samples else 0.0
        minutes, seconds = divmod(int(elapsed), 60)
        print(f"[soak] {minutes:02d}:{seconds:02d}  {self.progress()}  driver USS "
              f"{driver_mib:,.1f} MiB", file=sys.stderr, flush=True)
