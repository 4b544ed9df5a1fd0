"""A continuous stream (``rt.stream()``) under faults, with producers that follow the
contract of ``examples/replayable_stream.py`` (offsets noted in ``on_sent``,
``StreamRewind`` handled): a producer idle through a rewind (and a rescale asked for
meanwhile), a writer killed (Ray restarts it) and another replaced (the runtime
re-creates it), the coordinator killed (the driver re-creates it and hands the stream
over). Each ends with ``close()`` returning and the target holding every source row
exactly once. One runtime per test: each breaks its own."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import ray

from examples.replayable_stream import OffsetBook, ReplayableProducer, source_batch
from raysink import RescaleRefusedError, SinkRuntime, StreamFeed, StreamRewind
from raysink.testing import arm_fault
from tests.integration.helpers import actor_pid, sigkill
from tests.integration.real_targets import ParquetTarget
from tests.integration.stream_support import source_ids, table_ids

pytestmark = pytest.mark.usefixtures("ray_session")

BATCHES = 30
LONG_BATCHES = 60  # two faults, one after the other, while the producers write
PAUSE = 0.05
RUN_TIMEOUT = 240.0


def _runtime(tmp_path: Path, name: str, **options: Any) -> SinkRuntime:
    return SinkRuntime(name, ParquetTarget(tmp_path / "table").sink(), writers=2,
                       metastore=f"sqlite:///{tmp_path / 'meta.db'}", progress=False,
                       checkpoint_interval=0.3, feed_timeout=5.0, commit_timeout=20.0,
                       **options)


def _close(rt: SinkRuntime, timeout: float = 120.0) -> None:
    """``rt.close()``, which must return (a thread: a hang fails the test, not the run)."""
    closer = threading.Thread(target=rt.close, daemon=True)
    closer.start()
    closer.join(timeout)
    assert not closer.is_alive(), f"rt.close() did not return within {timeout:g} s"


def _producers(rt: SinkRuntime, tmp_path: Path, count: int = 2) -> list[Any]:
    return [ReplayableProducer.remote(p, rt.stream(poll_interval=0.1),
                                      str(tmp_path / f"offsets-{p}.json"))
            for p in range(count)]


def _await(condition: Any, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout:g} s: {what}"
        time.sleep(0.1)


def _await_epochs(rt: SinkRuntime, epochs: int) -> None:
    _await(lambda: (rt.status().last_committed_epoch or 0) >= epochs,
           f"epoch {epochs} committed")


def _writer_pid(rt: SinkRuntime, index: int) -> int:
    return actor_pid(rt, "writer", writer=index)


def _run_through(rt: SinkRuntime, tmp_path: Path, fault: Any,
                 batches: int = BATCHES) -> list[Any]:
    """Two producers stream ``batches`` batches each; ``fault()`` strikes once two epochs
    are committed. Returns the producers (keep them until the runtime closed: an actor
    whose handles are gone ends, and its feed is then lost to the stream)."""
    producers = _producers(rt, tmp_path)
    runs = [p.run.remote(batches, PAUSE) for p in producers]
    _await_epochs(rt, 2)
    fault()
    assert max(ray.get(runs, timeout=RUN_TIMEOUT)) > BATCHES  # the stream rewound
    return producers


@ray.remote(max_restarts=0, max_task_retries=0)
class SparseProducer:
    """Follows the producers' contract, but writes its first batch, then nothing until the
    file ``go`` exists (its poll thread alone talks to the stream meanwhile), then the
    rest."""

    def __init__(self, producer: int, feed: StreamFeed, offsets: str) -> None:
        self.producer, self.feed = producer, feed
        self.book = OffsetBook(Path(offsets))

    def run(self, batches: int, go: str) -> int:
        offset = self.book.resume_after(self.feed.committed())
        rewinds = 0
        while True:
            try:
                while offset < batches:
                    self.feed.write(source_batch(self.producer, offset),
                                    on_sent=lambda epoch, at=offset: self.book.wrote(epoch, at))
                    offset += 1
                    while offset == 1 and not os.path.exists(go):
                        time.sleep(0.05)
                self.feed.wait_committed()
                return rewinds
            except StreamRewind as rewind:
                rewinds += 1
                offset = self.book.resume_after(rewind.committed)

    def pid(self) -> int:
        return os.getpid()


def test_a_producer_idle_through_a_rewind_replays_what_it_wrote_before_it(
        tmp_path: Path, name: str) -> None:
    """An epoch fails at a writer's pre-commit and the stream rewinds while one producer
    is idle after its first batch: its poll thread sees the rewind and the next barriers,
    but only the producer itself can replay, so the rewind must wait for its next write.
    A rescale meanwhile is refused (producers route by the layout they joined with at any
    moment) and says how to rescale instead."""
    target = ParquetTarget(tmp_path / "table")
    rt = _runtime(tmp_path, name).start()
    try:
        dense = ReplayableProducer.remote(0, rt.stream(poll_interval=0.1),
                                          str(tmp_path / "offsets-0.json"))
        sparse = SparseProducer.remote(1, rt.stream(poll_interval=0.1),
                                       str(tmp_path / "offsets-1.json"))
        ray.get([dense.pid.remote(), sparse.pid.remote()])  # both up: they start together
        go = tmp_path / "go"
        runs = [dense.run.remote(BATCHES, PAUSE), sparse.run.remote(BATCHES, str(go))]
        _await(lambda: bool(OffsetBook(tmp_path / "offsets-1.json").ends),
               "the idle producer wrote its first batch (it is in the stream)")
        arm_fault(name, "writer.after_pre_commit", action="raise")  # the next epoch fails
        stream = rt._stream
        assert stream is not None
        _await(lambda: bool(stream.failures), "an epoch failed")
        _await_epochs(rt, (rt.status().last_committed_epoch or 0) + 2)  # ticks meanwhile
        with pytest.raises(RescaleRefusedError, match="close the runtime"):
            rt.rescale(writers=1)  # (the stream's later epochs are never recorded OPEN)
        go.touch()
        _, sparse_rewinds = ray.get(runs, timeout=RUN_TIMEOUT)
        assert sparse_rewinds >= 1  # the rewind reached it, through its own write
    finally:
        _close(rt)
    assert table_ids(target) == source_ids(2, BATCHES)


def test_writers_killed_or_replaced_mid_stream_rewind_it_and_producers_follow(
        tmp_path: Path, name: str) -> None:
    """SIGKILL of writer 0 (Ray restarts it, empty), then, once the stream went on, writer 1
    killed for good (the runtime replaces it under a new handle): each time the epochs the
    writer held data of fail and the stream rewinds; the producers get ``StreamRewind``,
    never Ray's error, replay, and send to the writers as they are now. Writer 1 is killed
    just after a probe found every actor well and kept the answer: the stream must not
    heal by it (it passes before 94f0600 too: the stream's own probe finds the dead
    writer, which ``write_arrow``'s and ``write(df)``'s retries did not)."""
    target = ParquetTarget(tmp_path / "table")
    rt = _runtime(tmp_path, name).start()
    producers: list[Any] = []
    try:
        assert rt._actors is not None
        victim, old = _writer_pid(rt, 0), rt._actors.writers["main"][1]

        def faults() -> None:
            sigkill(victim)
            stream = rt._stream
            assert stream is not None
            _await(lambda: bool(stream.failures), "the stream saw the writer killed")
            _await_epochs(rt, (rt.status().last_committed_epoch or 0) + 1)
            assert rt._actors is not None
            rt._actors.check_responsive()  # all well, and the answer is kept (see below)
            ray.kill(old, no_restart=True)

        producers = _run_through(rt, tmp_path, faults, batches=LONG_BATCHES)
        assert _writer_pid(rt, 0) != victim and rt._actors.writers["main"][1] is not old
    finally:
        _close(rt)
        del producers  # the producers end with their handles, after the stream drained
    assert table_ids(target) == source_ids(2, LONG_BATCHES)


def test_the_coordinator_killed_mid_stream_hands_the_stream_to_its_successor(
        tmp_path: Path, name: str) -> None:
    """SIGKILL of the coordinator: the driver re-creates it; its successor does not know
    the stream, the driver hands it over; the producers find it, rewind to what was
    decided, and replay."""
    target = ParquetTarget(tmp_path / "table")
    rt = _runtime(tmp_path, name).start()
    producers: list[Any] = []
    try:
        victim = actor_pid(rt)
        producers = _run_through(rt, tmp_path, lambda: sigkill(victim))
        assert actor_pid(rt) != victim
    finally:
        _close(rt)
        del producers  # the producers end with their handles, after the stream drained
    assert table_ids(target) == source_ids(2, BATCHES)
