"""Table maintenance through the coordinator, on real Ray and a real Delta table: passes
run by themselves between commits and when asked (``rt.maintain()``), show in
``status()``, and the coordinator SIGKILLed at each maintenance crash point loses and
doubles nothing; a fresh meta store then aligns with the compacted, cleaned table.

One runtime serves the cases in turn (each starts from what the one before left, as a
long stream's table does)."""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

deltalake = pytest.importorskip("deltalake")

from raysink import Maintenance, SinkRuntime  # noqa: E402
from raysink.cli import main  # noqa: E402
from raysink.errors import ConfigError  # noqa: E402
from raysink.sinks import ParquetSink  # noqa: E402
from raysink.sinks.delta import DeltaSink  # noqa: E402
from raysink.testing import arm_fault, disarm_faults, fired  # noqa: E402
from tests.integration.helpers import (  # noqa: E402
    actor_pid,
    assert_exactly,
    epoch_table,
    unique_name,
)
from tests.unit.test_delta_maintenance import leaked  # noqa: E402

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.timeout(240)]

ROWS = 100
POLICY = Maintenance(every_epochs=3, min_interval_s=0, min_compact_files=4, keep_snapshots=2,
                     keep_seconds=0, checkpoint_every=2)


def _sinks(root: Path) -> dict[str, object]:
    """``delta`` maintains itself; ``cold`` only when asked by name (the crash cases: what
    each pass finds to do is then known); ``plain`` is a directory."""
    return {"delta": DeltaSink(str(root / "delta"), maintenance=POLICY),
            "cold": DeltaSink(str(root / "cold"), maintenance=POLICY.replace(enabled=False)),
            "plain": ParquetSink(str(root / "plain"))}


def _runtime(name: str, root: Path, meta: str) -> SinkRuntime:
    return SinkRuntime(name, _sinks(root), writers=1, metastore=meta,  # type: ignore[arg-type]
                       progress=False, retry_cap=0.5, commit_timeout=60)


def assert_delta_exactly(path: Path, epochs: list[int]) -> None:
    ids = deltalake.DeltaTable(str(path)).to_pyarrow_table(columns=["id"]).column("id")
    expected = Counter(e * 1_000_000 + i for e in epochs for i in range(ROWS))
    assert Counter(ids.to_pylist()) == expected


def marker(rt: SinkRuntime, root: Path, sink: str = "delta") -> int | None:
    table = deltalake.DeltaTable(str(root / sink))
    return table.transaction_version(f"raysink:{rt.name}:{sink}")


def _write(rt: SinkRuntime, count: int) -> None:
    first = (rt.status().last_committed_epoch or 0) + 1
    for epoch in range(first, first + count):
        report = rt.write_arrow(epoch_table(epoch, ROWS))
        assert (report.epoch, report.committed) == (epoch, True)


def _passes(rt: SinkRuntime) -> int:
    totals = rt.status().sinks["delta"].maintenance
    return 0 if totals is None else totals.passes


