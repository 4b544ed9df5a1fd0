"""Exactly once into Kafka under the faults the other sinks survive, and the broker's own.

Every case reads the topic back with ``read_committed`` and compares it record by record
(each row once, nothing else, epochs in order in each partition), and with
``read_uncommitted`` where an attempt's records reached the log before the fault (so the
case would fail if the sink let them through).
"""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import ray

from raysink import SinkRuntime
from raysink.testing import arm_fault, fired
from tests.integration.helpers import run_in_thread, sigkill, wait_fired
from tests.kafka.conftest import Records, assert_aborted_reached_log, halves, sink
from tests.support.kafka import KafkaBroker

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.timeout(400)]


def _runtime(name: str, broker: KafkaBroker, topic: str, meta: str,
             **options: Any) -> SinkRuntime:
    sink_options = options.pop("sink_options", {})
    options.setdefault("commit_timeout", 120)
    return SinkRuntime(name, sink(broker, topic, **sink_options), writers=2, metastore=meta,
                       progress=False, retry_cap=1.0, **options)


def _writer_pid(rt: SinkRuntime, index: int = 0) -> int:
    """The writer's process id, once it answers (a killed one restarts for a while)."""
    from ray.exceptions import ActorUnavailableError

    actors = rt._actors
    assert actors is not None
    deadline = time.monotonic() + 120
    while True:
        try:
            return int(ray.get(actors.writers["main"][index].ping.remote(), timeout=60))
        except ActorUnavailableError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def _exactly_within(broker: KafkaBroker, topic: str, epochs: list[int],
                    seconds: float) -> None:
    """``read_committed`` readers see exactly ``epochs`` within ``seconds``."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            Records(broker, topic).assert_exactly(epochs)
            return
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def _progress(broker: KafkaBroker, topic: str, name: str) -> list[dict[str, Any]]:
    """The epoch records of the runtime's sink, in the order they were committed."""
    messages = Records(broker, f"{topic}-raysink-progress").messages
    return [json.loads(m.value()) for m in messages
            if m.key() == f"raysink:{name}:main".encode()]


def _held_then(rt: SinkRuntime, name: str, epoch: int, act: Any) -> Any:
    """Write ``epoch`` while a sleep holds it decided, no writer asked to commit yet;
    ``act()`` meanwhile."""
    arm_fault(name, "kafka.before_finish", action="sleep", seconds=3.0, when={"epoch": epoch})
    thread, box = run_in_thread(lambda: rt.write_arrow(halves(epoch)))
    wait_fired(name, "kafka.before_finish", timeout=120)
    act()
    thread.join(timeout=300)
    assert not thread.is_alive(), "the epoch never finished"
    if "error" in box:
        raise box["error"]
    return box["result"]


