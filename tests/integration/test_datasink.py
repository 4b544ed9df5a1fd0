"""``ds.write_datasink(rt.datasink(epoch=N))``: a Ray Dataset as one epoch, exactly once,
into every kind of sink; a retried write task shows nothing twice; a failed write
leaves nothing; a re-run is skipped.

The Parquet cases share one runtime (``shared``): each writes the epoch after the last one
the runtime committed and checks the table holds what it held before plus exactly that
epoch. The test sink's case and a killed writer start runtimes of their own."""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
import ray
from ray.data.block import BlockAccessor

from raysink import SinkRuntime
from raysink.driver.datasink import EpochDatasink
from raysink.errors import EpochFailedError
from tests.integration.helpers import end_for_good, epoch_table, unique_name
from tests.integration.real_targets import (
    ParquetTarget,
    Target,
    assert_ids_exact,
    make_target,
)

pytestmark = pytest.mark.usefixtures("ray_session")

ROWS = 8_000
BLOCKS = 8


def _dataset(epoch: int) -> ray.data.Dataset:
    table = epoch_table(epoch, ROWS)
    step = ROWS // BLOCKS
    return ray.data.from_arrow([table.slice(i, step) for i in range(0, ROWS, step)])


def _ids(target: Target) -> list[int]:
    table = target.table()
    return [] if table is None else [int(v) for v in table.column("id").to_pylist()]


