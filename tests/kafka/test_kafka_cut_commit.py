"""A Kafka commit cut after the writers committed their parts and before the epoch record.

``test_a_fresh_meta_store_does_not_write_a_partly_committed_epoch_again``: a child driver
(this module run as a script) writes epochs 1-2, then epoch 3 with a ``sleep`` fault at
``sink.mid_commit`` (the writers committed their parts, with their part records; the
committer's epoch record not yet), and is SIGKILLed with every actor of its runtime and its
SQLite meta store left behind. A new runtime of the same name with a fresh meta store sees
epoch 3 partly in the topic and refuses to write it again (its parts would be doubled);
with ``epoch_offset=3`` it goes on after it.

``test_a_coordinator_lost_after_the_epoch_record_reports_the_rows``: the coordinator is
SIGKILLed after the epoch record was committed and before the commit was recorded in the
meta store; its successor finds the epoch in the topic, and the epoch record names this
decision, so the report counts the rows (not ``skipped``).
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import ray

from raysink import ConfigError, RuntimeInUseError, SinkRuntime
from raysink.testing import arm_fault, disarm_faults, fired
from tests.integration.test_recovery_process import _Child
from tests.kafka.conftest import ROWS, Records, halves, sink
from tests.support.kafka import KafkaBroker

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.timeout(400)]


def _runtime(name: str, bootstrap: str, topic: str, meta: str, **options: Any
             ) -> SinkRuntime:
    return SinkRuntime(name, sink(_Broker(bootstrap), topic), writers=2, metastore=meta,
                       progress=False, **options)


class _Broker:
    """What ``sink`` needs of a broker, in the child driver (which has no fixture)."""

    def __init__(self, bootstrap: str) -> None:
        self.bootstrap = bootstrap


def child_main(config: dict[str, Any]) -> None:
    """The doomed driver: epochs 1-2, printing ``DONE <e>`` after each, then epoch 3,
    whose commit the armed fault holds after the writers' parts."""
    ray.init(address=config["address"], namespace="raysink", log_to_driver=False)
    rt = _runtime(config["name"], config["bootstrap"], config["topic"],
                  config["metastore"]).start()
    for epoch in (1, 2):
        report = rt.write_arrow(halves(epoch), epoch=epoch)
        print(f"DONE {epoch} {report.committed}", flush=True)
    rt.write_arrow(halves(3), epoch=3)
    time.sleep(600)  # the test kills us before this ends


class _KafkaChild(_Child):
    module = "tests.kafka.test_kafka_cut_commit"


def _reopen(name: str, broker: KafkaBroker, topic: str, meta: str,
            **options: Any) -> SinkRuntime:
    """The same name, as soon as the dead driver's actor names are free."""
    deadline = time.monotonic() + 60
    while True:
        try:
            return _runtime(name, broker.bootstrap, topic, meta, **options).start()
        except RuntimeInUseError:
            assert time.monotonic() < deadline
            time.sleep(0.2)


def test_a_fresh_meta_store_does_not_write_a_partly_committed_epoch_again(
        kafka_broker: KafkaBroker, topic: str, name: str, tmp_path: Path) -> None:
    """Before: the fresh store aligned at the epoch record (2), the replay of epoch 3 was
    decided again and its writers committed the rows of epoch 3 a second time."""
    config = {"address": ray.get_runtime_context().gcs_address, "name": name,
              "metastore": f"sqlite:///{tmp_path / 'lost.db'}",
              "bootstrap": kafka_broker.bootstrap, "topic": topic}
    arm_fault(name, "sink.mid_commit", action="sleep", seconds=120.0, when={"epoch": 3})
    child = _KafkaChild(config, tmp_path / "child.log")
    try:
        child.wait_until(lambda: fired(name, "sink.mid_commit"), timeout=240)
        assert "DONE 2 True" in child.output()
    finally:
        child.kill()
        disarm_faults(name)
    fresh = f"sqlite:///{tmp_path / 'fresh.db'}"
    rt = _reopen(name, kafka_broker, topic, fresh)
    refused: list[ConfigError] = []
    try:
        for epoch in (3, None):  # the replay of epoch 3; the next epoch, numbered 3
            try:
                rt.write_arrow(halves(3), epoch=epoch)
            except ConfigError as exc:
                refused.append(exc)
    finally:
        rt.close()
    Records(kafka_broker, topic).assert_exactly([1, 2, 3])  # epoch 3's parts were in
    assert len(refused) == 2 and all(e.epoch == 3 for e in refused), refused
    assert re.search(r"epoch 3 is partly in .*writers \[0, 1\].*epoch_offset=3",
                     str(refused[0]))
    rt = _reopen(name, kafka_broker, topic, fresh, epoch_offset=3)
    try:
        assert rt.write_arrow(halves(3), epoch=3).skipped
        assert rt.write_arrow(halves(4)).epoch == 4
    finally:
        rt.close()
    Records(kafka_broker, topic).assert_exactly([1, 2, 3, 4])


def test_a_coordinator_lost_after_the_epoch_record_reports_the_rows(
        kafka_broker: KafkaBroker, topic: str, name: str, meta: str) -> None:
    """Before: the restarted coordinator found the epoch record and, with nothing to tell
    whose decision it held, reported the epoch ``skipped`` with 0 rows."""
    with _runtime(name, kafka_broker.bootstrap, topic, meta, commit_timeout=120,
                  retry_cap=1.0) as rt:
        assert rt.write_arrow(halves(1)).committed
        arm_fault(name, "coordinator.after_commit", action="kill", when={"epoch": 2})
        report = rt.write_arrow(halves(2))
        assert fired(name, "coordinator.after_commit")
        assert report.committed and not report.skipped, report
        assert report.rows == ROWS
        assert rt.write_arrow(halves(3)).committed
    Records(kafka_broker, topic).assert_exactly([1, 2, 3])


if __name__ == "__main__":
    child_main(json.loads(sys.argv[1]))
