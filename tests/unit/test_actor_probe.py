"""The driver's probe of its actors, without Ray: a node lost between two looks.

``ActorSet`` over a ``ClusterView`` of fixed node rows, whose worker node's raylet is a
listening socket on loopback (closed to lose the node); the actors are stand-in handles,
and the Ray state requests (which actor a call went to, which are restarting) answer from
the test.
"""

from __future__ import annotations

import socket
from typing import Any

import pytest

from raysink.coordinator.coordinator import CoordinatorConfig
from raysink.driver import raystate
from raysink.driver.lifecycle import COORDINATOR, ActorSet
from raysink.driver.placement import ClusterView
from raysink.errors import RuntimeUnavailableError

DRIVER, WORKER = "n0-driver", "n1-worker"


class _Handle:
    """A writer or coordinator handle: only its identity matters here."""

    def __init__(self, name: str) -> None:
        self.name = name


def _actors(raylet_port: int) -> ActorSet:
    rows = [{"NodeID": DRIVER, "Alive": True},
            {"NodeID": WORKER, "Alive": True, "NodeManagerAddress": "127.0.0.1",
             "NodeManagerPort": raylet_port}]
    config = CoordinatorConfig(runtime="probe", metastore=None, sinks={}, writers=1)
    actors = ActorSet(coordinator_config=config, writer_configs={"s": []},
                      view=ClusterView(driver_node=DRIVER, nodes=rows, suspects={}))
    actors.coordinator = _Handle("coordinator")
    actors.writers = {"s": [_Handle("writer-0")]}
    actors._coordinator_node = DRIVER
    actors._index_nodes = {0: WORKER}
    actors._names = {COORDINATOR: "probe.coordinator", ("s", 0): "probe.s.writer-0"}
    return actors


def test_a_loss_seen_by_the_call_check_is_not_hidden_by_an_earlier_probe(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A probe's answer is kept for ``ping_timeout`` (the waits ask it often). A node lost
    just after a probe said all was well, and seen by the call check, must be seen by the
    probe of the heal that follows: else the lost writers are not replaced and the next
    attempts go to them again (the cluster layer's node-loss test failed its epoch three
    times in a row so, CI at 59beb65)."""
    raylet = socket.socket()
    raylet.bind(("127.0.0.1", 0))
    raylet.listen()
    actors = _actors(raylet.getsockname()[1])
    actors.ping_timeout = 60.0  # the earlier probe's answer stays fresh through the test
    writer = ("s", 0)
    pinged: dict[Any, Any] = {}

    def ping(handles: dict[Any, Any], timeout: float) -> tuple[list[Any], list[Any]]:
        pinged.update(handles)
        return [], []  # every actor pinged answers
    monkeypatch.setattr(raystate, "keys_in", lambda hs, states: [])
    monkeypatch.setattr(raystate, "targeted", lambda hs, refs: [writer])
    monkeypatch.setattr(raystate, "state_of", lambda handle: "ALIVE")
    monkeypatch.setattr(ActorSet, "_ping", staticmethod(ping))

    actors.check_responsive()  # every actor answers; the answer is kept
    assert writer in pinged
    raylet.close()  # the worker node is lost
    with pytest.raises(RuntimeUnavailableError, match=r"probe\.s\.writer-0 lost"):
        actors.check_calls(["a call to writer 0"])
    with pytest.raises(RuntimeUnavailableError, match=r"probe\.s\.writer-0 did not answer"):
        actors.check_responsive()
    assert actors._probe() == [writer]  # the heal replaces the lost node's writer only
