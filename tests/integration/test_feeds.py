"""Parallel feeds (``rt.open_epoch()``): many producers, Ray tasks and actors, one epoch.

Every test checks the exact contents of the target against the input: the producers'
rows exactly once, or, for a failed epoch, nothing of it.

The cases that leave the runtime as they found it (no writer killed, no option of their
own) share one runtime (``shared``): each numbers its epochs after the last one the
runtime committed before it, and checks that the table holds what it held before plus
exactly its own rows.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
import ray

from raysink import EpochFailedError, Feed, SinkRuntime
from raysink.errors import ConfigError, SchemaMismatchError
from raysink.sinks import ParquetSink
from tests.integration.helpers import (
    assert_exactly,
    end_for_good,
    epoch_table,
    read_ids,
    unique_name,
    wait_fired,
    writer_owners,
)

pytestmark = pytest.mark.usefixtures("ray_session")

ROWS = 6_000
PARTS = 4


def _part(epoch: int, part: int, parts: int = PARTS, rows: int = ROWS) -> pa.Table:
    return epoch_table(epoch, rows).slice(part * rows // parts, rows // parts)


@ray.remote(max_retries=0)
def produce(feed: Feed, epoch: int, part: int, batches: int = 3) -> int:
    """A producer task: its part of the epoch in ``batches`` batches, then its barrier."""
    table = _part(epoch, part)
    step = -(-table.num_rows // batches)
    with feed:
        for start in range(0, table.num_rows, step):
            feed.write(table.slice(start, step))
    return table.num_rows


@ray.remote(max_retries=2)
def produce_dying_once(feed: Feed, epoch: int, part: int, flag: str) -> int:
    """Writes half its part, then its worker dies on the first try (Ray retries it)."""
    table = _part(epoch, part)
    half = table.num_rows // 2
    feed.write(table.slice(0, half))
    if os.path.exists(flag):
        os.remove(flag)
        os._exit(1)
    feed.write(table.slice(half))
    return feed.close()


@ray.remote(max_restarts=0)
class Producer:
    """A long-lived producer actor."""

    def __init__(self, feed: Feed) -> None:
        self.feed = feed

    def write(self, table: pa.Table) -> int:
        return self.feed.write(table)

    def close(self) -> int:
        return self.feed.close()


def _runtime(tmp_path: Path, name: str, **options: Any) -> SinkRuntime:
    options.setdefault("writers", 2)
    return SinkRuntime(name, ParquetSink(str(tmp_path / "table")), progress=False,
                       metastore=f"sqlite:///{tmp_path / 'meta.db'}", **options)


@pytest.fixture(scope="module")
def shared(ray_session: None, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[tuple[SinkRuntime, Path]]:
    """A started runtime (two writers) the module's cases share, with its table's path."""
    root = tmp_path_factory.mktemp("feeds")
    with _runtime(root, unique_name("feeds-shared")) as rt:
        yield rt, root / "table"


def _next(rt: SinkRuntime) -> int:
    """The epoch after the last one the runtime committed: a case's first epoch."""
    return (rt.status().last_committed_epoch or 0) + 1


def test_tasks_and_an_actor_feed_one_epoch_exactly(shared: tuple[SinkRuntime, Path]) -> None:
    rt, path = shared
    first, before = _next(rt), read_ids(path)
    for epoch in (first, first + 1):
        ep = rt.open_epoch()
        assert ep.epoch == epoch
        actor = Producer.remote(ep.feed())  # type: ignore[attr-defined]
        tasks = [produce.remote(ep.feed(), epoch, part) for part in range(PARTS - 1)]
        last = _part(epoch, PARTS - 1)
        ray.get([actor.write.remote(last.slice(0, 700)),
                 actor.write.remote(last.slice(700))])
        assert ray.get(actor.close.remote()) == last.num_rows
        assert sum(ray.get(tasks)) == ROWS - last.num_rows
        report = ep.commit()
        assert (report.epoch, report.rows, report.committed) == (epoch, ROWS, True)
    status = rt.status()
    assert status.last_committed_epoch == first + 1
    assert_exactly(path, [first, first + 1], ROWS, before=before)


def test_keyed_feeds_put_each_key_on_its_writer(tmp_path: Path) -> None:
    with _runtime(tmp_path, "feeds-keyed", writers=3, key=["customer"]) as rt:
        ep = rt.open_epoch()
        ray.get([produce.remote(ep.feed(), 1, part) for part in range(PARTS)])
        assert ep.commit().rows == ROWS
        assert rt.write_arrow(epoch_table(2, ROWS)).committed  # the driver's own path
    owners = writer_owners(tmp_path / "table")
    assert owners and all(len(w) == 1 for w in owners.values()), owners
    assert_exactly(tmp_path / "table", [1, 2], ROWS)


