"""``rt.rescale(writers=N)`` on a live runtime, on the four-node cluster.

A keyed Delta upsert: every epoch updates the same keys several times, in pieces fed to
different writers (a key's last row wins). The runtime goes 2 -> 4 -> 1 writers between
epochs without closing; new writers go to the nodes holding none first; each layout takes
effect at the next epoch, and every key's rows reach its vnode's writer in each epoch
(otherwise the MERGE would meet a key twice, or an older row would win). A rescale is
refused, changing nothing, while an epoch is being written and while an epoch is open for
producers.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pyarrow as pa
import pytest

from raysink import RescaleRefusedError, SinkRuntime
from raysink.sinks import DeltaSink
from raysink.testing import arm_fault, disarm_faults
from tests.cluster.conftest import Nodes
from tests.integration.helpers import run_in_thread, wait_fired
from tests.integration.real_targets import DeltaTarget

pytestmark = pytest.mark.timeout(180)

KEYS = 300
PIECES = 4


def _updates(epoch: int) -> list[pa.Table]:
    """Every key updated once per piece; the last piece's value wins."""
    return [pa.table({"id": pa.array(range(KEYS), pa.int64()),
                      "value": pa.array([epoch * 100 + piece] * KEYS, pa.int64())})
            for piece in range(PIECES)]


def _writer_nodes(rt: SinkRuntime) -> list[str | None]:
    actors = rt._actors
    assert actors is not None
    return [actors.node_of(("main", k)) for k in range(actors.writer_count)]


def test_rescale_between_epochs_keeps_every_key_with_its_writer(
        nodes: Nodes, tmp_path: Path, name: str) -> None:
    target = DeltaTarget(tmp_path / "delta")
    sink = DeltaSink(str(target.path), mode="upsert", key=["id"])
    with SinkRuntime(name, sink, writers=2, metastore=f"sqlite:///{tmp_path / 'm.db'}",
                     progress=False) as rt:
        assert rt.write_arrow(_updates(1)).committed
        before = _writer_nodes(rt)
        rt.rescale(writers=4)
        after = _writer_nodes(rt)
        assert after[:2] == before  # the writers that stay, stay where they are
        assert len(set(after)) == 4  # one per node (three workers and the head)
        assert rt.write_arrow(_updates(2)).committed
        assert target.values() == dict.fromkeys(range(KEYS), 2 * 100 + PIECES - 1)

        rt.rescale(writers=1)
        assert rt._actors is not None and rt._actors.writer_count == 1
        assert rt.write_arrow(_updates(3)).committed
        assert rt.status().last_committed_epoch == 3
    assert target.values() == dict.fromkeys(range(KEYS), 3 * 100 + PIECES - 1)
    assert Counter(target.commit_epochs(name)) == Counter([1, 2, 3])


def test_rescale_is_refused_while_an_epoch_is_in_flight(nodes: Nodes, tmp_path: Path,
                                                         name: str) -> None:
    target = DeltaTarget(tmp_path / "delta")
    sink = DeltaSink(str(target.path), mode="upsert", key=["id"])
    with SinkRuntime(name, sink, writers=2, metastore=f"sqlite:///{tmp_path / 'm.db'}",
                     progress=False) as rt:
        arm_fault(name, "writer.after_pre_commit", action="sleep", seconds=2,
                  when={"epoch": 1})
        thread, box = run_in_thread(lambda: rt.write_arrow(_updates(1)))
        wait_fired(name, "writer.after_pre_commit")
        with pytest.raises(RescaleRefusedError, match="rescale between epochs") as info:
            rt.rescale(writers=3)
        assert info.value.retry_after > 0
        thread.join(60)
        assert "error" not in box and box["result"].committed
        disarm_faults(name)
        assert rt._actors is not None and rt._actors.writer_count == 2  # nothing changed

        handle = rt.open_epoch()
        with pytest.raises(RescaleRefusedError, match="open for producers"):
            rt.rescale(writers=3)
        handle.abort()
        rt.rescale(writers=3)  # between epochs again: taken
        assert rt.write_arrow(_updates(3)).committed
    assert target.values() == dict.fromkeys(range(KEYS), 3 * 100 + PIECES - 1)
