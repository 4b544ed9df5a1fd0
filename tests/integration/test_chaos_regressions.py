"""Bugs the chaos suite found, each replayed at the exact point it was found.

Fixed cases, not drawn by a seed, so they are integration tests (real Ray, PostgreSQL and
targets, the chaos suite's fault helpers): the chaos layer's time is its seeded sample's.

1. ``fs_readonly`` trial (seed 1, trial 2): under a read-only Parquet directory the driver's
   ``EpochFailedError`` quoted only Ray's wrapper (``RayTaskError(OSError): ray::
   SinkWriterActor.barrier() (pid=…)``), not the error itself. Fixed in
   ``raysink.driver.calls.short``: the remote cause is named.
2. ``point_external`` trial (seed 1, trial 5): an empty first epoch into a Delta (or
   Iceberg) sink committed without creating the table, so it left no marker; the
   coordinator still counted it as the sink's committed epoch, and the next epoch's commit
   failed forever with ``DataLossError`` ("the progress marker … is gone … while epoch 2 is
   pending"). Fixed twice over: the writer actor hands a sink writer the schema of an
   empty table, so the commit creates the target from it (with its marker); and an epoch
   that carried no schema at all (``write_arrow([])``), which cannot create a target,
   makes ``Sink.commit`` answer ``False`` and the meta store record it unmarked, so no
   marker is expected of it.
3. ``pg_restart`` trials (seed 1, trials 8 and 18): after a PostgreSQL crash-restart
   between epochs, a ``PostgresWriter`` kept its broken connection (``open()`` only ran
   when the actor started), so every later attempt failed and the epoch ended in
   ``EpochFailedError``. Fixed in ``PostgresWriter._live_conn``: a writer with no rows in
   flight reconnects.
5. ``writer_point`` trial (seed 1, trial 60, via Spark): the same family as 2 in
   PostgreSQL: an empty first epoch recorded progress rows but created no table (no
   schema); a writer that restarted (killed at ``writer.after_pre_commit`` of epoch 2, whose
   ``CREATE TABLE`` was still inside a prepared transaction) found progress rows and no
   table and refused with ``DataLossError`` ("target table … was deleted"), so the
   writer never came back. Fixed with 2: the empty epoch's commit creates the table from
   the schema its writers saw (the manifest carries the column types), and an epoch
   without any schema writes no progress row.
4. ``pg_restart`` trial (seed 1, trial 8, PostgreSQL meta store): a sink commit failed
   while the server restarted, and recording the STALLED state in the meta store failed
   too; that error left the coordinator's commit loop, which stopped for good (the epoch
   stayed PENDING until the driver restarted). Fixed in
   ``CoordinatorActor._record_health``: the loop logs the meta store error and retries.
6. ``pg_restart`` trials (seed 1, trials 99, 105, 167): PostgreSQL went down while the
   writer actors were being created; a writer whose ``open()`` failed died in its
   constructor, and Ray kept its name, so re-creating it raised
   ``ActorAlreadyExistsError``. Fixed in ``SinkWriterActor``: an unreachable target at
   start is logged and connected again before the next write or pre-commit (and
   ``ActorSet.heal`` takes the actor holding a name that is still taken).
7. ``pg_restart`` trial (seed 1, trial 153, PostgreSQL meta store): the meta store went
   down as the last writer's request made the epoch PENDING; recording the abort failed
   too, and that error skipped releasing the writers already waiting on the attempt.
   They held their barrier group, so the next attempt's barriers never ran and the
   driver waited forever. Fixed in ``CoordinatorActor._abort_attempt`` (waiters are
   released whatever the abort does) and ``open_epoch`` (a new attempt fails writers
   still waiting on an older one).
8. ``fs_full`` trial (seed 33, trial 31, a stream into Parquet on a full disk): rows
   lost, the first batches of each producer. A writer's periodic flush failed (ENOSPC)
   after the Parquet writer had taken the rows out of its buffer; the writer actor logged
   the failure and went on, and once the disk had room the attempt pre-committed and
   committed without those rows. Fixed in ``SinkWriterActor``: a periodic flush that
   failed spoils the attempt in progress, whose pre-commit then rolls it back and fails.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from raysink import EpochFailedError, SinkRuntime
from raysink.driver.lease import LeaseKeeper
from raysink.driver.starting import check_metastore
from raysink.sinks import ParquetSink, PostgresSink
from raysink.testing import arm_fault
from tests.chaos.faults import Tmpfs, run_in_thread, wait_fired
from tests.chaos.targets import build_sinks, epoch_table, read_target
from tests.support.postgres import PostgresServer

pytestmark = pytest.mark.usefixtures("ray_session")


@pytest.mark.skipif(not Tmpfs.allowed(), reason="mounting a tmpfs needs root")
def test_read_only_directory_error_names_the_cause(tmp_path: Path) -> None:
    fs = Tmpfs(tmp_path / "mnt")
    with fs.mounted_at():
        sink = ParquetSink(str(fs.path / "main"))
        with SinkRuntime("reg-readonly", sink, metastore=f"sqlite:///{tmp_path / 'm.db'}",
                         max_attempts=2, flush_interval=0.2) as rt:
            assert rt.write_arrow(epoch_table(1, 100, 1), epoch=1).committed
            fs.readonly()
            with pytest.raises(EpochFailedError) as info:
                rt.write_arrow(epoch_table(2, 100, 2), epoch=2)
            message = str(info.value)
            assert "Read-only file system" in message, message
            assert "RayTaskError" not in message and "pid=" not in message, message
            fs.writable()
            assert rt.write_arrow(epoch_table(2, 100, 3), epoch=2).committed
        rows = read_target({"kind": "parquet", "path": str(fs.path / "main")})
        assert sorted(rows.column("id").to_pylist()) == sorted(
            [1_000_000 + i for i in range(100)] + [2_000_000 + i for i in range(100)])


@pytest.mark.parametrize("schema_known", [True, False], ids=["empty-table", "no-table"])
def test_empty_first_epoch_then_data(pg_server: PostgresServer, tmp_path: Path,
                                     schema_known: bool) -> None:
    """An empty first epoch (with its schema, or with none at all), then data, then a fresh
    runtime on the same meta store, into a Delta, an Iceberg and a PostgreSQL sink of one
    runtime (one runtime for the three: each sink meets the empty epoch on its own):
    every epoch commits and each target holds epochs 2 and 3."""
    name = f"reg-empty-first-{'schema' if schema_known else 'none'}"
    specs: dict[str, dict[str, Any]] = {
        "delta": {"kind": "delta", "path": str(tmp_path / "delta")},
        "iceberg": {"kind": "iceberg", "identifier": "reg.t",
                    "catalog": {"uri": f"sqlite:///{tmp_path / 'cat.db'}",
                                "warehouse": f"file://{tmp_path / 'wh'}"}},
        "postgres": {"kind": "postgres", "dsn": pg_server.dsn(),
                     "table": name.replace("-", "_")},
    }
    meta = f"sqlite:///{tmp_path / 'm.db'}"
    empty = epoch_table(1, 0, 1) if schema_known else []
    with SinkRuntime(name, build_sinks(specs), commit_timeout=10, metastore=meta,
                     retry_cap=0.2) as rt:
        assert rt.write_arrow(empty, epoch=1).committed
        report = rt.write_arrow(epoch_table(2, 50, 2), epoch=2)
        assert report.committed, {k: s.last_error for k, s in rt.status().sinks.items()}
    with SinkRuntime(name, build_sinks(specs), commit_timeout=10, metastore=meta,
                     retry_cap=0.2) as rt:
        assert rt.write_arrow(epoch_table(3, 10, 3), epoch=3).committed
    for kind, spec in specs.items():
        ids = sorted(read_target(spec, pg_server).column("id").to_pylist())
        assert ids == [2_000_000 + i for i in range(50)] + [3_000_000 + i for i in range(10)], kind


@pytest.mark.parametrize("method", ["prepared", "staging"])
def test_postgres_restart_between_epochs(pg_server: PostgresServer, tmp_path: Path,
                                         method: str) -> None:
    table = f"reg_pg_restart_{method}"
    spec = {"kind": "postgres", "table": table}
    with SinkRuntime(f"reg-pg-restart-{method}", PostgresSink(pg_server.dsn(), table,
                                                             method=method),
                     metastore=f"sqlite:///{tmp_path / 'm.db'}", retry_cap=0.2) as rt:
        assert rt.write_arrow([epoch_table(1, 60, 1).slice(0, 30),
                               epoch_table(1, 60, 1).slice(30)], epoch=1).committed
        pg_server.restart("immediate")  # every writer's connection is now broken
        report = rt.write_arrow([epoch_table(2, 60, 2).slice(0, 30),
                                 epoch_table(2, 60, 2).slice(30)], epoch=2)
        assert report.committed
    ids = sorted(read_target(spec, pg_server).column("id").to_pylist())
    assert ids == [1_000_000 + i for i in range(60)] + [2_000_000 + i for i in range(60)]


def test_metastore_down_while_a_commit_retries(pg_server: PostgresServer,
                                               tmp_path: Path) -> None:
    name, out = "reg-meta-down", tmp_path / "out"
    spec = {"kind": "parquet", "path": str(out)}
    # one writer: the meta store is the coordinator's
    with SinkRuntime(name, ParquetSink(str(out)), writers=1, metastore=pg_server.dsn(),
                     retry_cap=0.3, commit_timeout=60) as rt:
        assert rt.write_arrow(epoch_table(1, 40, 1), epoch=1).committed
        arm_fault(name, "coordinator.after_pending", action="sleep", seconds=1.0,
                  when={"epoch": 2})
        thread, box = run_in_thread(lambda: rt.write_arrow(epoch_table(2, 40, 2), epoch=2))
        assert wait_fired(name, "coordinator.after_pending", 60.0, box)
        pg_server.stop("immediate")  # the commit and the STALLED record both fail
        try:
            thread.join(timeout=3)
        finally:
            pg_server.start()
        thread.join(timeout=90)
        assert box["result"].committed, rt.status()
        assert rt.write_arrow(epoch_table(3, 40, 3), epoch=3).committed
    ids = sorted(read_target(spec).column("id").to_pylist())
    assert ids == [e * 1_000_000 + i for e in (1, 2, 3) for i in range(40)]


def test_postgres_empty_first_epoch_then_writer_restart(pg_server: PostgresServer,
                                                        tmp_path: Path) -> None:
    name, table = "reg-pg-empty-first", "reg_pg_empty_first"
    with SinkRuntime(name, PostgresSink(pg_server.dsn(), table), commit_timeout=10,
                     metastore=f"sqlite:///{tmp_path / 'm.db'}", retry_cap=0.2,
                     max_attempts=2) as rt:
        assert rt.write_arrow(epoch_table(1, 0, 1), epoch=1).committed
        arm_fault(name, "writer.after_pre_commit", action="kill",
                  when={"epoch": 2, "writer": 0, "sink": "main"})
        data = epoch_table(2, 40, 2)
        assert rt.write_arrow([data.slice(0, 20), data.slice(20)], epoch=2).committed
        assert rt.write_arrow(epoch_table(3, 40, 3), epoch=3).committed
    ids = read_target({"kind": "postgres", "table": table}, pg_server).column("id")
    assert sorted(ids.to_pylist()) == [e * 1_000_000 + i for e in (2, 3) for i in range(40)]


def test_unreachable_target_while_writers_start(pg_server: PostgresServer,
                                                tmp_path: Path) -> None:
    name, table = "reg-pg-down-at-start", "reg_pg_down_at_start"
    sink = PostgresSink(pg_server.dsn(), table)
    rt = SinkRuntime(name, sink, metastore=f"sqlite:///{tmp_path / 'm.db'}", retry_cap=0.2)
    sink.validate()
    pg_server.stop("immediate")
    try:
        store = check_metastore(name, rt.metastore_url, rt.sinks, rt.options)
        lease = LeaseKeeper(store, name, rt.options.lease_timeout)
        lease.acquire()  # as start() does: the coordinator claims only for the holder
        actors = rt.options.actor_set(name, rt.sinks, rt.metastore_url, lease.holder)
        actors.start()  # every writer's constructor meets the server down
        rt._actors, rt._lease = actors, lease
        try:
            assert actors.heal(timeout=10) == [], "a writer died in its constructor"
        finally:
            pg_server.start()
        assert rt.write_arrow(epoch_table(1, 40, 1), epoch=1).committed
    finally:
        rt.close()
    ids = read_target({"kind": "postgres", "table": table}, pg_server).column("id")
    assert sorted(ids.to_pylist()) == [1_000_000 + i for i in range(40)]


def test_metastore_down_as_an_epoch_becomes_pending(pg_server: PostgresServer,
                                                    tmp_path: Path) -> None:
    name, out = "reg-meta-down-pending", tmp_path / "out"
    with SinkRuntime(name, ParquetSink(str(out)), metastore=pg_server.dsn(), writers=2,
                     retry_cap=0.3, commit_timeout=30, max_attempts=2) as rt:
        assert rt.write_arrow(epoch_table(1, 40, 1), epoch=1).committed
        # writer 0 of epoch 2 waits on its request; writer 1 is held before sending it
        arm_fault(name, "writer.after_pre_commit", action="sleep", seconds=2.0,
                  when={"epoch": 2, "writer": 1, "sink": "main"})
        data = epoch_table(2, 40, 2)
        thread, box = run_in_thread(
            lambda: rt.write_arrow([data.slice(0, 20), data.slice(20)], epoch=2))
        assert wait_fired(name, "writer.after_pre_commit", 60.0, box)
        pg_server.stop("immediate")  # PENDING fails, and so does recording the abort
        try:
            thread.join(timeout=60)
        finally:
            pg_server.start()
        assert not thread.is_alive(), "the attempt never ended"
        again, box = run_in_thread(lambda: rt.write_arrow(data, epoch=2))
        again.join(timeout=120)
        assert not again.is_alive(), "writers stayed on the aborted attempt"
        assert box["result"].committed
    ids = sorted(read_target({"kind": "parquet", "path": str(out)}).column("id").to_pylist())
    assert ids == [e * 1_000_000 + i for e in (1, 2) for i in range(40)]


@pytest.mark.skipif(not Tmpfs.allowed(), reason="mounting a tmpfs needs root")
def test_a_periodic_flush_that_failed_loses_no_row(tmp_path: Path) -> None:
    """The epoch's rows reach the writer while the disk is full, its periodic flushes
    fail, the disk gets room again before the commit: the attempt fails (nothing of it
    visible), and fed again the epoch holds every row once."""
    fs = Tmpfs(tmp_path / "mnt")
    with fs.mounted_at():
        sink = ParquetSink(str(fs.path / "main"))
        with SinkRuntime("reg-flush-full", sink, metastore=f"sqlite:///{tmp_path / 'm.db'}",
                         flush_interval=0.1, feed_timeout=10) as rt:
            assert rt.write_arrow(epoch_table(1, 100, 1), epoch=1).committed
            fs.fill()
            try:
                handle = rt.open_epoch(2)
                with handle.feed() as feed:
                    feed.write(epoch_table(2, 100, 2))
                time.sleep(1.0)  # several periodic flushes fail meanwhile
            finally:
                fs.unfill()
            try:
                report = handle.commit()
            except EpochFailedError:  # the spoiled attempt: fed again
                handle = rt.open_epoch(2)
                with handle.feed() as feed:
                    feed.write(epoch_table(2, 100, 2))
                report = handle.commit()
            assert report.committed
        ids = sorted(read_target({"kind": "parquet", "path": str(fs.path / "main")})
                     .column("id").to_pylist())
    assert ids == [e * 1_000_000 + i for e in (1, 2) for i in range(100)]
