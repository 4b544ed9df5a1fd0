"""Run one chaos trial: write through its way in while the killer injects its fault.

An epoch way in (see ``tests.chaos.ways``) writes epochs ``1..n`` (explicit epoch
numbers) into the trial's sinks; at ``fault_epoch`` the fault of its kind happens (see
``tests.chaos.plan``). A driver call that fails with a raysink error (or whose producers
failed) is retried, after the fault is removed, with a new ``feed`` value, so an aborted
attempt's rows are told apart from a duplicate. At the end every epoch must be
committed. A stream trial (``tests.chaos.streams``) runs its producers while the fault
happens, then drains. The checker then compares each target with the input.

Recovery time is from the fault (the kill, the restart, the point firing; for filesystem
faults the moment the fault is removed) to the next epoch the driver saw committed.
"""

from __future__ import annotations

import contextlib
import logging
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

from raysink import RaySinkError, SinkRuntime
from raysink.errors import MetaStoreError, SinkUnavailableError
from raysink.testing import arm_fault, disarm_faults, fired, fired_context
from tests.chaos import maintenance, node_loss
from tests.chaos.checker import Check, check
from tests.chaos.driver_kill import kill_driver, reopen
from tests.chaos.faults import (
    FiredWatch,
    Tmpfs,
    kill_actor,
    kill_executor,
    kill_marked,
    run_in_thread,
    wait_fired,
)
from tests.chaos.leader_kill import kill_leader
from tests.chaos.plan import TrialSpec
from tests.chaos.streams import StreamRun, expected_rows
from tests.chaos.targets import (
    build_sinks,
    commit_order,
    epoch_table,
    order_problems,
    read_target,
    sink_specs,
)
from tests.chaos.ways import ProducerFailed, WayIn

__all__ = ["TrialEnv", "TrialResult", "run_trial"]

log = logging.getLogger(__name__)

_POINT_STALL = 2.0
_FS_COMMIT_TIMEOUT = 4.0
_FS_HOLD = 2.5  # seconds a filesystem fault lasts in a stream trial
_FEED_TIMEOUT = 5.0  # a killed producer is found lost this soon
_PATIENCE = 60.0  # seconds a driver call is retried while a service comes back
_COMING_BACK = (MetaStoreError, SinkUnavailableError)


