"""Stream trials: ``rt.stream()`` fed by long-lived ``StreamProducer`` actors.

Each producer writes its replayable source (``extra["stream"]``: producers, batches,
rows per batch, a pause between batches) and follows the producer's contract; the
runtime cuts an epoch every ``interval`` seconds. The trial's fault happens while they
write (at a protocol point of stream epoch ``fault_epoch``, after a delay into the
stream, or, for a filesystem fault, for a few seconds from that epoch on). A producer
whose actor was killed (a producer-kill trial) is restarted by Ray; its ``run`` is
called again and it resumes after ``feed.committed()``. When every producer's source
is written and committed, ``rt.close()`` drains the stream; the target must hold every
source row exactly once (the checker's groups are the producers).

Recovery time: from the fault to the first epoch committed after it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

from tests.chaos.producers import StreamProducer

__all__ = ["StreamRun", "expected_rows"]

log = logging.getLogger(__name__)

_RUN_SECONDS = 150.0
_RESTART_SECONDS = 60.0


def _book(path: Path) -> dict[str, int]:
    try:
        ends: dict[str, int] = json.loads(path.read_text()).get("ends", {})
    except (OSError, ValueError):
        return {}
    return ends


def expected_rows(source: dict[str, Any]) -> dict[int, int]:
    """Group (producer + 1) -> the rows of its source."""
    return {p + 1: int(source["batches"]) * int(source["batch_rows"])
            for p in range(int(source["producers"]))}


class StreamRun:
    """The stream's producers at work, and a watch of the epochs committed."""

    def __init__(self, rt: Any, directory: Path, source: dict[str, Any]) -> None:
        import ray

        self.rt = rt
        self.source = source
        self.dir = directory
        self.actors = [StreamProducer.remote(  # type: ignore[attr-defined]
            p, rt.stream(poll_interval=float(source["poll"])),
            str(directory / f"offsets-{p}.json"), source)
            for p in range(int(source["producers"]))]
        self.pids = ray.get([a.pid.remote() for a in self.actors], timeout=60)
        self.restarts = 0
        self.outcomes: list[dict[str, int]] = []
        self.commits: list[tuple[float, int]] = []  # (when, last committed epoch)
        self._stop = threading.Event()
        self._watch = threading.Thread(target=self._watch_commits, daemon=True)
        self._watch.start()
        self._runs: dict[int, Any] = {}

    def _watch_commits(self) -> None:
        last: int | None = None
        while not self._stop.wait(0.1):
            try:
                committed = self.rt.status().last_committed_epoch
            except Exception as exc:  # the coordinator restarting
                log.debug("status: %s", exc)
                continue
            if committed is not None and committed != last:
                self.commits.append((time.monotonic(), committed))
                last = committed

    def first_data_epoch(self, timeout: float, box: dict[str, Any]) -> int | None:
        """The first epoch a producer noted writing into (its offset book), once one did;
        ``None`` when ``box``'s run ended or ``timeout`` passed first."""
        deadline = time.monotonic() + timeout
        while "ended" not in box and time.monotonic() < deadline:
            noted = [int(e) for p in range(len(self.actors))
                     for e in _book(self.dir / f"offsets-{p}.json")]
            if noted:
                return min(noted)
            time.sleep(0.02)
        return None

    def committed_after(self, moment: float) -> float | None:
        """Seconds from ``moment`` to the first epoch committed after it."""
        before = max((e for t, e in self.commits if t <= moment), default=0)
        later = [t for t, e in self.commits if t > moment and e > before]
        return round(later[0] - moment, 3) if later else None

    def run(self) -> list[dict[str, int]]:
        """Start every producer's run and wait for them; a run whose actor died runs
        again (restarted by Ray). Any other failure of a producer is the trial's failure."""
        import ray

        self._runs = {p: a.run.remote() for p, a in enumerate(self.actors)}
        deadline = time.monotonic() + _RUN_SECONDS
        while self._runs:
            ready, _ = ray.wait(list(self._runs.values()), num_returns=1,
                                timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                raise AssertionError(f"producers {sorted(self._runs)} still running after "
                                     f"{_RUN_SECONDS:g} s")
            producer = next(p for p, ref in self._runs.items() if ref == ready[0])
            try:
                self.outcomes.append(ray.get(ready[0]))
                del self._runs[producer]
            except ray.exceptions.RayTaskError as exc:  # the producer raised: not its death
                raise AssertionError(f"stream producer {producer} failed: {exc}") from exc
            except ray.exceptions.RayActorError:  # its process died: Ray restarts it
                self._runs[producer] = self._run_again(producer)
        return self.outcomes

    def _run_again(self, producer: int) -> Any:
        """The producer's actor died: once Ray restarted it, run it again."""
        import ray

        actor = self.actors[producer]
        deadline = time.monotonic() + _RESTART_SECONDS
        while True:
            try:
                self.pids[producer] = ray.get(actor.pid.remote(), timeout=10)
                break
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        self.restarts += 1
        return actor.run.remote()

    def kill_producer(self, producer: int) -> str:
        pid = self.pids[producer % len(self.pids)]
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        return f"sigkill stream producer {producer % len(self.pids)} pid {pid}"

    def stop(self) -> None:
        """After the runtime closed: the watch and the producers end."""
        import ray

        self._stop.set()
        self._watch.join(timeout=5)
        for actor in self.actors:
            ray.kill(actor)
