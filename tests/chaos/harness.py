"""Run one chaos trial: write a few epochs while the killer injects the trial's fault.

Every trial writes epochs ``1..n`` (explicit epoch numbers) through ``write_arrow`` into its
sinks; at ``fault_epoch`` the fault of its kind happens (see ``tests.chaos.plan``). A
driver call that fails with a raysink error is retried (after the fault is removed) with a
new ``feed`` value, so an aborted attempt's rows are told apart from a duplicate. At the
end every epoch must be committed; the checker then compares each target with the input.

Recovery time is from the fault (the kill, the restart, the point firing; for filesystem
faults the moment the fault is removed) to the next epoch the driver saw committed.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

from raysink import RaySinkError, SinkRuntime
from raysink.errors import RuntimeInUseError, SinkUnavailableError
from raysink.testing import arm_fault, disarm_faults
from tests.chaos import node_loss
from tests.chaos.checker import Check, check
from tests.chaos.faults import (
    FiredWatch,
    Tmpfs,
    kill_actor,
    kill_executor,
    run_in_thread,
    wait_fired,
)
from tests.chaos.plan import TrialSpec
from tests.chaos.targets import build_sinks, commit_order, epoch_table, read_target, sink_specs

__all__ = ["TrialEnv", "TrialResult", "run_trial"]

log = logging.getLogger(__name__)

_POINT_STALL = 2.0
_FS_COMMIT_TIMEOUT = 4.0
_REPO = Path(__file__).resolve().parents[2]
_SPARK_SCHEMA = "id long, epoch long, feed int, payload string"


@dataclass(kw_only=True)
class TrialEnv:
    """What trials share: a directory per trial, the Ray cluster, the PostgreSQL server."""

    root: Path
    ray_address: str
    pg: Any = None
    spark: Any = None
    restart_spark: Any = None  # returns a fresh shared Spark session


@dataclass(kw_only=True)
class TrialResult:
    spec: dict[str, Any]
    fired: bool = False
    recovery_seconds: float | None = None
    seconds: float = 0.0
    errors: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)
    failure: str | None = None

    @property
    def ok(self) -> bool:
        return self.failure is None and all(c.ok for c in self.checks)

    def as_dict(self) -> dict[str, Any]:
        return {"spec": self.spec, "fired": self.fired,
                "recovery_seconds": self.recovery_seconds, "seconds": self.seconds,
                "errors": self.errors, "notes": self.notes, "failure": self.failure,
                "checks": [c.as_dict() for c in self.checks]}


def run_trial(spec: TrialSpec, env: TrialEnv) -> TrialResult:
    """Run ``spec`` and check its targets; never raises for a fault the trial survived."""
    trial = _Trial(spec, env)
    started = time.monotonic()
    try:
        trial.run()
    except Exception as exc:
        trial.result.failure = f"{type(exc).__name__}: {exc}"[:2000]
        log.exception("trial %s failed", spec.name)
    finally:
        disarm_faults(spec.name)
        trial.result.seconds = round(time.monotonic() - started, 3)
    return trial.result


class _Trial:
    def __init__(self, spec: TrialSpec, env: TrialEnv) -> None:
        self.spec = spec
        self.env = env
        self.dir = env.root
        self.result = TrialResult(spec=spec.as_dict())
        self.feed = 0
        self.fault_at: float | None = None
        self.tmpfs: Tmpfs | None = None
        self.specs: dict[str, dict[str, Any]] = {}

    # ------------------------------------------------------------------ set-up

    def run(self) -> None:
        fs = self.spec.fault in ("fs_readonly", "fs_full")
        with self._data_dir(fs) as data_dir:
            self.specs = sink_specs(
                self.spec.sink, self.dir, self.spec.name.replace("-", "_"), data_dir=data_dir,
                pg_dsn=self.env.pg.dsn() if self.env.pg is not None else None,
                two_sinks=self.spec.two_sinks, stall=self._stall())
            if self.spec.fault == "driver_kill":
                self._driver_kill()
            elif self.spec.fault == "node_loss":  # a cluster of its own, in a child
                node_loss.run(self.spec, self.specs, self._metastore(), self.dir, self.result)
            else:
                self._in_process()
            self._check()

    @contextlib.contextmanager
    def _data_dir(self, fs: bool) -> Iterator[Path | None]:
        if not fs:
            yield None
            return
        self.tmpfs = Tmpfs(self.dir / "mnt")
        try:
            self.tmpfs.mount()
        except (OSError, subprocess.CalledProcessError) as exc:
            import pytest

            pytest.skip(f"filesystem trials need a tmpfs mount, refused here: {exc}")
        try:
            yield self.tmpfs.path
        finally:
            self.tmpfs.unmount()

    def _stall(self) -> dict[str, Any] | None:
        if self.spec.fault != "stall_commit":
            return None
        return {"seconds": self.spec.extra["stall_seconds"],
                "times": self.spec.extra["stall_times"]}

    def _metastore(self) -> str:
        if self.spec.pg_metastore and self.env.pg is not None:
            return str(self.env.pg.dsn())
        return f"sqlite:///{self.dir / 'meta.db'}"

    def _commit_timeout(self) -> float:
        if self.spec.fault in ("fs_readonly", "fs_full"):
            return _FS_COMMIT_TIMEOUT
        return float(self.spec.extra.get("commit_timeout", 60.0))

    def runtime(self) -> SinkRuntime:
        return SinkRuntime(self.spec.name, build_sinks(self.specs), writers=2,
                           metastore=self._metastore(), flush_interval=self.spec.flush_interval,
                           commit_timeout=self._commit_timeout(), retry_cap=0.5, max_attempts=3)

    # ------------------------------------------------------------------ writing

    def data(self, epoch: int) -> list[pa.Table]:
        self.feed += 1
        table = epoch_table(epoch, self.spec.rows[epoch - 1], self.feed)
        pieces = self.spec.pieces[epoch - 1]
        step = max(1, -(-table.num_rows // pieces))
        parts = [table.slice(i, step) for i in range(0, table.num_rows, step)]
        return parts or [table]

    def _feed(self, rt: SinkRuntime, epoch: int) -> Any:
        """One driver call for ``epoch``: ``write_arrow``, or ``rt.write(df)`` of a Spark
        DataFrame with the same rows in as many partitions as the plan's pieces."""
        parts = self.data(epoch)
        if self.spec.via != "spark":
            return rt.write_arrow(parts, epoch=epoch)
        table = pa.concat_tables(parts)
        df = self.env.spark.createDataFrame(table.to_pandas(), schema=_SPARK_SCHEMA)
        try:
            return rt.write(df.repartition(max(1, len(parts))), epoch=epoch)
        except SinkUnavailableError:
            # what the error tells a user after an executor died for good: restart Spark
            if self.spec.fault == "executor_kill" and self.env.restart_spark is not None:
                self.env.spark = self.env.restart_spark()
            raise

    def write(self, rt: SinkRuntime, epoch: int, tries: int = 6) -> bool:
        """Write ``epoch`` until the driver call succeeds; ``True`` when it is visible."""
        for _ in range(tries):
            try:
                report = self._feed(rt, epoch)
            except RaySinkError as exc:
                self._error(exc)
                time.sleep(getattr(exc, "retry_after", None) or 0.3)
                continue
            if report.committed:
                self._committed()
            else:
                self.result.notes.append(f"epoch {epoch} decided, not yet visible")
            return bool(report.committed)
        raise AssertionError(f"epoch {epoch} could not be written in {tries} driver calls; "
                             f"errors: {self.result.errors}")

    def _error(self, exc: BaseException) -> None:
        self.result.errors.append(type(exc).__name__)
        self.result.notes.append(f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}")

    def _committed(self) -> None:
        if self.fault_at is not None and self.result.recovery_seconds is None:
            self.result.recovery_seconds = round(time.monotonic() - self.fault_at, 3)

    def _wait_all_committed(self, rt: SinkRuntime, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            status = rt.status()
            last = status.last_committed_epoch
            if last is not None and last >= self.spec.epochs:
                self._committed()
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"epochs not all committed after {timeout}s: {status}")
            time.sleep(0.1)

    # ------------------------------------------------------------------ in-process trials

    def _in_process(self) -> None:
        rt = self.runtime().start()
        try:
            for epoch in range(1, self.spec.epochs + 1):
                if epoch == self.spec.fault_epoch:
                    self._faulted(rt, epoch)
                else:
                    self.write(rt, epoch)
            self._wait_all_committed(rt)
        finally:
            rt.close()

    def _faulted(self, rt: SinkRuntime, epoch: int) -> None:
        kind = self.spec.fault
        if kind in ("writer_point", "coordinator_point"):
            self._self_kill(rt, epoch)
        elif kind == "point_external":
            self._point_then(rt, epoch, lambda: self._kill(rt))
        elif kind == "random_kill":
            self._after_delay(rt, epoch, lambda: self._kill(rt))
        elif kind == "executor_kill":
            self._after_delay(rt, epoch, lambda: kill_executor(self.spec.writer))
        elif kind == "pg_restart":
            self._pg_restart(rt, epoch)
        elif kind in ("fs_readonly", "fs_full"):
            self._filesystem(rt, epoch)
        else:  # stall_commit: the sink stalls by itself
            self.fault_at = time.monotonic()
            self.result.fired = True
            self.write(rt, epoch)

    def _when(self, point: str) -> dict[str, Any]:
        when: dict[str, Any] = {"epoch": self.spec.fault_epoch}
        if point.startswith("writer."):
            when.update({"writer": self.spec.writer, "sink": "main"})
        elif point == "sink.mid_commit":
            when["sink"] = "main"
        return when

    def _self_kill(self, rt: SinkRuntime, epoch: int) -> None:
        point = self.spec.point
        assert point is not None
        arm_fault(self.spec.name, point, action="kill", when=self._when(point))
        watch = FiredWatch(self.spec.name, point)
        try:
            self.write(rt, epoch)
        finally:
            self.fault_at = watch.stop()
        self.result.fired = self.fault_at is not None
        if self.fault_at is not None and self.result.recovery_seconds is None:
            self.result.recovery_seconds = round(time.monotonic() - self.fault_at, 3)

    def _point_then(self, rt: SinkRuntime, epoch: int, inject: Any) -> None:
        """Stall the epoch at the trial's point, inject meanwhile, finish the epoch."""
        point = self.spec.point
        assert point is not None
        arm_fault(self.spec.name, point, action="sleep", seconds=_POINT_STALL,
                  when=self._when(point))
        thread, box = run_in_thread(lambda: self.write(rt, epoch))
        if wait_fired(self.spec.name, point, 60.0, box):
            time.sleep(self.spec.delay)
            self.fault_at = time.monotonic()
            self.result.fired = True
            self.result.notes.append(str(inject()))
        else:
            self.result.notes.append(f"{point} never fired")
        self._join(thread, box, epoch)

    def _after_delay(self, rt: SinkRuntime, epoch: int, inject: Any) -> None:
        thread, box = run_in_thread(lambda: self.write(rt, epoch))
        time.sleep(self.spec.delay)
        self.fault_at = time.monotonic()
        self.result.fired = True
        self.result.notes.append(str(inject()))
        self._join(thread, box, epoch)

    def _join(self, thread: threading.Thread, box: dict[str, Any], epoch: int) -> None:
        thread.join(timeout=300)
        if thread.is_alive():
            raise AssertionError(f"epoch {epoch} never finished")
        if "error" in box:
            raise box["error"]
        if box.get("ended") and self.fault_at is not None and box["ended"] < self.fault_at:
            self.result.notes.append("the epoch finished before the fault")

    def _kill(self, rt: SinkRuntime) -> str:
        victim, how = self.spec.victim or "writer", self.spec.how or "sigkill"
        return kill_actor(rt, victim, how, self.spec.writer)

    # ------------------------------------------------------------------ PostgreSQL restart

    def _pg_restart(self, rt: SinkRuntime, epoch: int) -> None:
        pg = self.env.pg

        def restart() -> str:
            pg.restart("immediate")
            return "postgres crash-restarted"

        if self.spec.point is None:
            self._after_delay(rt, epoch, restart)
        else:
            self._point_then(rt, epoch, restart)

    # ------------------------------------------------------------------ filesystem faults

    def _apply_fs(self) -> None:
        assert self.tmpfs is not None
        if self.spec.fault == "fs_readonly":
            self.tmpfs.readonly()
        else:
            self.tmpfs.fill()

    def _remove_fs(self) -> None:
        assert self.tmpfs is not None
        if self.spec.fault == "fs_readonly":
            self.tmpfs.writable()
        else:
            self.tmpfs.unfill()
        self.fault_at = time.monotonic()

    def _filesystem(self, rt: SinkRuntime, epoch: int) -> None:
        """With the fault on: a clear error and nothing of the epoch visible (or, once the
        epoch is decided, a stalled sink); with the fault removed: the epoch commits."""
        self.result.fired = True
        if self.spec.variant == "before_epoch":
            self._apply_fs()
            try:
                report = rt.write_arrow(self.data(epoch), epoch=epoch)
                self.result.notes.append(f"write under the fault returned "
                                         f"committed={report.committed}")
            except RaySinkError as exc:
                self._error(exc)
        else:
            arm_fault(self.spec.name, "coordinator.after_pending", action="sleep",
                      seconds=1.5, when={"epoch": epoch})
            thread, box = run_in_thread(lambda: rt.write_arrow(self.data(epoch), epoch=epoch))
            wait_fired(self.spec.name, "coordinator.after_pending", 60.0, box)
            self._apply_fs()
            thread.join(timeout=120)
            if "error" in box:
                self._error(box["error"])
            elif "result" in box:
                self.result.notes.append(f"write under the fault returned "
                                         f"committed={box['result'].committed}")
        self._observe_under_fault(rt, epoch)
        self._remove_fs()
        self.write(rt, epoch)

    def _observe_under_fault(self, rt: SinkRuntime, epoch: int) -> None:
        """Nothing half-committed: an undecided epoch shows no row; a decided one shows all
        or none of them in an atomic sink (Parquet may show a part until it rolls forward)."""
        status = rt.status()
        decided = epoch in status.pending_epochs or (
            status.last_committed_epoch is not None and status.last_committed_epoch >= epoch)
        for name, spec in self.specs.items():
            rows = read_target(spec, self.env.pg)
            seen = sum(1 for e in rows.column("epoch").to_pylist() if e == epoch)
            total = self.spec.rows[epoch - 1]
            state = status.sinks[name].state
            self.result.notes.append(f"under the fault: sink {name} {state}, epoch {epoch} "
                                     f"decided={decided}, {seen}/{total} rows visible")
            atomic = spec["kind"] != "parquet"
            if (not decided and seen) or (decided and atomic and seen not in (0, total)):
                raise AssertionError(f"epoch {epoch} half-committed in sink {name} under the "
                                     f"fault: {seen} of {total} rows visible")

    # ------------------------------------------------------------------ driver kill

    def _driver_kill(self) -> None:
        child = _Child(self, self._child_config())
        try:
            self._kill_child(child)
        finally:
            child.stop()
        self.result.notes.append(f"driver output: {child.lines[-6:]}")
        rt = self._reopen()
        try:
            for epoch in range(self.spec.fault_epoch, self.spec.epochs + 1):
                self.write(rt, epoch)
            self._wait_all_committed(rt)
        finally:
            rt.close()

    def _child_config(self) -> dict[str, Any]:
        self.feed += 1
        return {"name": self.spec.name, "sinks": self.specs, "metastore": self._metastore(),
                "address": self.env.ray_address, "epochs": self.spec.epochs,
                "rows": self.spec.rows, "pieces": self.spec.pieces, "feed": self.feed,
                "flush_interval": self.spec.flush_interval}

    def _kill_child(self, child: _Child) -> None:
        point, epoch = self.spec.point, self.spec.fault_epoch
        if point is not None:
            arm_fault(self.spec.name, point, action="sleep", seconds=5.0, when=self._when(point))
            reached = child.wait_for(lambda: _fired(self.spec.name, point), 120.0)
        else:
            reached = child.wait_for(lambda: f"START {epoch}" in child.lines, 120.0)
        if not reached:
            raise AssertionError(f"the driver never reached its fault: {child.lines[-10:]} "
                                 f"{child.stderr_tail()}")
        time.sleep(self.spec.delay)
        self.fault_at = time.monotonic()
        child.kill()
        self.result.fired = True
        disarm_faults(self.spec.name)

    def _reopen(self, timeout: float = 60.0) -> SinkRuntime:
        """The same name and meta store, once the dead driver's actors are gone."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self.runtime().start()
            except RuntimeInUseError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    # ------------------------------------------------------------------ checking

    def _check(self) -> None:
        expected = {e: self.spec.rows[e - 1] for e in range(1, self.spec.epochs + 1)}
        for name, spec in self.specs.items():
            rows = read_target(spec, self.env.pg)
            order = commit_order(spec, self.spec.name, name, self.env.pg)
            self.result.checks.append(check(name, rows, expected, order))


def _fired(runtime: str, point: str) -> bool:
    from raysink.testing import fired

    return fired(runtime, point)


class _Child:
    """A driver subprocess on the shared Ray cluster (``tests.chaos.driver_child``)."""

    def __init__(self, trial: _Trial, config: dict[str, Any]) -> None:
        self.lines: list[str] = []
        self._stderr = trial.dir / "driver.stderr"
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