@pytest.fixture(scope="module")
def shared(ray_session: None, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[tuple[SinkRuntime, Target]]:
    """A started runtime (two writers) into a Parquet table, for the Parquet cases."""
    root = tmp_path_factory.mktemp("datasink")
    target = ParquetTarget(root / "table")
    with SinkRuntime(unique_name("datasink-shared"), target.sink(), writers=2,
                     metastore=f"sqlite:///{root / 'meta.db'}", progress=False) as rt:
        yield rt, target


def _next(rt: SinkRuntime) -> int:
    return (rt.status().last_committed_epoch or 0) + 1


# Ray Data's path into the runtime is the same for every sink: the default run takes it into
# Parquet and the test sink; Delta, Iceberg and PostgreSQL behind the same writers are
# test_sinks_runtime.py's (``slow`` here).
@pytest.fixture(params=["parquet", "list", *(pytest.param(kind, marks=pytest.mark.slow)
                                             for kind in ("delta", "iceberg", "postgres"))])
def runtime(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
            name: str) -> Iterator[tuple[SinkRuntime, Target]]:
    """A started runtime (two writers) into a target of each kind: Parquet's is shared."""
    if request.param == "parquet":
        yield request.getfixturevalue("shared")
        return
    target = make_target(str(request.param), tmp_path, request, monkeypatch)
    with SinkRuntime(name, target.sink(), writers=2, metastore=f"sqlite:///{tmp_path / 'meta.db'}",
                     progress=False) as rt:
        yield rt, target


def test_a_dataset_is_one_epoch_and_a_rerun_is_skipped(
        runtime: tuple[SinkRuntime, Target]) -> None:
    rt, target = runtime
    epoch, before = _next(rt), _ids(target)
    epochs_before = target.commit_epochs(rt.name)
    sink = rt.datasink(epoch=epoch)
    _dataset(epoch).write_datasink(sink)
    assert sink.report is not None
    assert (sink.report.epoch, sink.report.rows, sink.report.committed) == (epoch, ROWS, True)
    rerun = rt.datasink(epoch=epoch)  # the same job again
    _dataset(epoch).write_datasink(rerun)
    assert rerun.report is not None and rerun.report.skipped
    assert rt.status().last_committed_epoch == epoch
    assert_ids_exact(_ids(target), [epoch], ROWS, before=before)
    assert target.commit_epochs(rt.name) == [*epochs_before, epoch]


def _claim(flag: str) -> bool:
    """Remove ``flag``; True for the one caller that removed it."""
    try:
        os.remove(flag)
    except FileNotFoundError:
        return False
    return True


class _DiesOnce(EpochDatasink):
    """A write task's worker dies after sending half its first block (once)."""

    flag = ""

    def write(self, blocks: Iterable[Any], ctx: Any) -> int:
        def dying() -> Iterator[pa.Table]:
            for block in blocks:
                table = BlockAccessor.for_block(block).to_arrow()
                half = table.num_rows // 2
                yield table.slice(0, half)
                if _claim(self.flag):  # one task of those running at once dies
                    time.sleep(1.0)  # the first half's messages reach the writers
                    os._exit(1)
                yield table.slice(half)

        return super().write(dying(), ctx)


def test_a_retried_write_task_shows_nothing_twice(
        tmp_path: Path, shared: tuple[SinkRuntime, Target]) -> None:
    rt, target = shared
    epoch, before = _next(rt), _ids(target)
    flag = tmp_path / "die-once"
    flag.touch()
    sink = rt.datasink()
    dying = _DiesOnce.__new__(_DiesOnce)
    dying.__dict__.update(sink.__dict__)
    dying.flag = str(flag)
    _dataset(epoch).write_datasink(dying)
    assert dying.report is not None and dying.report.rows == ROWS
    assert dying.report.epoch == epoch
    assert not flag.exists()  # a write task did die mid-feed
    assert_ids_exact(_ids(target), [epoch], ROWS, before=before)


def test_a_failed_write_aborts_the_epoch(shared: tuple[SinkRuntime, Target]) -> None:
    rt, target = shared
    epoch, before = _next(rt), _ids(target)

    def fail_on_one_block(batch: pa.Table) -> pa.Table:
        if epoch * 1_000_000 + 3 * ROWS // BLOCKS in batch.column("id").to_pylist():
            raise ValueError("a bad record upstream")
        return batch

    failing = _dataset(epoch).map_batches(fail_on_one_block, batch_format="pyarrow")
    with pytest.raises(EpochFailedError, match="ValueError: a bad record upstream") as failed:
        failing.write_datasink(rt.datasink(epoch=epoch))  # not Ray's UserCodeException
    assert "run ds.write_datasink(rt.datasink(epoch=" in str(failed.value)
    assert isinstance(failed.value.__cause__, ray.exceptions.RayError)
    assert sorted(_ids(target)) == sorted(before)  # nothing of the failed write is visible
    sink = rt.datasink(epoch=epoch)
    _dataset(epoch).write_datasink(sink)
    assert sink.report is not None and sink.report.committed
    assert_ids_exact(_ids(target), [epoch], ROWS, before=before)


def test_a_writer_lost_during_the_write_says_to_run_it_again(tmp_path: Path,
                                                             name: str) -> None:
    """Writer 0 is SIGKILLed while a write task feeds it: the write fails with a
    ``RaySinkError`` that says to run the write again (Ray's raw
    ``RayTaskError(ActorUnavailableError)`` used to reach the user), nothing of the epoch
    is visible, and the write run again at once commits it exactly once: Ray's restart
    of writer 0 is held 6 s in its constructor, and the datasink of the second write waits
    for it (its write tasks failed on the restarting writer before: CI at fbf9f22)."""
    from raysink.errors import RaySinkError
    from raysink.testing import arm_fault

    target = ParquetTarget(tmp_path / "table")
    meta = f"sqlite:///{tmp_path / 'meta.db'}"
    with SinkRuntime(name, target.sink(), writers=2, metastore=meta, progress=False) as rt:
        arm_fault(name, "writer.start", action="sleep", seconds=6.0,
                  when={"writer": 0, "sink": "main"})
        arm_fault(name, "writer.during_write", action="kill", when={"writer": 0})
        with pytest.raises(RaySinkError, match=r"Run the write again") as failed:
            _dataset(1).write_datasink(rt.datasink(epoch=1))
        assert "ActorUnavailableError" not in type(failed.value).__name__
        assert target.ids() == []
        sink = rt.datasink(epoch=1)
        _dataset(1).write_datasink(sink)
        assert sink.report is not None and sink.report.committed
    assert_ids_exact(_ids(target), [1], ROWS)


def test_a_writer_ended_for_good_is_replaced_by_the_next_write(tmp_path: Path,
                                                               name: str) -> None:
    """Writer 1 ended for good between two writes (``ray.kill``: Ray starts no other, as
    when an actor's restarts ran out). The next ``rt.datasink()`` replaces it before its
    write tasks feed, and the write commits exactly once. Before, nothing replaced it on
    this path: every write task that fed it failed, and every write run again after it
    (chaos seed 1126, trial 499: six calls in a row failed with ``EpochFailedError``)."""
    target = ParquetTarget(tmp_path / "table")
    meta = f"sqlite:///{tmp_path / 'meta.db'}"
    with SinkRuntime(name, target.sink(), writers=2, metastore=meta, progress=False) as rt:
        _dataset(1).write_datasink(rt.datasink(epoch=1))
        end_for_good(rt, writer=1)
        sink = rt.datasink(epoch=2)
        _dataset(2).write_datasink(sink)
        assert sink.report is not None and sink.report.committed
        assert sum(p.role == "writer" and p.answered for p in rt.processes()) == 2
    assert_ids_exact(_ids(target), [1, 2], ROWS)