def test_a_task_retried_by_ray_writes_nothing_twice(tmp_path: Path,
                                                    shared: tuple[SinkRuntime, Path]) -> None:
    rt, path = shared
    epoch, before = _next(rt), read_ids(path)
    flag = tmp_path / "die-once"
    flag.touch()
    ep = rt.open_epoch()
    tasks = [produce_dying_once.remote(ep.feed(), epoch, part, str(flag))
             for part in range(PARTS)]
    ray.get(tasks)
    report = ep.commit()
    assert not flag.exists()  # one worker did die mid-feed
    assert report.committed and report.rows == ROWS and report.epoch == epoch
    assert_exactly(path, [epoch], ROWS, before=before)


def test_a_killed_producer_fails_the_attempt_and_a_new_feed_is_exact(tmp_path: Path) -> None:
    with _runtime(tmp_path, "feeds-killed", feed_timeout=3.0) as rt:
        ep = rt.open_epoch()
        tasks = [produce.remote(ep.feed(), 1, part) for part in range(PARTS - 1)]
        actor = Producer.remote(ep.feed())  # type: ignore[attr-defined]
        ray.get(actor.write.remote(_part(1, PARTS - 1).slice(0, 500)))
        ray.kill(actor)  # dies mid-epoch: its barrier never comes
        ray.get(tasks)
        with pytest.raises(EpochFailedError, match=r"feed 4.*no heartbeat.*open epoch 1 again"):
            ep.commit(timeout=60)
        assert read_ids(tmp_path / "table") == []  # nothing of the attempt is visible
        again = rt.open_epoch(1)
        assert again.attempt > ep.attempt
        ray.get([produce.remote(again.feed(), 1, part) for part in range(PARTS)])
        assert again.commit().committed
    assert_exactly(tmp_path / "table", [1], ROWS)


@pytest.mark.timeout(300)
def test_a_writer_restarted_between_the_feeds_close_and_the_seal(tmp_path: Path,
                                                                  name: str) -> None:
    """Every feed closed (the writers took their data and barriers), then writer 0 is
    SIGKILLed and Ray restarts it before the commit's seal. The new process never got the
    feeds' data: the seal fails the attempt at once, saying why (it used to wait out the
    600 s barrier timeout, the new process answering every ping), nothing of it is
    visible, and the epoch fed again commits exactly."""
    from tests.integration.helpers import sigkill

    with _runtime(tmp_path, name) as rt:
        ep = rt.open_epoch()
        ray.get([produce.remote(ep.feed(), 1, part) for part in range(PARTS)])
        writer = rt._require_started().writers["main"][0]
        old = ray.get(writer.ping.remote())
        sigkill(old)
        while True:  # Ray restarts it under the same handle
            try:
                if ray.get(writer.ping.remote(), timeout=10) != old:
                    break
            except ray.exceptions.RayError:
                pass
        with pytest.raises(EpochFailedError, match=r"writer 0 was restarted after feeds"):
            ep.commit()
        assert read_ids(tmp_path / "table") == []
        again = rt.open_epoch(1)
        ray.get([produce.remote(again.feed(), 1, part) for part in range(PARTS)])
        assert again.commit().committed
    assert_exactly(tmp_path / "table", [1], ROWS)


def test_a_commit_over_a_subset_of_the_feeds_that_wrote(
        shared: tuple[SinkRuntime, Path]) -> None:
    """Four feeds wrote; ``commit(feeds=[1, 2])`` leaves two out. Their rows were applied
    with the others' and cannot be taken back out of the attempt (the whole epoch used
    to be committed, the left-out feeds' rows with it): refused, nothing visible, and
    the epoch fed again by the named feeds only commits exactly their rows."""
    rt, path = shared
    epoch, before = _next(rt), read_ids(path)
    ep = rt.open_epoch()
    ray.get([produce.remote(ep.feed(), epoch, part) for part in range(PARTS)])
    with pytest.raises(EpochFailedError, match=r"commit leaves them out"):
        ep.commit(feeds=[1, 2])
    assert sorted(read_ids(path)) == sorted(before)
    again = rt.open_epoch(epoch)
    ray.get([produce.remote(again.feed(), epoch, part) for part in range(2)])
    assert again.commit(feeds=[1, 2]).committed
    expected = _part(epoch, 0)["id"].to_pylist() + _part(epoch, 1)["id"].to_pylist()
    assert Counter(read_ids(path)) == Counter(before) + Counter(expected)


