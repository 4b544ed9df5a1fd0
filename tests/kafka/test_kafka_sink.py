"""KafkaSink through ``SinkRuntime`` on the session's broker: records, keys, replays."""

from __future__ import annotations

import pytest

from raysink import SinkRuntime
from tests.kafka.conftest import Records, halves, sink
from tests.support.kafka import KafkaBroker

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.timeout(300)]


def test_epochs_exactly_once(kafka_broker: KafkaBroker, topic: str, name: str,
                             meta: str) -> None:
    with SinkRuntime(name, sink(kafka_broker, topic), writers=2, metastore=meta,
                     progress=False) as rt:
        for epoch in (1, 2, 3):
            assert rt.write_arrow(halves(epoch)).committed
        replay = rt.write_arrow(halves(2), epoch=2)
        assert replay.skipped
        assert rt.sinks["main"].committed_epoch() == 3
    Records(kafka_broker, topic).assert_exactly([1, 2, 3])
