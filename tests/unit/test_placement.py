"""Placement without Ray: which node each writer index and the coordinator get.

A ``ClusterView`` over fixed node rows (as ``ray.nodes()`` lists them) and a private book
of suspects; ``ActorSet._choose_node`` is exercised through the view's ``choose`` with
the load the actor set keeps (writer indexes per node).
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

import pytest

from raysink import ConfigError, Placement, SinkRuntime
from raysink.driver.placement import ClusterView, coordinator_node
from raysink.testing import ListSink

DRIVER = "n0-driver"


def _rows(*nodes: tuple[str, dict[str, str], dict[str, float]]) -> list[dict[str, Any]]:
    return [{"NodeID": node, "Alive": True, "Labels": labels, "Resources": resources}
            for node, labels, resources in nodes]


def _view(count: int = 4, **extra: Any) -> ClusterView:
    rows = _rows((DRIVER, {}, {"CPU": 2.0}),
                 *[(f"n{i}", {"pool": "sink" if i % 2 else "other"}, {"CPU": 2.0,
                                                                     "slot": float(i % 2)})
                   for i in range(1, count)])
    return ClusterView(driver_node=DRIVER, nodes=rows, suspects={}, **extra)


def _spread(view: ClusterView, writers: int, placement: Placement | None = None
            ) -> dict[int, str]:
    """Writer index -> node, as ``ActorSet`` chooses them one index after another."""
    placement = placement or Placement()
    chosen: dict[int, str] = {}
    for index in range(writers):
        load = Counter(chosen.values())
        chosen[index] = view.choose(load, placement.labels, placement.resources)
    return chosen


def test_one_writer_per_node_before_a_second_and_the_driver_last() -> None:
    view = _view(4)
    three = _spread(view, 3)
    assert sorted(three.values()) == ["n1", "n2", "n3"]  # the driver's node is the last
    four = _spread(view, 4)
    assert sorted(four.values()) == [DRIVER, "n1", "n2", "n3"]
    counts = Counter(_spread(view, 9).values())
    assert max(counts.values()) - min(counts.values()) <= 1


def test_labels_and_resources_narrow_the_nodes() -> None:
    view = _view(5)
    by_label = _spread(view, 4, Placement(labels={"pool": "sink"}))
    assert set(by_label.values()) == {"n1", "n3"}
    by_resource = _spread(view, 2, Placement(resources={"slot": 1}))
    assert set(by_resource.values()) == {"n1", "n3"}


def test_no_matching_node_says_which_exist() -> None:
    with pytest.raises(ConfigError, match=r"no alive node .* matches the placement"):
        _spread(_view(3), 1, Placement(labels={"pool": "gpu"}))


def test_suspect_nodes_are_left_out_while_others_match() -> None:
    view = _view(4)
    view.suspect("n1")
    assert "n1" not in _spread(view, 3).values()
    assert _spread(view, 1, Placement(labels={"pool": "sink"}))[0] == "n3"
    # when only suspects match, one is used (better than refusing to start)
    view.suspect("n3")
    assert _spread(view, 1, Placement(labels={"pool": "sink"}))[0] in {"n1", "n3"}


def test_a_dead_node_is_never_chosen() -> None:
    rows = _rows((DRIVER, {}, {}), ("n1", {}, {}))
    rows.append({"NodeID": "n2", "Alive": False, "Labels": {}, "Resources": {}})
    view = ClusterView(driver_node=DRIVER, nodes=rows, suspects={})
    assert "n2" not in _spread(view, 4).values()


def test_a_raylet_that_does_not_answer_makes_its_node_suspect() -> None:
    """A node Ray still lists alive whose raylet port refuses connections (port 1 on
    localhost: nothing listens there) is left out and suspected."""
    rows = _rows((DRIVER, {}, {}), ("n1", {}, {}))
    rows.append({"NodeID": "n-gone", "Alive": True, "Labels": {}, "Resources": {},
                 "NodeManagerAddress": "127.0.0.1", "NodeManagerPort": 1})
    view = ClusterView(driver_node=DRIVER, nodes=rows, suspects={})
    assert "n-gone" not in {n.node_id for n in view.alive()}
    assert view.is_suspect("n-gone")


def test_lost_nodes() -> None:
    """A node Ray lists dead or not at all, or whose raylet refuses a connection, is lost
    (and suspect); a live one is not."""
    rows = _rows((DRIVER, {}, {}), ("n1", {}, {}))
    rows += [{"NodeID": "n-dead", "Alive": False, "Labels": {}, "Resources": {}},
             {"NodeID": "n-cut", "Alive": True, "Labels": {}, "Resources": {},
              "NodeManagerAddress": "127.0.0.1", "NodeManagerPort": 1}]
    view = ClusterView(driver_node=DRIVER, nodes=rows, suspects={})
    assert not view.lost("n1") and not view.is_suspect("n1")
    for node in ("n-dead", "n-cut", "n-unknown"):
        assert view.lost(node) and view.is_suspect(node)


def test_refusing_raylets() -> None:
    """Only a raylet port that refuses a connection counts (the quick check while the
    driver waits): a node Ray lists without an address (as in these rows) never does, nor
    a node it does not list."""
    import socket

    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        rows = _rows((DRIVER, {}, {}), ("n1", {}, {}))
        rows += [{"NodeID": "n-cut", "Alive": True, "Labels": {}, "Resources": {},
                  "NodeManagerAddress": "127.0.0.1", "NodeManagerPort": 1},
                 {"NodeID": "n-up", "Alive": True, "Labels": {}, "Resources": {},
                  "NodeManagerAddress": "127.0.0.1",
                  "NodeManagerPort": listening.getsockname()[1]}]
        view = ClusterView(driver_node=DRIVER, nodes=rows, suspects={})
        assert view.refuses("n-cut") and view.is_suspect("n-cut")
        for node in ("n1", "n-up", "n-unknown"):
            assert not view.refuses(node) and not view.is_suspect(node)


# the coordinator's node: (meta store, nodes in the cluster, placement) -> (node, hard)
COORDINATOR_CASES = [
    # SQLite on one node: the driver's node, soft (nothing else to go to)
    ("sqlite:////tmp/m.db", 1, Placement(), (DRIVER, False)),
    # SQLite on a cluster: pinned hard to the driver's node, where its file is
    ("sqlite:////tmp/m.db", 4, Placement(), (DRIVER, True)),
    # PostgreSQL on a cluster: the driver's node, soft (it may move)
    ("postgresql://u@h/db", 4, Placement(), (DRIVER, False)),
    # PostgreSQL, labels: the matching node, hard
    ("postgresql://u@h/db", 4, Placement(coordinator={"pool": "sink"}), ("n1", True)),
]


@pytest.mark.parametrize(("metastore", "count", "placement", "expected"), COORDINATOR_CASES)
def test_coordinator_node(metastore: str, count: int, placement: Placement,
                          expected: tuple[str, bool]) -> None:
    assert coordinator_node(_view(count), placement, metastore, "rt") == expected


def test_sqlite_on_a_cluster_warns_to_use_postgres(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="raysink"):
        coordinator_node(_view(3), Placement(), "sqlite:////tmp/m.db", "rt")
    assert "PostgreSQL meta store" in caplog.text and "pinned" in caplog.text


def test_coordinator_labels_with_sqlite_on_a_cluster_are_refused() -> None:
    with pytest.raises(ConfigError, match="use a PostgreSQL meta store"):
        coordinator_node(_view(3), Placement(coordinator={"pool": "sink"}),
                         "sqlite:////tmp/m.db", "rt")


# Placement(...) arguments that are refused, each with a piece of the message
BAD_PLACEMENTS = [
    ({"labels": {"pool": 1}}, "labels map names to values"),
    ({"resources": {"slot": 0}}, "positive amounts"),
    ({"resources": {"slot": "one"}}, "positive amounts"),
    ({"coordinator": "anywhere"}, "'driver' or a mapping"),
    ({"coordinator": {}}, "labels are empty"),
]


@pytest.mark.parametrize(("kwargs", "message"), BAD_PLACEMENTS)
def test_bad_placement_is_a_config_error(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        Placement(**kwargs)


def test_runtime_options_for_placement_and_rescale_are_checked(tmp_path: Any) -> None:
    with pytest.raises(ConfigError, match=r"placement must be a raysink\.Placement"):
        SinkRuntime("p", ListSink(tmp_path), placement={"labels": {}})  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="ping_timeout must be > 0"):
        SinkRuntime("p", ListSink(tmp_path), ping_timeout=0)
    rt = SinkRuntime("p", ListSink(tmp_path))
    for bad in (0, -1, 2.5):
        with pytest.raises(ConfigError, match="writers must be at least 1"):
            rt.rescale(writers=bad)  # type: ignore[arg-type]
