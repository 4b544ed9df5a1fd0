"""The committer's ``commit_transaction`` times out on the real broker, and the sink goes
on: the next try resumes that commit (librdkafka keeps it as the call in progress and
refuses every other transactional call with ``_CONFLICT`` until it is called again), and
the later epochs commit, each once. The scripted cases (an abort that times out, fatal
errors of each kind) are in ``tests/unit/test_kafka_committer.py``.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections import Counter

import pytest

from raysink import SinkRuntime
from raysink.testing import arm_fault
from tests.integration.helpers import run_in_thread, wait_fired
from tests.kafka.conftest import Records, halves, sink
from tests.support.kafka import KafkaBroker

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.timeout(300)]

TIMEOUT = 4.0  # the sink's client timeout: commit_transaction gives up after it
PAUSE = 8.0  # the broker stopped this long, from just before the commit


def test_a_commit_that_timed_out_is_resumed(kafka_broker: KafkaBroker, topic: str,
                                            name: str, meta: str) -> None:
    """The broker is paused (SIGSTOP) while the committer commits epoch 2, for twice the
    sink's ``timeout``: its ``commit_transaction`` times out. Before the fix, every later
    try aborted first and got ``_CONFLICT``, for ever (until the coordinator restarted);
    now epoch 2 and the two after it commit, every record once, and the progress topic
    holds each epoch's record once (a resumed commit is not written again)."""
    with SinkRuntime(name, sink(kafka_broker, topic, timeout=TIMEOUT), writers=2,
                     metastore=meta, progress=False, retry_cap=1.0,
                     commit_timeout=60) as rt:
        assert rt.write_arrow(halves(1)).committed
        arm_fault(name, "sink.mid_commit", action="sleep", seconds=1.0, when={"epoch": 2})
        thread, box = run_in_thread(lambda: rt.write_arrow(halves(2)))
        wait_fired(name, "sink.mid_commit", timeout=120)
        pid = kafka_broker.pid
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(PAUSE)
        finally:
            os.kill(pid, signal.SIGCONT)
        thread.join(timeout=120)
        assert not thread.is_alive(), "epoch 2 never committed after the broker came back"
        assert "error" not in box, box.get("error")
        assert box["result"].committed
        assert rt.write_arrow(halves(3)).committed
        assert rt.write_arrow(halves(4)).committed
    Records(kafka_broker, topic).assert_exactly([1, 2, 3, 4])
    progress = Records(kafka_broker, f"{topic}-raysink-progress").messages
    epochs = Counter(json.loads(m.value())["epoch"] for m in progress
                     if m.key() == f"raysink:{name}:main".encode())
    assert epochs == {1: 1, 2: 1, 3: 1, 4: 1}