def test_writers_and_coordinator_killed(kafka_broker: KafkaBroker, topic: str, name: str,
                                        meta: str) -> None:
    """One runtime, a fault per epoch; the topic ends with epochs 1-7, each once. (Five
    attempts: a loaded machine takes seconds to restart a killed writer, and each try in
    between fails.)"""
    with _runtime(name, kafka_broker, topic, meta, max_attempts=5) as rt:
        assert rt.write_arrow(halves(1)).committed
        # 2: writer 0 dies while the epoch is being written (its records only buffered)
        arm_fault(name, "writer.during_write", action="kill",
                  when={"epoch": 2, "writer": 0, "sink": "main"})
        assert rt.write_arrow(halves(2)).committed and fired(name, "writer.during_write")
        # 3: writer 0 dies after its pre-commit (records in its open transaction), before
        # its commit request: the attempt is aborted, epoch 3 fed again. Writer 0 is
        # awaited first: while Ray restarts it, an epoch goes around it (no part of it)
        _writer_pid(rt)
        arm_fault(name, "writer.after_pre_commit", action="kill",
                  when={"epoch": 3, "writer": 0, "sink": "main"})
        third = rt.write_arrow(halves(3))
        assert fired(name, "writer.after_pre_commit")
        assert third.committed and third.attempts >= 2
        # 4: the coordinator dies with the epoch PENDING: the new one has the writers
        # commit the transactions they still hold
        arm_fault(name, "coordinator.after_pending", action="kill", when={"epoch": 4})
        fourth = rt.write_arrow(halves(4))
        assert fourth.committed and fourth.attempts == 1
        # 5: the coordinator dies inside the sink's commit: the writers committed their
        # parts, the epoch record was not written; the new coordinator finishes it
        arm_fault(name, "sink.mid_commit", action="kill", when={"epoch": 5})
        assert rt.write_arrow(halves(5)).committed
        # 6: writer 0 is SIGKILLed with epoch 6 PENDING: its transaction is lost (the
        # restarted writer fences it); the commit replays its part from the log
        pid = _writer_pid(rt)
        assert _held_then(rt, name, 6, lambda: sigkill(pid)).committed
        assert _writer_pid(rt) != pid
        assert rt.write_arrow(halves(7)).committed
    Records(kafka_broker, topic).assert_exactly(range(1, 8))
    for epoch in (3, 6):  # the aborted attempt, the lost transaction: both in the log
        assert_aborted_reached_log(kafka_broker, topic, epoch)
    epochs = [r["epoch"] for r in _progress(kafka_broker, topic, name)]
    assert sorted(set(epochs)) == list(range(1, 8))


def test_a_restarted_writer_ends_the_transaction_it_lost(kafka_broker: KafkaBroker,
                                                         topic: str, name: str,
                                                         meta: str) -> None:
    """Writer 0 dies after its pre-commit of epoch 2 (its records in an open transaction,
    its ack not sent); Ray's restart of it is slow, so the retry goes around it, and it
    gets no rows after. Its restart takes the transactional id over at once, which aborts
    the transaction it left. Before: nothing did until ``transaction_timeout`` (15 min),
    so ``read_committed`` readers stopped at that transaction's first record and epoch 2's
    committed records stayed out of sight (chaos seed 1126 t0164)."""
    with _runtime(name, kafka_broker, topic, meta) as rt:
        assert rt.write_arrow(halves(1)).committed
        arm_fault(name, "writer.start", action="sleep", seconds=6.0,
                  when={"writer": 0, "sink": "main"})
        arm_fault(name, "writer.after_pre_commit", action="kill",
                  when={"epoch": 2, "writer": 0, "sink": "main"})
        report = rt.write_arrow(halves(2))
        assert fired(name, "writer.after_pre_commit") and report.committed
        _writer_pid(rt)  # writer 0 is back, with no epoch to write
        # seen while it runs: its take-over (a thread its start begins; the process answers
        # before it ends) aborts the lost transaction within seconds, not 15 minutes
        _exactly_within(kafka_broker, topic, [1, 2], seconds=60)
    Records(kafka_broker, topic).assert_exactly([1, 2])
    assert_aborted_reached_log(kafka_broker, topic, 2)


def test_transaction_timeout_is_replayed(kafka_broker: KafkaBroker, topic: str, name: str,
                                         meta: str) -> None:
    """A writer's transaction outlives ``transaction_timeout`` while its epoch is PENDING:
    the broker aborts it, and the commit writes the epoch again from the log."""
    with _runtime(name, kafka_broker, topic, meta,
                  sink_options={"transaction_timeout": 2.0}) as rt:
        assert rt.write_arrow(halves(1)).committed
        # four times the timeout: the broker looks for timed-out transactions every
        # second (tests.support.kafka), so it has aborted epoch 2's by then; were it
        # not, the commit would go through and the replay asserted below be missing
        arm_fault(name, "kafka.before_finish", action="sleep", seconds=8.0,
                  when={"epoch": 2})
        assert rt.write_arrow(halves(2)).committed
        assert rt.write_arrow(halves(3)).committed  # the writers made new producers
    Records(kafka_broker, topic).assert_exactly([1, 2, 3])
    assert_aborted_reached_log(kafka_broker, topic, 2)


