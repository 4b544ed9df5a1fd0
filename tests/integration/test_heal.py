"""``heal`` on one node: a dead actor is replaced by a new incarnation; one that is only
slow to answer a ping, on a node whose raylet answers, is left alone (a busy or
restarting actor: replacing it would fail an epoch its producers cannot feed again)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import ray

from raysink import SinkRuntime
from tests.integration.helpers import epoch_table
from tests.integration.real_targets import ParquetTarget, assert_ids_exact

pytestmark = pytest.mark.usefixtures("ray_session")

ROWS = 100


@ray.remote(num_cpus=0)
class _Slow:
    """Stands for a writer too busy to answer a ping in time."""

    def ping(self) -> int:
        time.sleep(3.0)
        return 0


def test_a_slow_actor_is_left_alone_and_a_dead_one_replaced(tmp_path: Path,
                                                            name: str) -> None:
    target = ParquetTarget(tmp_path / "table")
    with SinkRuntime(name, target.sink(), writers=2, progress=False, ping_timeout=0.5,
                     metastore=f"sqlite:///{tmp_path / 'meta.db'}") as rt:
        assert rt.write_arrow(epoch_table(1, ROWS)).committed
        actors = rt._actors
        assert actors is not None
        writers = actors.writers["main"]
        busy, writers[0] = writers[0], _Slow.remote()
        try:
            actors.check_responsive()  # no RuntimeUnavailableError: slow is not lost
            assert actors.heal(timeout=10) == []
        finally:
            writers[0] = busy
        ray.kill(writers[1], no_restart=True)
        time.sleep(0.6)  # a probe's result is reused for ping_timeout seconds
        with pytest.raises(Exception, match="did not answer a ping"):
            actors.check_responsive()
        replaced = actors.heal(timeout=30)
        assert len(replaced) == 1 and replaced[0].startswith(f"{name}.main.writer-1")
        assert rt.write_arrow(epoch_table(2, ROWS)).committed
    assert_ids_exact(target.ids(), [1, 2], ROWS)
