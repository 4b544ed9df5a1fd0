"""Two deployments with the same runtime and sink names on one cluster, writing different
topics with meta stores of their own: their transactional ids are scoped by topic, so
neither fences the other's writers or committer, and both commit every epoch once.

The second deployment is played by this process with the sink's own parts (a runtime of
the same name cannot run beside the first on one Ray cluster): its writer slot 0 takes
its id over, writes and pre-commits an epoch, commits its part, and its coordinator's
commit writes the epoch record, all while the first runtime holds an epoch decided with
its writers' transactions open. Before the ids were scoped, that take-over fenced the
first runtime's writer 0 and committer: its next commit stopped with ``FencedError``.
"""

from __future__ import annotations

from typing import Any

import pytest

from raysink import SinkRuntime
from raysink.sinks import KafkaSink
from raysink.sinks.base import CommitResult, Held
from raysink.testing import arm_fault
from tests.integration.helpers import run_in_thread, wait_fired
from tests.kafka.conftest import Records, epoch_rows, halves, sink
from tests.support.kafka import KafkaBroker

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.timeout(300)]


def _other_epoch(other: KafkaSink, epoch: int) -> None:
    """One epoch of the other deployment, through its writer slot 0 and its committer."""
    writer = other.create_writer(0)
    writer.open()  # takes the slot's transactional id over
    try:
        for batch in epoch_rows(epoch).to_batches():
            writer.write(batch)
        manifest = writer.pre_commit(epoch, 0)
        assert writer.finish(epoch, 0, commit=True) is Held.COMMITTED
    finally:
        writer.close()
    assert other.commit(epoch, [manifest]) is CommitResult.COMMITTED


def test_two_deployments_of_one_name_on_two_topics_both_commit(
        kafka_broker: KafkaBroker, name: str, meta: str) -> None:
    first, second = f"{name}-a", f"{name}-b"
    other = sink(kafka_broker, second).bind(name, "main")
    other.topics().create_progress()  # a commit makes it before it asks any writer
    try:
        with SinkRuntime(name, sink(kafka_broker, first), writers=2, metastore=meta,
                         progress=False, commit_timeout=60) as rt:
            assert rt.write_arrow(halves(1)).committed
            _other_epoch(other, 1)
            # the other deployment's whole epoch while this one holds epoch 2 decided,
            # its writers' transactions open, its committer's transaction begun
            arm_fault(name, "kafka.before_finish", action="sleep", seconds=3.0,
                      when={"epoch": 2})
            thread, box = run_in_thread(lambda: rt.write_arrow(halves(2)))
            wait_fired(name, "kafka.before_finish", timeout=120)
            _other_epoch(other, 2)
            thread.join(timeout=120)
            assert not thread.is_alive(), "epoch 2 never finished"
            if "error" in box:
                raise box["error"]
            report: Any = box["result"]
            assert report.committed and report.attempts == 1
            assert rt.write_arrow(halves(3)).committed
            _other_epoch(other, 3)
    finally:
        other.close()
    Records(kafka_broker, first).assert_exactly([1, 2, 3])
    Records(kafka_broker, second).assert_exactly([1, 2, 3])
    assert other.committed_epoch() == 3