@pytest.fixture(scope="module")
def shared(ray_session: None, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[tuple[SinkRuntime, Path]]:
    root = tmp_path_factory.mktemp("maintenance")
    with _runtime(unique_name("maint"), root, f"sqlite:///{root / 'meta.db'}") as rt:
        yield rt, root
        disarm_faults(rt.name)


def test_passes_run_between_commits_and_when_asked(shared: tuple[SinkRuntime, Path]) -> None:
    rt, root = shared
    _write(rt, 7)
    deadline = time.monotonic() + 60
    while _passes(rt) == 0:
        assert time.monotonic() < deadline, "no maintenance pass ran by itself"
        time.sleep(0.2)
    assert rt.status().sinks["plain"].maintenance is None  # a directory is not maintained

    reports = rt.maintain()
    assert [r.sink for r in reports] == ["delta"] and reports[0].complete
    status = rt.status().sinks["delta"]
    assert status.table is not None and status.table.data_files == 1
    versions = deltalake.DeltaTable(str(root / "delta")).version() + 1
    assert status.table.snapshots < versions  # the log was cleaned
    assert status.maintenance is not None and status.maintenance.last_pass_at is not None
    assert_delta_exactly(root / "delta", list(range(1, 8)))
    assert marker(rt, root) == 7
    with pytest.raises(ConfigError, match="no such sink"):
        rt.maintain(sink="nope")


@pytest.mark.parametrize("point", [
    "maintenance.mid_compaction",  # the compaction committed, nothing after it
    "maintenance.mid_expiry",  # removed files deleted, their log entries not
    "maintenance.mid_cleanup",  # the oldest expired log entry deleted, the rest not
])
def test_the_coordinator_killed_in_a_pass(shared: tuple[SinkRuntime, Path], point: str) -> None:
    rt, root = shared
    rt.maintain(sink="cold")  # a checkpoint: the log below it expires in the next pass
    _write(rt, 5)
    before = actor_pid(rt)
    arm_fault(rt.name, point, action="kill", when={"sink": "cold"})
    try:
        rt.maintain(sink="cold")  # re-sent to the restarted coordinator: it finishes
        assert fired(rt.name, point), f"{point} never fired"
    finally:
        disarm_faults(rt.name)
    assert actor_pid(rt) != before
    _write(rt, 1)
    last = rt.status().last_committed_epoch
    assert last is not None
    for sink in ("delta", "cold"):
        assert_delta_exactly(root / sink, list(range(1, last + 1)))
        assert marker(rt, root, sink) == last
    rt.maintain(sink="cold")
    assert leaked(root / "cold") == []  # what the killed pass left, the next one deleted
    assert_exactly(root / "plain", list(range(1, last + 1)), ROWS)


def test_a_fresh_metastore_aligns_with_the_maintained_table(
        shared: tuple[SinkRuntime, Path], tmp_path: Path) -> None:
    """Another runtime's epoch 1000 in the same table; the stream goes on and maintenance
    expires the version whose commit carried that marker; that runtime, reopened over a
    fresh meta store, still finds epoch 1000 in the table (in the checkpoint)."""
    rt, root = shared
    name, table = unique_name("maint-fresh"), root / "delta"
    sinks = {"delta": DeltaSink(str(table), maintenance=False)}
    with SinkRuntime(name, sinks, writers=1, metastore=f"sqlite:///{tmp_path / 'a.db'}",
                     progress=False, retry_cap=0.5) as other:
        assert other.write_arrow(epoch_table(1000, ROWS), epoch=1000).committed
    marked = deltalake.DeltaTable(str(table)).version()
    _write(rt, 3)
    rt.maintain()
    _write(rt, 1)
    rt.maintain()
    assert not (table / "_delta_log" / f"{marked:020d}.json").exists()
    with SinkRuntime(name, sinks, writers=1, metastore=f"sqlite:///{tmp_path / 'b.db'}",
                     progress=False, retry_cap=0.5) as fresh:
        replay = fresh.write_arrow(epoch_table(1000, ROWS), epoch=1000)
        assert replay.skipped
        after = fresh.write_arrow(epoch_table(1001, ROWS), epoch=1001)
        assert after.committed and not after.skipped
    last = rt.status().last_committed_epoch
    assert last is not None
    assert_delta_exactly(table, [*range(1, last + 1), 1000, 1001])


def test_the_cli_maintains_through_the_running_runtime_only(
        shared: tuple[SinkRuntime, Path], capsys: pytest.CaptureFixture[str]) -> None:
    rt = shared[0]
    assert main(["maintain", rt.name, "--sink", "cold", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert [r["sink"] for r in shown] == ["cold"] and shown[0]["complete"]
    assert main(["maintain", unique_name("not-running")]) == 2
    assert "is running in this Ray cluster" in capsys.readouterr().err