def test_a_producer_that_raises_fails_the_commit_at_once(
        shared: tuple[SinkRuntime, Path]) -> None:
    @ray.remote(max_retries=0)
    def broken(feed: Feed, epoch: int) -> None:
        with feed:
            feed.write(_part(epoch, 0))
            raise RuntimeError("the source went away")

    rt, path = shared
    epoch, before = _next(rt), read_ids(path)
    ep = rt.open_epoch()
    ok = produce.remote(ep.feed(), epoch, 1)
    with pytest.raises(ray.exceptions.RayTaskError):
        ray.get(broken.remote(ep.feed(), epoch))
    ray.get(ok)
    with pytest.raises(EpochFailedError, match="the source went away"):
        ep.commit(timeout=60)
    assert rt.write_arrow(epoch_table(epoch, ROWS), epoch=epoch).committed
    assert_exactly(path, [epoch], ROWS, before=before)


def test_a_feed_whose_close_failed_fails_the_commit_at_once(
        shared: tuple[SinkRuntime, Path]) -> None:
    """A producer's ``close()`` that raised (here at ``feed.before_close``; in a chaos run
    a writer lost as a feed task closed) gave the feed up: the commit fails at once,
    naming it, instead of waiting ``commit_timeout`` for a feed whose heartbeat went on
    (seed 1126: 65 s); a write to it, or closing it again, says it failed. Then the epoch
    is fed again, exactly."""
    from raysink.testing import arm_fault

    rt, path = shared
    epoch, before = _next(rt), read_ids(path)
    ep = rt.open_epoch()
    ok = produce.remote(ep.feed(), epoch, 1)
    feed = ep.feed()
    feed.write(_part(epoch, 0))
    arm_fault(rt.name, "feed.before_close", action="raise")
    with pytest.raises(EpochFailedError, match="its close failed: InjectedFault") as raised:
        feed.close()  # a raysink error, the fault its cause
    assert type(raised.value.__cause__).__name__ == "InjectedFault"
    with pytest.raises(EpochFailedError, match=r"failed \(.*\) and cannot close"):
        feed.close()
    with pytest.raises(EpochFailedError, match="takes no more data"):
        feed.write(_part(epoch, 0))
    ray.get(ok)
    with pytest.raises(EpochFailedError, match="its close failed: InjectedFault"):
        ep.commit()
    assert rt.write_arrow(epoch_table(epoch, ROWS), epoch=epoch).committed
    assert_exactly(path, [epoch], ROWS, before=before)


def test_a_run_held_as_its_attempt_was_aborted_is_not_applied_after_the_rollback(
        shared: tuple[SinkRuntime, Path]) -> None:
    """A writer took a run of the epoch's messages from its mailbox and was held there
    (``writer.before_apply``, 4 s) while the attempt was aborted: the run is dropped, not
    applied after the attempt's rollback. Applied after it, its rows stayed in the sink
    writer and the epoch fed again committed them twice (chaos seed 1126, t0037: a
    stream's second sink showed 28 rows of an aborted attempt beside their replay)."""
    from raysink.testing import arm_fault

    rt, path = shared
    epoch, before = _next(rt), read_ids(path)
    arm_fault(rt.name, "writer.before_apply", action="sleep", seconds=4.0,
              when={"epoch": epoch})
    ep = rt.open_epoch()
    task = produce.remote(ep.feed(), epoch, 0)
    wait_fired(rt.name, "writer.before_apply")
    ep.abort()
    ray.wait([task], timeout=60)  # its close waited for the held run to go on
    assert sorted(read_ids(path)) == sorted(before)
    again = rt.open_epoch(epoch)
    ray.get([produce.remote(again.feed(), epoch, part) for part in range(PARTS)])
    assert again.commit().committed
    assert_exactly(path, [epoch], ROWS, before=before)


