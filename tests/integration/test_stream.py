"""Continuous streams (``rt.stream()``): long-lived producers, an epoch every
``checkpoint_interval``, each committed on its own; a producer killed and restarted by
Ray makes the stream rewind and every producer replays from the last committed epoch
(the replayable source of ``examples/replayable_stream.py``). The target holds every
source row exactly once."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import ray

from examples.replayable_stream import ReplayableProducer
from raysink import SinkRuntime
from raysink.testing import arm_fault, fired_context
from tests.integration.helpers import sigkill
from tests.integration.real_targets import ParquetTarget
from tests.integration.stream_support import source_ids, table_ids

pytestmark = pytest.mark.usefixtures("ray_session")


def _runtime(tmp_path: Path, name: str, **options: Any) -> SinkRuntime:
    return SinkRuntime(name, ParquetTarget(tmp_path / "table").sink(), writers=2,
                       metastore=f"sqlite:///{tmp_path / 'meta.db'}", progress=False,
                       checkpoint_interval=0.5, **options)


def _wait_restarted(actor: Any, old_pid: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if ray.get(actor.pid.remote(), timeout=10) != old_pid:
                return
        except ray.exceptions.RayActorError:
            if time.monotonic() > deadline:
                raise
        time.sleep(0.2)


def _await_written(offsets: Path, timeout: float = 60.0) -> None:
    """Until the producer keeping ``offsets`` noted a write (it is a member: it joins
    the stream at its first write)."""
    deadline = time.monotonic() + timeout
    while not (offsets.exists() and json.loads(offsets.read_text() or "{}")):
        assert time.monotonic() < deadline, f"{offsets} noted no write in {timeout:g} s"
        time.sleep(0.05)


def test_producers_stream_epochs_that_commit_on_their_own(tmp_path: Path, name: str) -> None:
    target = ParquetTarget(tmp_path / "table")
    with _runtime(tmp_path, name) as rt:
        producers = [ReplayableProducer.remote(p, rt.stream(), str(tmp_path / f"o{p}.json"))
                     for p in range(2)]
        # writes per producer, replays included: 30 each, or more after a rewind. A
        # healthy stream still rewinds when a writer gets a producer's rows of epoch E+1
        # before anything of E (raysink/writer/held.py): seen once in about ten runs under
        # load; the table is exact either way
        assert all(n >= 30 for n in ray.get([p.run.remote(30, 0.05) for p in producers]))
        committed = rt.status().last_committed_epoch
        assert committed is not None and committed >= 2  # several epochs, each on its own
    # producers that waited for their last epoch leave the drain nothing to commit; a
    # rewind (above) skips the number of the epoch it dropped
    epochs = target.commit_epochs(name)
    assert epochs == sorted(set(epochs)) and len(epochs) >= 2
    assert table_ids(target) == source_ids(2, 30)


def test_a_restarted_producer_rewinds_the_stream_and_nothing_is_lost_or_doubled(
        tmp_path: Path, name: str) -> None:
    target = ParquetTarget(tmp_path / "table")
    with _runtime(tmp_path, name, feed_timeout=3.0) as rt:
        producers = [ReplayableProducer.remote(p, rt.stream(), str(tmp_path / f"o{p}.json"))
                     for p in range(2)]
        victim_pid = ray.get(producers[0].pid.remote())
        runs = [p.run.remote(60, 0.05) for p in producers]
        for p in range(2):  # both are in the stream (a producer joins at its first write)
            _await_written(tmp_path / f"o{p}.json")
        sigkill(victim_pid)  # Ray restarts the actor; its run call fails
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(runs[0])
        _wait_restarted(producers[0], victim_pid)
        resumed = producers[0].run.remote(60, 0.05)
        assert ray.get(runs[1]) > 60  # the survivor replayed after the rewind
        ray.get(resumed)
    assert table_ids(target) == source_ids(2, 60)


def test_a_producer_restarted_while_its_closed_epoch_commits_resumes_after_that_epoch(
        tmp_path: Path, name: str) -> None:
    """The epoch the producer closed last is decided and still committing (its commit held
    at ``sink.mid_commit``) when the producer is killed: the restarted producer must not
    resume from the epoch before it (``committed()`` waits for the rewind its restart
    forces, which comes after that commit)."""
    target = ParquetTarget(tmp_path / "table")
    arm_fault(name, "sink.mid_commit", action="sleep", seconds=4.0, when={"epoch": 2})
    with _runtime(tmp_path, name, feed_timeout=3.0) as rt:
        producer = ReplayableProducer.remote(0, rt.stream(), str(tmp_path / "o0.json"))
        victim_pid = ray.get(producer.pid.remote())
        run = producer.run.remote(80, 0.05)
        deadline = time.monotonic() + 60
        while fired_context(name, "sink.mid_commit") is None:
            assert time.monotonic() < deadline, "epoch 2 never reached its commit"
            time.sleep(0.05)
        sigkill(victim_pid)
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(run)
        _wait_restarted(producer, victim_pid)
        ray.get(producer.run.remote(80, 0.05))
    assert 2 in target.commit_epochs(name)
    assert table_ids(target) == source_ids(1, 80)