@dataclass(kw_only=True)
class TrialEnv:
    """What trials share: a directory per trial, the Ray cluster, the PostgreSQL server,
    the Kafka broker (``tests.support.kafka.KafkaBroker``)."""

    root: Path
    ray_address: str
    pg: Any = None
    kafka: Any = None
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
    phases: dict[str, float] = field(default_factory=dict)
    """Seconds from the trial's start to the end of each of its phases (where it spends)."""

    @property
    def ok(self) -> bool:
        return self.failure is None and all(c.ok for c in self.checks)

    def as_dict(self) -> dict[str, Any]:
        return {"spec": self.spec, "fired": self.fired,
                "recovery_seconds": self.recovery_seconds, "seconds": self.seconds,
                "errors": self.errors, "notes": self.notes, "failure": self.failure,
                "phases": self.phases,
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
        if trial.forced is not None:  # the trial failed before its final pass
            trial.forced.stop(quiet=True)
        if trial.watch is not None:
            trial.watch.stop()
        disarm_faults(spec.name)
        trial.way.close()
        if trial.way.producer_errors:
            trial.result.notes.append(f"producers' errors: {trial.way.producer_errors}")
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
        self.way = WayIn(spec, env, self.dir)
        self.stream: StreamRun | None = None
        self.fault_epoch = spec.fault_epoch  # a stream's: counted from its first data
        self.last_epoch: int | None = None  # after a maintenance trial's final pass
        self.forced: maintenance.ForcedPasses | None = None
        self.watch: FiredWatch | None = None  # a point that may fire after its epoch
        self._t0 = time.monotonic()

    def phase(self, name: str) -> None:
        """Note that phase ``name`` ended now."""
        self.result.phases[name] = round(time.monotonic() - self._t0, 3)

    # ------------------------------------------------------------------ set-up

    def run(self) -> None:
        fs = self.spec.fault in ("fs_readonly", "fs_full")
        with self._data_dir(fs) as data_dir:
            self.specs = sink_specs(
                self.spec.sink, self.dir, self.spec.name.replace("-", "_"), data_dir=data_dir,
                pg_dsn=self.env.pg.dsn() if self.env.pg is not None else None,
                kafka=self.env.kafka.bootstrap if self.env.kafka is not None else None,
                two_sinks=self.spec.two_sinks, stall=self._stall(),
                maintenance=self.spec.extra.get("maintenance"))
            if self.spec.fault == "driver_kill":
                self._driver_kill()
            elif self.spec.fault == "node_loss":  # a cluster of its own, in a child
                node_loss.run(self.spec, self.specs, self._metastore(), self.dir, self.result)
            elif self.spec.via == "stream":
                self._streamed()
            else:
                self._in_process()
            self._check()
            self.phase("checked")

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

    def options(self) -> dict[str, Any]:
        """The runtime's options beyond the sinks, writers and meta store."""
        timeout = (_FS_COMMIT_TIMEOUT if self.spec.fault in ("fs_readonly", "fs_full")
                   else float(self.spec.extra.get("commit_timeout", 60.0)))
        options: dict[str, Any] = {"commit_timeout": timeout, "feed_timeout": _FEED_TIMEOUT}
        if self.spec.via == "stream":
            options["checkpoint_interval"] = float(self.spec.extra["stream"]["interval"])
        return options

    def runtime(self) -> SinkRuntime:
        return SinkRuntime(self.spec.name, build_sinks(self.specs), writers=2,
                           metastore=self._metastore(), flush_interval=self.spec.flush_interval,
                           retry_cap=0.5, max_attempts=3, progress=False, **self.options())

    # ------------------------------------------------------------------ writing

    def data(self, epoch: int) -> list[pa.Table]:
        self.feed += 1
        table = epoch_table(epoch, self.spec.rows[epoch - 1], self.feed)
        pieces = self.spec.pieces[epoch - 1]
        step = max(1, -(-table.num_rows // pieces))
        parts = [table.slice(i, step) for i in range(0, table.num_rows, step)]
        return parts or [table]

    def write(self, rt: SinkRuntime, epoch: int, tries: int = 6) -> bool:
        """Write ``epoch`` until the driver call succeeds; ``True`` when it is visible.

        A user's retry loop: ``tries`` calls, each after the error's ``retry_after`` (or
        0.3 s); past them, calls go on every second while the last error says a service
        is coming back (the meta store or a target unreachable, ``_COMING_BACK``), up to
        ``_PATIENCE`` seconds from the first call. A PostgreSQL crash restart replays its
        WAL before it takes connections ("the database system is starting up"), which
        outlasted the six quick tries on a loaded machine (seed 3641: t0378, t0434,
        t0460). The first ``tries`` calls are as before, so a trial that succeeded
        within them runs the same."""
        started, calls, last = time.monotonic(), 0, None
        while calls < tries or (isinstance(last, _COMING_BACK)
                                and time.monotonic() - started < _PATIENCE):
            calls += 1
            try:
                report = self.way.write(rt, epoch, self.data(epoch))
            except (RaySinkError, ProducerFailed) as exc:
                self._error(exc)
                last = exc
                time.sleep(getattr(exc, "retry_after", None) or (0.3 if calls < tries
                                                                 else 1.0))
                continue
            if report.committed:
                self._committed()
            else:
                self.result.notes.append(f"epoch {epoch} decided, not yet visible")
            return bool(report.committed)
        raise AssertionError(f"epoch {epoch} could not be written in {calls} driver calls; "
                             f"errors: {self.result.errors}")

    def _error(self, exc: BaseException) -> None:
        self.result.errors.append(type(exc).__name__)
        self.result.notes.append(f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}")

    def _committed(self) -> None:
        if self.fault_at is None and self.watch is not None:
            self.fault_at = self.watch.at
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
        self.phase("runtime started")
        try:
            for epoch in range(1, self.spec.epochs + 1):
                if epoch == self.spec.fault_epoch:
                    self._faulted(rt, epoch, lambda e=epoch: self.write(rt, e))
                else:
                    self.write(rt, epoch)
                self.phase(f"epoch {epoch}")
            self._wait_all_committed(rt)
            self._final_pass(rt)
        finally:
            rt.close()
            self.phase("runtime closed")

    def _streamed(self, rt: SinkRuntime | None = None) -> None:
        """The stream's producers write while the fault happens; then it drains."""
        rt = rt or self.runtime().start()
        self.phase("runtime started")
        try:
            self.stream = stream = StreamRun(rt, self.dir, self.spec.extra["stream"])
            self.phase("producers started")
            if self.spec.fault == "driver_kill":
                stream.run()
            else:
                thread, box = run_in_thread(stream.run)
                first = stream.first_data_epoch(120.0, box)
                self.phase("first data")
                # the fault comes in the next epoch: one the producers certainly write
                # into, not sealed before the fault is armed (the one after it may never
                # come: seed 1126's t0037, a stream into two Iceberg tables, had data in
                # epochs 1 and 2 only, and its fault, armed for epoch 3, never fired)
                self.fault_epoch = (first or 0) + 1
                self._faulted(rt, self.fault_epoch, lambda: self._join(thread, box))
            self.phase("producers done")
            self._final_pass(rt)
        finally:
            rt.close()
            self.phase("runtime closed")
            if self.stream is not None:
                self.stream.stop()
                self.phase("producers stopped")
        self.result.notes.append(f"stream: {self.stream.outcomes}, producer restarts "
                                 f"{self.stream.restarts}")
        if self.fault_at is not None:
            self.result.recovery_seconds = self.stream.committed_after(self.fault_at)

    def _faulted(self, rt: SinkRuntime, epoch: int, work: Callable[[], Any]) -> None:
        """Run ``work`` (the fault epoch's write, or the stream) under the trial's fault."""
        kind = self.spec.fault
        if kind in ("writer_point", "coordinator_point"):
            self._self_kill(work)
        elif kind == "point_external":
            self._point_then(work, lambda: self._kill(rt))
        elif kind == "random_kill":
            self._after_delay(work, lambda: self._kill(rt))
        elif kind == "executor_kill":
            self._after_delay(work, lambda: kill_executor(self.spec.writer))
        elif kind == "producer_kill":
            self._producer_kill(work)
        elif kind == "pg_restart":
            self._pg_restart(work)
        elif kind == "broker_restart":
            self._broker_restart(work)
        elif kind == "broker_pause":
            self._broker_pause(work)
        elif kind == "hanging_txn":
            self._hanging_txn(work)
        elif kind == "leader_kill":
            self._leader_kill(work)
        elif kind == "maintenance_point":
            self._maintenance_point(rt, work)
        elif kind in ("fs_readonly", "fs_full"):
            if self.stream is not None:
                self._filesystem_stream(rt, work)
            else:
                self._filesystem(rt, epoch)
        else:  # stall_commit: the sink stalls by itself
            self.fault_at = time.monotonic()
            self.result.fired = True
            work()

    def when(self, point: str) -> dict[str, Any]:
        when: dict[str, Any] = {"epoch": self.fault_epoch}
        if point.startswith("writer."):
            # the first writer of sink main to get there, whichever it is: which writers
            # an epoch reaches is Ray Data's, Spark's or the producers' choice (a writer
            # named here was often one the epoch never reached: the fault never fired);
            # an external kill goes to the writer the point fired in (``_kill``)
            when["sink"] = "main"
        elif point == "sink.mid_commit":
            when["sink"] = "main"
        return when

    def _self_kill(self, work: Callable[[], Any]) -> None:
        point = self.spec.point
        assert point is not None
        arm_fault(self.spec.name, point, action="kill", when=self.when(point))
        watch = FiredWatch(self.spec.name, point)
        try:
            work()
        finally:
            self.fault_at = watch.stop()
            self.result.fired = self.fault_at is not None
        if self.fault_at is not None and self.result.recovery_seconds is None:
            self.result.recovery_seconds = round(time.monotonic() - self.fault_at, 3)

    def _point_then(self, work: Callable[[], Any], inject: Callable[[], Any]) -> None:
        """Stall the epoch at the trial's point, inject meanwhile, finish the work."""
        point = self.spec.point
        assert point is not None
        arm_fault(self.spec.name, point, action="sleep", seconds=_POINT_STALL,
                  when=self.when(point))
        thread, box = run_in_thread(work)
        if wait_fired(self.spec.name, point, 60.0, box):
            time.sleep(self.spec.delay)
            self._inject(inject)
        else:
            self.result.notes.append(f"{point} never fired")
        self._join(thread, box)

    def _after_delay(self, work: Callable[[], Any], inject: Callable[[], Any]) -> None:
        thread, box = run_in_thread(work)
        time.sleep(self.spec.delay)
        self._inject(inject)
        self._join(thread, box)

    def _inject(self, inject: Callable[[], Any]) -> None:
        self.fault_at = time.monotonic()
        self.result.fired = True
        self.result.notes.append(str(inject()))

    def _join(self, thread: threading.Thread, box: dict[str, Any]) -> None:
        thread.join(timeout=300)
        if thread.is_alive():
            raise AssertionError(f"the fault epoch ({self.fault_epoch}) never finished")
        if "error" in box:
            raise box["error"]
        if box.get("ended") and self.fault_at is not None and box["ended"] < self.fault_at:
            self.result.notes.append("the work finished before the fault")

    def _kill(self, rt: SinkRuntime) -> str:
        victim, how = self.spec.victim or "writer", self.spec.how or "sigkill"
        return kill_actor(rt, victim, how, self._victim_writer())

    def _victim_writer(self) -> int:
        """The writer the trial's point fired in, if it is a writer point and fired;
        else the plan's writer."""
        point = self.spec.point
        context = (fired_context(self.spec.name, point)
                   if point is not None and point.startswith("writer.") else None)
        return int(context["writer"]) if context and "writer" in context else self.spec.writer

    # ------------------------------------------------------------------ producers killed

    def _producer_kill(self, work: Callable[[], Any]) -> None:
        """SIGKILL the victim producer mid-epoch: a stream producer ``delay`` seconds
        into the stream; a feed or write task's worker, or the feed producer actor, once
        it announced itself (it holds, having sent part of its data)."""
        if self.stream is not None:
            stream = self.stream
            self._after_delay(work, lambda: stream.kill_producer(self.spec.writer))
            return
        marker = self.dir / f"victim-{self.spec.fault_epoch}.pid"
        self.way.hold_next(str(self.spec.victim), marker)
        thread, box = run_in_thread(work)
        if not kill_marked(marker, 120.0, box, delay=self.spec.delay, note=self._inject):
            self.result.notes.append(f"the victim {self.spec.victim} never announced itself")
        self._join(thread, box)

    # ------------------------------------------------------------------ PostgreSQL restart

    def _pg_restart(self, work: Callable[[], Any]) -> None:
        pg = self.env.pg

        def restart() -> str:
            pg.restart("immediate")
            return "postgres crash-restarted"

        if self.spec.point is None:
            self._after_delay(work, restart)
        else:
            self._point_then(work, restart)

    # ------------------------------------------------------------------ Kafka broker restart

    def _broker_restart(self, work: Callable[[], Any]) -> None:
        """SIGKILL the broker's JVM and start it again on the same port and directory:
        ``delay`` seconds into the epoch, or while the epoch is held at the trial's point
        (a write in progress, or a decided epoch whose transactions are not committed)."""
        broker = self.env.kafka

        def restart() -> str:
            took = broker.restart(kill=True)
            return f"kafka broker SIGKILLed and restarted ({took:.1f} s)"

        if self.spec.point is None:
            self._after_delay(work, restart)
        else:
            self._point_then(work, restart)

    def _broker_pause(self, work: Callable[[], Any]) -> None:
        """Stop the broker's JVM (SIGSTOP) for ``extra["pause"]`` seconds, then resume it:
        ``delay`` seconds into the epoch, or while the epoch is held at the trial's point."""
        broker = self.env.kafka
        seconds = float(self.spec.extra.get("pause", 5.0))

        def pause() -> str:
            broker.pause(seconds)
            return f"kafka broker paused (SIGSTOP) for {seconds:g} s"

        if self.spec.point is None:
            self._after_delay(work, pause)
        else:
            self._point_then(work, pause)

    def _hanging_txn(self, work: Callable[[], Any]) -> None:
        """Leave a hanging transaction on the sink's progress partition (this sink's epoch
        record of the last committed epoch, as t0021's broker left it), then let the
        coordinator SIGKILL itself at the trial's point of the fault epoch."""
        from tests.support.kafka_hanging import hang_committed_epoch_record

        main = self.specs["main"]
        note, held = hang_committed_epoch_record(main["bootstrap"], main["topic"],
                                                 self.spec.name, "main")
        self.result.notes.append(note)
        if self.stream is not None and held is not None:
            # a stream went on while the record was found: the kill comes two epochs on
            self.fault_epoch = max(self.fault_epoch, held + 2)
        self._self_kill(work)

    def _leader_kill(self, work: Callable[[], Any]) -> None:
        """SIGKILL the leader of the victim partition on the three-broker cluster and
        start it again (``tests.chaos.leader_kill``): ``delay`` seconds into the epoch, or
        while the epoch is held at the trial's point."""
        cluster, main = self.env.kafka, self.specs["main"]

        def kill() -> str:
            return kill_leader(cluster, self.spec, main)

        if self.spec.point is None:
            self._after_delay(work, kill)
        else:
            self._point_then(work, kill)

    # ------------------------------------------------------------------ maintenance

    def _maintenance_point(self, rt: SinkRuntime, work: Callable[[], Any]) -> None:
        """The trial's maintenance point reached in a pass while ``work`` runs
        (``tests.chaos.maintenance``): the coordinator killed there, or the pass failed."""
        point = self.spec.point
        assert point is not None
        watch = FiredWatch(self.spec.name, point)
        try:
            self.forced = maintenance.drive(rt, self.spec, work, self.result.notes)
        finally:
            if self.forced is None:
                self.fault_at = watch.stop()
                self.result.fired = self.fault_at is not None
            else:  # its passes go on over the next epochs
                self.watch = watch

    def _final_pass(self, rt: SinkRuntime) -> None:
        """A maintenance trial's forced pass after the last epoch: what a crashed pass
        left is finished before the table is checked."""
        if self.spec.fault != "maintenance_point":
            return
        if self.forced is not None:
            forced, self.forced = self.forced, None
            forced.stop()
        if self.watch is not None:
            watch, self.watch = self.watch, None
            self.fault_at = watch.stop()
            self.result.fired = self.fault_at is not None
        self.last_epoch = maintenance.final_pass(rt, self.spec, self.result.notes)
        if not self.result.fired and self.spec.point is not None:
            self.result.fired = fired(self.spec.name, self.spec.point)
            if self.result.fired:
                self.result.notes.append(f"{self.spec.point} reached in the final pass")
        self.phase("final maintenance pass")

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
                report = self.way.write(rt, epoch, self.data(epoch))
                self.result.notes.append(f"write under the fault returned "
                                         f"committed={report.committed}")
            except (RaySinkError, ProducerFailed) as exc:
                self._error(exc)
        else:
            arm_fault(self.spec.name, "coordinator.after_pending", action="sleep",
                      seconds=1.5, when={"epoch": epoch})
            thread, box = run_in_thread(lambda: self.way.write(rt, epoch, self.data(epoch)))
            wait_fired(self.spec.name, "coordinator.after_pending", 60.0, box)
            self._apply_fs()
            thread.join(timeout=120)
            if isinstance(box.get("error"), RaySinkError | ProducerFailed):
                self._error(box["error"])
            elif "error" in box:
                raise box["error"]
            elif "result" in box:
                self.result.notes.append(f"write under the fault returned "
                                         f"committed={box['result'].committed}")
        self._observe_under_fault(rt, epoch)
        self._remove_fs()
        self.write(rt, epoch)

    def _filesystem_stream(self, rt: SinkRuntime, work: Callable[[], Any]) -> None:
        """The fault for ``_FS_HOLD`` seconds while the producers write: from the
        moment the stream started (``before_epoch``) or from the fault epoch's PENDING
        record (``after_pending``); the stream must go on once it is removed."""
        self.result.fired = True
        point = "coordinator.after_pending"
        if self.spec.variant == "after_pending":
            arm_fault(self.spec.name, point, action="sleep", seconds=1.5,
                      when={"epoch": self.fault_epoch})
        thread, box = run_in_thread(work)
        if self.spec.variant != "after_pending" or wait_fired(self.spec.name, point, 60.0,
                                                              box):
            self._apply_fs()
            time.sleep(_FS_HOLD)
            self._observe_under_fault(rt, None)
            self._remove_fs()
        self._join(thread, box)

    def _observe_under_fault(self, rt: SinkRuntime, epoch: int | None) -> None:
        """Nothing half-committed: an undecided epoch shows no row; a decided one shows all
        or none of them in an atomic sink (Parquet may show a part until it rolls forward).
        A stream's epochs are not known row by row: each row shows at most once."""
        status = rt.status()
        for name, spec in self.specs.items():
            rows = read_target(spec, self.env.pg)
            state = status.sinks[name].state
            if epoch is None:
                ids = rows.column("id").to_pylist()
                self.result.notes.append(f"under the fault: sink {name} {state}, "
                                         f"{len(ids)} rows visible")
                if len(set(ids)) != len(ids):
                    raise AssertionError(f"sink {name} shows a row twice under the fault")
                continue
            decided = epoch in status.pending_epochs or (
                status.last_committed_epoch is not None
                and status.last_committed_epoch >= epoch)
            seen = sum(1 for e in rows.column("epoch").to_pylist() if e == epoch)
            total = self.spec.rows[epoch - 1]
            self.result.notes.append(f"under the fault: sink {name} {state}, epoch {epoch} "
                                     f"decided={decided}, {seen}/{total} rows visible")
            atomic = spec["kind"] != "parquet"
            if (not decided and seen) or (decided and atomic and seen not in (0, total)):
                raise AssertionError(f"epoch {epoch} half-committed in sink {name} under the "
                                     f"fault: {seen} of {total} rows visible")

    # ------------------------------------------------------------------ driver kill

    def _driver_kill(self) -> None:
        self.feed += 1
        config = {"name": self.spec.name, "sinks": self.specs, "metastore": self._metastore(),
                  "address": self.env.ray_address, "epochs": self.spec.epochs,
                  "rows": self.spec.rows, "pieces": self.spec.pieces, "feed": self.feed,
                  "flush_interval": self.spec.flush_interval, "via": self.spec.via,
                  "extra": self.spec.extra, "dir": str(self.dir), "options": self.options()}
        kill_driver(self, config)
        rt = reopen(self.runtime)
        if self.spec.via == "stream":
            self._streamed(rt)
            return
        try:
            for epoch in range(self.spec.fault_epoch, self.spec.epochs + 1):
                self.write(rt, epoch)
            self._wait_all_committed(rt)
        finally:
            rt.close()

    # ------------------------------------------------------------------ checking

    def _check(self) -> None:
        if self.spec.via == "stream":
            expected, must_commit = expected_rows(self.spec.extra["stream"]), set()
        else:
            expected = {e: self.spec.rows[e - 1] for e in range(1, self.spec.epochs + 1)}
            must_commit = set(expected)
        maintained = self.spec.fault == "maintenance_point"
        for name, spec in self.specs.items():
            rows = read_target(spec, self.env.pg)
            order = commit_order(spec, self.spec.name, name, self.env.pg)
            # a maintained table keeps the commits of its retained versions only: the
            # marker stands for the others (``maintenance.table_problems``)
            outcome = check(name, rows, expected, order,
                            must_commit=set() if maintained and name == "main" else must_commit)
            outcome.problems += order_problems(spec, epochs=self.spec.via != "stream")
            if maintained and name == "main":
                # a stream's groups are its producers: its epochs with rows, the commits
                low = max([*order, *(e for e, n in expected.items() if n and must_commit)],
                          default=0)
                outcome.problems += self._maintained_problems(spec, low)
            self.result.checks.append(outcome)

    def _maintained_problems(self, spec: dict[str, Any], low: int) -> list[str]:
        problems = [] if self.result.fired else [f"{self.spec.point} never fired"]
        assert self.last_epoch is not None, "no final maintenance pass"
        return problems + maintenance.table_problems(spec, self.spec.name,
                                                     (low, self.last_epoch))