def test_an_attempt_given_up_while_its_seal_waited_is_not_pre_committed(
        shared: tuple[SinkRuntime, Path]) -> None:
    """Writer 0's seal found the attempt's data applied and was held before its pre-commit
    (``writer.before_pre_commit``, 5 s) while the attempt was given up there (its CANCEL
    rolled the sink writer back, as a stream's recovery does). The seal refuses: its
    pre-commit would have staged what the sink writer held by then (nothing, or the next
    attempt's rows) as this attempt's part, and the commit went through without writer 0's
    rows. The commit fails, nothing is visible, and the epoch fed again is exact."""
    from raysink.protocol.barrier import BarrierFlags, CheckpointBarrier
    from raysink.testing import arm_fault
    from tests.integration.helpers import run_in_thread

    rt, path = shared
    epoch, before = _next(rt), read_ids(path)
    arm_fault(rt.name, "writer.before_pre_commit", action="sleep", seconds=5.0,
              when={"epoch": epoch, "writer": 0})
    ep = rt.open_epoch()
    ray.get([produce.remote(ep.feed(), epoch, part) for part in range(PARTS)])
    thread, box = run_in_thread(ep.commit)
    wait_fired(rt.name, "writer.before_pre_commit")
    writer = rt._require_started().writers["main"][0]
    cancel = CheckpointBarrier(rt._epochs.next_checkpoint(), epoch, BarrierFlags.CANCEL)
    ray.get(writer.cancel.remote(cancel, ep.attempt))
    thread.join(timeout=120)
    assert isinstance(box.get("error"), EpochFailedError), box
    assert "given up while it was sealed" in str(box["error"])
    assert sorted(read_ids(path)) == sorted(before)
    assert rt.write_arrow(epoch_table(epoch, ROWS), epoch=epoch).committed
    assert_exactly(path, [epoch], ROWS, before=before)


def test_abort_leaves_nothing_and_the_epoch_can_be_fed_again(
        shared: tuple[SinkRuntime, Path]) -> None:
    rt, path = shared
    epoch, before = _next(rt), read_ids(path)
    with pytest.raises(KeyError), rt.open_epoch() as ep:
        ray.get([produce.remote(ep.feed(), epoch, part) for part in range(PARTS)])
        raise KeyError("the job changed its mind")  # the with block aborts
    assert sorted(read_ids(path)) == sorted(before)
    with rt.open_epoch() as again:  # commits at the end of the block
        assert again.epoch == epoch
        ray.get([produce.remote(again.feed(), epoch, part) for part in range(PARTS)])
    assert_exactly(path, [epoch], ROWS, before=before)


def test_a_committed_epoch_opens_skipped_and_feeds_write_nothing(
        shared: tuple[SinkRuntime, Path]) -> None:
    rt, path = shared
    epoch, before = _next(rt), read_ids(path)
    first = rt.open_epoch(epoch)
    ray.get([produce.remote(first.feed(), epoch, part) for part in range(PARTS)])
    first.commit()
    rerun = rt.open_epoch(epoch)
    assert rerun.skipped
    assert ray.get([produce.remote(rerun.feed(), epoch, p) for p in range(PARTS)]) == [
        ROWS // PARTS] * PARTS
    report = rerun.commit()
    assert report.skipped and report.rows == 0
    assert_exactly(path, [epoch], ROWS, before=before)


def test_mixed_schemas_across_feeds_are_refused_and_nothing_is_written(
        shared: tuple[SinkRuntime, Path]) -> None:
    rt, path = shared
    epoch, before = _next(rt), read_ids(path)
    ep = rt.open_epoch()
    ray.get(produce.remote(ep.feed(), epoch, 0))
    odd = _part(epoch, 1).append_column("extra", pa.array(["x"] * (ROWS // PARTS)))
    feed = ep.feed()
    feed.write(odd)
    feed.close()
    with pytest.raises(SchemaMismatchError):
        ep.commit()
    with pytest.raises(ConfigError, match="closed"):
        feed.write(_part(epoch, 1))
    assert sorted(read_ids(path)) == sorted(before)


def test_only_one_epoch_is_open_for_producers(shared: tuple[SinkRuntime, Path]) -> None:
    rt, path = shared
    epoch, before = _next(rt), read_ids(path)
    ep = rt.open_epoch()
    with pytest.raises(ConfigError, match="still open"):
        rt.write_arrow(epoch_table(epoch + 1))
    with pytest.raises(ConfigError, match="still open"):
        rt.open_epoch()
    ep.abort()
    assert rt.write_arrow(epoch_table(epoch, 10)).epoch == epoch
    assert Counter(read_ids(path)) == Counter(before) + Counter(
        epoch * 1_000_000 + i for i in range(10))


def test_a_writer_ended_for_good_is_replaced_when_the_next_epoch_opens(tmp_path: Path,
                                                                      name: str) -> None:
    """Writer 1 ended for good between two epochs (``ray.kill``: Ray starts no other, as
    when an actor's restarts ran out). ``open_epoch`` replaces it before handing out
    feeds, and the next epoch's producers commit exactly once. Before, nothing replaced
    it on this path: every feed that wrote to it failed, in every later epoch."""
    with _runtime(tmp_path, name) as rt:
        for epoch in (1, 2):
            with rt.open_epoch() as ep:
                ray.get([produce.remote(ep.feed(), epoch, part) for part in range(PARTS)])
            if epoch == 1:
                end_for_good(rt, writer=1)
    assert_exactly(tmp_path / "table", [1, 2], ROWS)
