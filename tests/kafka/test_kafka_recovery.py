"""The driver SIGKILLed with a Kafka epoch PENDING, and a new driver of the same name.

A child driver (this module run as a script) joins the test session's Ray, writes epochs
1-3 into a ``KafkaSink``; a ``sleep`` fault holds epoch 3 decided and uncommitted (its
commit began, no writer asked yet) and the child is SIGKILLed: its actors die with it,
the writers' open transactions with them. The test process opens the same runtime name
and meta store: the new coordinator commits epoch 3 by replaying the dead writers' parts
from the log, and the new driver's epoch 4 waits for it, so the topic holds epochs 1-4
once, in order.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import ray

from raysink import RuntimeInUseError, SinkRuntime
from raysink.sinks import KafkaSink
from raysink.testing import arm_fault, disarm_faults, fired
from tests.integration.test_recovery_process import _Child
from tests.kafka.conftest import Records, assert_aborted_reached_log, halves

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.timeout(400)]


def _sink(bootstrap: str, topic: str) -> KafkaSink:
    return KafkaSink(bootstrap, topic, key="customer", partitions=3, timeout=30.0)


def child_main(config: dict[str, Any]) -> None:
    """The doomed driver: epochs 1-3, printing ``DONE <e>`` after each, then wait."""
    ray.init(address=config["address"], namespace="raysink", log_to_driver=False)
    rt = SinkRuntime(config["name"], _sink(config["bootstrap"], config["topic"]), writers=2,
                     metastore=config["metastore"], progress=False).start()
    for epoch in (1, 2, 3):
        report = rt.write_arrow(halves(epoch), epoch=epoch)
        print(f"DONE {epoch} {report.committed}", flush=True)
    time.sleep(600)  # the test kills us before this ends


class _KafkaChild(_Child):
    module = "tests.kafka.test_kafka_recovery"


def test_driver_killed_with_an_epoch_pending(kafka_broker: Any, topic: str, name: str,
                                             tmp_path: Path) -> None:
    meta = f"sqlite:///{tmp_path / 'meta.db'}"
    config = {"address": ray.get_runtime_context().gcs_address, "name": name,
              "metastore": meta, "bootstrap": kafka_broker.bootstrap, "topic": topic}
    arm_fault(name, "kafka.before_finish", action="sleep", seconds=60.0, when={"epoch": 3})
    child = _KafkaChild(config, tmp_path / "child.log")
    try:
        child.wait_until(lambda: fired(name, "kafka.before_finish"), timeout=240)
        assert "DONE 2 True" in child.output()
    finally:
        child.kill()
        disarm_faults(name)
    deadline = time.monotonic() + 60
    while True:
        try:
            rt = SinkRuntime(name, _sink(kafka_broker.bootstrap, topic), writers=2,
                             metastore=meta, progress=False, commit_timeout=120).start()
            break
        except RuntimeInUseError:
            assert time.monotonic() < deadline
            time.sleep(0.2)
    try:
        again = rt.write_arrow(halves(3), epoch=3)
        assert again.skipped and again.committed  # rolled forward, not written twice
        assert rt.write_arrow(halves(4)).committed
    finally:
        rt.close()
    Records(kafka_broker, topic).assert_exactly([1, 2, 3, 4])
    assert_aborted_reached_log(kafka_broker, topic, 3)


if __name__ == "__main__":
    child_main(json.loads(sys.argv[1]))