def test_broker_killed_mid_epoch_and_mid_commit(kafka_broker: KafkaBroker, topic: str,
                                                name: str, meta: str) -> None:
    """The broker's JVM is SIGKILLed and restarted while epoch 2 is being written, and
    while epoch 3 is PENDING: each commits once when the broker is back."""
    with _runtime(name, kafka_broker, topic, meta,
                  sink_options={"timeout": 90.0}) as rt:
        assert rt.write_arrow(halves(1)).committed
        arm_fault(name, "writer.during_write", action="sleep", seconds=1.0,
                  when={"epoch": 2, "writer": 0})
        thread, box = run_in_thread(lambda: rt.write_arrow(halves(2)))
        wait_fired(name, "writer.during_write", timeout=120)
        kafka_broker.restart(kill=True)
        thread.join(timeout=300)
        assert "error" not in box, box.get("error")
        assert box["result"].committed
        third = _held_then(rt, name, 3, lambda: kafka_broker.restart(kill=True))
        assert third.committed
        assert rt.write_arrow(halves(4)).committed
    Records(kafka_broker, topic).assert_exactly([1, 2, 3, 4])
    epochs = Counter(r["epoch"] for r in _progress(kafka_broker, topic, name))
    assert set(epochs) == {1, 2, 3, 4}


def test_two_runtimes_of_one_name(kafka_broker: KafkaBroker, topic: str, name: str,
                                  meta: str, tmp_path: Path) -> None:
    """Another runtime of the same name (its own meta store, on another Ray cluster: here
    its coordinator's sink, bound alike) takes the sink's committer over and records its
    epoch 1. The first runtime's next commit stops with a ``RaySinkError`` naming the
    conflict, and nothing of its epoch is visible."""
    from raysink import FencedError, RaySinkError

    # close raises it too: its decided epoch 2 never commits
    with pytest.raises(FencedError), _runtime(name, kafka_broker, topic, meta) as rt:
        assert rt.write_arrow(halves(1)).committed
        other = sink(kafka_broker, topic).bind(name, "main")
        other.recreate_marker(1)  # the other coordinator's committer: the last claim wins
        other.close()
        with pytest.raises(RaySinkError) as info:
            report = rt.write_arrow(halves(2))
            assert not report.committed
            rt.write_arrow(halves(3))
        assert isinstance(info.value, FencedError)
        assert f"second runtime named {name!r}" in str(info.value)
    Records(kafka_broker, topic).assert_exactly([1])
    assert [r["epoch"] for r in _progress(kafka_broker, topic, name)] == [1, 1]


def test_later_epoch_waits_for_a_replayed_one(kafka_broker: KafkaBroker, topic: str,
                                              name: str, meta: str) -> None:
    """Epoch 2 is decided, then the broker goes down: its commit stalls past
    ``commit_timeout``, and writer 0 is SIGKILLed meanwhile, so its part of epoch 2 must be
    replayed. Epoch 3 is fed as soon as the broker is back: its writers pre-commit only
    once epoch 2 is committed, so in every partition epoch 3's records follow the
    replayed ones."""
    with _runtime(name, kafka_broker, topic, meta, commit_timeout=3,
                  sink_options={"timeout": 90.0}) as rt:
        rt.write_arrow(halves(1))  # may take longer than 3 s: epoch 2 waits for it
        pid = _writer_pid(rt)
        arm_fault(name, "kafka.before_finish", action="sleep", seconds=2.0,
                  when={"epoch": 2})
        thread, box = run_in_thread(lambda: rt.write_arrow(halves(2)))
        wait_fired(name, "kafka.before_finish", timeout=120)
        kafka_broker.stop(kill=True)
        thread.join(timeout=120)
        assert not box["result"].committed  # decided, not visible yet
        sigkill(pid)
        kafka_broker.start()
        rt.write_arrow(halves(3))
        assert rt.write_arrow(halves(4)).committed
    Records(kafka_broker, topic).assert_exactly([1, 2, 3, 4])
    assert_aborted_reached_log(kafka_broker, topic, 2)
