"""The runtime on a real ``ray.init``: many epochs, reordering, status, the epoch rules.

The cases that write epochs and read them back share one runtime (``shared``: three
writers, two credits), each numbering its epochs after what the runtime committed before
it and checking the table holds what it held before plus exactly its own epochs. Cases
that need other options, a sink that fails, or starts and closes of their own start
their own runtime.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pytest
import ray

from raysink import (
    ConfigError,
    EpochRegressionError,
    RuntimeInUseError,
    SchemaMismatchError,
    SinkRuntime,
)
from raysink.cli import main
from raysink.sinks import ParquetSink
from raysink.testing import FailingSink
from tests.integration.helpers import (
    assert_exactly,
    closes_with_epoch_pending,
    epoch_table,
    read_ids,
    unique_name,
)

pytestmark = pytest.mark.usefixtures("ray_session")


def _runtime(tmp_path: Path, name: str, **options: object) -> SinkRuntime:
    options.setdefault("metastore", f"sqlite:///{tmp_path / 'meta.db'}")
    return SinkRuntime(name, ParquetSink(str(tmp_path / "table")), **options)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def shared(ray_session: None, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[tuple[SinkRuntime, Path]]:
    """A started runtime the module's cases that only write and read back share, with its
    table's path."""
    root = tmp_path_factory.mktemp("runtime")
    with _runtime(root, unique_name("runtime-shared"), writers=3, credits=2) as rt:
        yield rt, root / "table"


def _last(rt: SinkRuntime) -> int:
    """The last epoch the runtime committed (0: none): a case numbers its own after it."""
    return rt.status().last_committed_epoch or 0


def test_many_epochs_through_several_writers_reordered(
        shared: tuple[SinkRuntime, Path], capsys: pytest.CaptureFixture[str]) -> None:
    rt, path = shared
    base, before = _last(rt), read_ids(path)
    rows_before = sum(p.mailbox.rows_total for p in rt.processes() if p.mailbox is not None)
    rt._epochs.shuffle = random.Random(7)  # send writes out of order on purpose
    try:
        for epoch in range(base + 1, base + 9):
            parts = [epoch_table(epoch, 1200).slice(i * 300, 300) for i in range(4)]
            report = rt.write_arrow(parts)
            assert (report.epoch, report.rows, report.committed) == (epoch, 1200, True)
            assert not report.skipped and report.attempts == 1
    finally:
        rt._epochs.shuffle = None
    status = rt.status()
    processes = rt.processes()
    # the same, found by name in the cluster, as `raysink status --processes` shows it
    assert main(["status", rt.name, "--metastore", rt.metastore_url, "--processes",
                 "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)["processes"]
    assert_exactly(path, list(range(base + 1, base + 9)), 1200, before=before)
    assert status.last_committed_epoch == base + 8
    assert status.pending_epochs == []
    assert status.sinks["main"].state == "running"
    assert status.metastore.startswith("sqlite:///")
    assert [(p.role, p.name, p.sink, p.writer) for p in processes] == [
        ("coordinator", f"{rt.name}.coordinator", None, None),
        *[("writer", f"{rt.name}.main.writer-{i}", "main", i) for i in range(3)]]
    assert len({(p.node_id, p.pid) for p in processes if p.answered}) == 4  # one each
    writers = [p.mailbox for p in processes if p.mailbox is not None]
    assert sum(w.rows_total for w in writers) - rows_before == 8 * 1200
    assert [(w.mailbox_depth, w.epochs_here, w.closed) for w in writers] == [(0, (), False)] * 3
    assert [(p["name"], p["pid"]) for p in shown] == [(p.name, p.pid) for p in processes]


def test_object_refs_and_record_batches(shared: tuple[SinkRuntime, Path]) -> None:
    rt, path = shared
    epoch, before = _last(rt) + 1, read_ids(path)
    table = epoch_table(epoch, 900)
    report = rt.write_arrow([ray.put(table.slice(0, 400)), table.slice(400).to_batches()[0]])
    assert report.committed and report.epoch == epoch
    assert_exactly(path, [epoch], 900, before=before)


def test_replayed_epoch_is_skipped(shared: tuple[SinkRuntime, Path]) -> None:
    rt, path = shared
    base, before = _last(rt), read_ids(path)
    rt.write_arrow(epoch_table(base + 1, 100), epoch=base + 1)
    rt.write_arrow(epoch_table(base + 3, 100), epoch=base + 3)  # gaps are allowed
    again = rt.write_arrow(epoch_table(base + 1, 100), epoch=base + 1)
    below = rt.write_arrow(epoch_table(base + 2, 100), epoch=base + 2)
    nxt = rt.write_arrow(epoch_table(base + 4, 100))
    assert again.skipped and again.skipped_sinks == ("main",) and again.rows == 0
    assert below.skipped
    assert nxt.epoch == base + 4 and nxt.committed
    assert_exactly(path, [base + 1, base + 3, base + 4], 100, before=before)


def test_keyed_rows_land_on_one_writer_each(tmp_path: Path) -> None:
    with _runtime(tmp_path, "keyed", writers=3, key=["customer"]) as rt:
        rt.write_arrow(epoch_table(1, 3000))
    import pyarrow.dataset as ds

    data = ds.dataset(str(tmp_path / "table"), format="parquet")
    owners: dict[str, set[str]] = {}
    for fragment in data.get_fragments():
        writer = Path(fragment.path).name.split("-w")[1][:4]
        for customer in fragment.to_table(columns=["customer"]).column(0).to_pylist():
            owners.setdefault(customer, set()).add(writer)
    assert owners and all(len(w) == 1 for w in owners.values())
    assert_exactly(tmp_path / "table", [1], 3000)


def test_empty_epoch_commits_zero_rows(shared: tuple[SinkRuntime, Path]) -> None:
    rt, path = shared
    base, before = _last(rt), read_ids(path)
    rt.write_arrow(epoch_table(base + 1, 50))
    report = rt.write_arrow(epoch_table(base + 2, 0))
    none = rt.write_arrow([])
    assert report.committed and report.rows == 0 and report.epoch == base + 2
    assert none.committed and none.epoch == base + 3
    assert_exactly(path, [base + 1], 50, before=before)


def test_schema_differing_within_an_epoch_writes_nothing(
        shared: tuple[SinkRuntime, Path]) -> None:
    rt, path = shared
    base, before = _last(rt), read_ids(path)
    other = epoch_table(base + 2, 10).append_column("extra", pa.array(range(10)))
    rt.write_arrow(epoch_table(base + 1, 100))
    with pytest.raises(SchemaMismatchError):
        rt.write_arrow([epoch_table(base + 2, 10), other])
    # the same mistake hidden behind object refs is caught by the writers (or by the
    # coordinator, comparing their schemas); whichever writer's barrier fails first,
    # the driver sees the bad data, never a retry of it (this raced once)
    good = ray.put(epoch_table(base + 2, 10))
    for refs in [[good, ray.put(other)], [ray.put(other), good]] * 3:
        with pytest.raises(SchemaMismatchError):
            rt.write_arrow(refs, epoch=base + 2)
    rt.write_arrow(epoch_table(base + 2, 100), epoch=base + 2)
    assert_exactly(path, [base + 1, base + 2], 100, before=before)


def test_epoch_regression_below_a_pending_epoch(tmp_path: Path) -> None:
    sink = FailingSink(ParquetSink(str(tmp_path / "table")), fail_commit_times=1000,
                       state_dir=str(tmp_path / "faults"))
    rt = SinkRuntime("regress", sink, writers=1, metastore=f"sqlite:///{tmp_path / 'meta.db'}",
                     commit_timeout=1.0, retry_cap=0.2)
    with closes_with_epoch_pending(), rt:
        report = rt.write_arrow(epoch_table(5, 10), epoch=5)
        assert not report.committed  # decided, rolling forward while the sink stalls
        status = rt.status()
        assert status.pending_epochs == [5]
        assert status.sinks["main"].state == "stalled"
        assert "InjectedSinkFailure" in (status.sinks["main"].last_error or "")
        with pytest.raises(EpochRegressionError):
            rt.write_arrow(epoch_table(3, 10), epoch=3)
    assert read_ids(tmp_path / "table") == []


def test_runtime_in_use_elsewhere(tmp_path: Path) -> None:
    with _runtime(tmp_path, "inuse", writers=1), pytest.raises(RuntimeInUseError):
        _runtime(tmp_path, "inuse", writers=1).start()
    # closing frees the names: reopening is allowed
    with _runtime(tmp_path, "inuse", writers=1) as rt:
        assert rt.write_arrow(epoch_table(1, 5)).committed


def test_changed_sink_set_refused_then_added_while_an_epoch_is_pending_then_dropped(
        tmp_path: Path, name: str) -> None:
    """Epoch 2 is decided but its commit keeps failing (the runtime closes with it
    pending). Reopened with sink 'b' but without ``add_sinks``: a ``ConfigError``. With
    ``add_sinks=["b"]``: epoch 2 was decided without 'b', so it rolls forward into 'main'
    alone, and epoch 3 reaches both. (Before, 'b''s commit worker looked for its record of
    epoch 2, found none, and retried forever: every later epoch stayed invisible and
    backpressure failed the writes.) Reopened without 'b' and ``drop_sinks=["b"]``: 'b'
    shows as dropped and 'main' carries on."""
    from raysink.testing import arm_fault, disarm_faults

    meta = f"sqlite:///{tmp_path / 'meta.db'}"
    main = ParquetSink(str(tmp_path / "a"))
    # one writer per sink: the sink set and its epochs are the coordinator's
    with closes_with_epoch_pending(), SinkRuntime(
            name, main, writers=1, metastore=meta, commit_timeout=3, retry_cap=0.2,
            progress=False) as rt:
        assert rt.write_arrow(epoch_table(1, 5)).committed
        arm_fault(name, "sink.mid_commit", action="raise", times=10_000, when={"epoch": 2})
        assert not rt.write_arrow(epoch_table(2, 5)).committed  # decided, not visible
    disarm_faults(name)
    two = {"main": main, "b": ParquetSink(str(tmp_path / "b"))}
    with pytest.raises(ConfigError):
        SinkRuntime(name, two, writers=1, metastore=meta).start()
    with SinkRuntime(name, two, writers=1, metastore=meta, add_sinks=["b"], commit_timeout=30,
                     progress=False) as rt:
        report = rt.write_arrow(epoch_table(3, 5))
        assert (report.epoch, report.committed) == (3, True)
        assert rt.status().pending_epochs == []
    with SinkRuntime(name, ParquetSink(str(tmp_path / "a")), writers=1, metastore=meta,
                     drop_sinks=["b"], progress=False) as rt:
        assert rt.write_arrow(epoch_table(4, 5)).epoch == 4
        assert rt.status().sinks["b"].state == "dropped"
    assert_exactly(tmp_path / "a", [1, 2, 3, 4], 5)
    assert_exactly(tmp_path / "b", [3], 5)


@pytest.mark.parametrize(
    ("options", "fragment"),
    [
        ({"writers": 0}, "writers"),  # no writer at all
        ({"credits": 0}, "credits"),  # no write could ever be sent
        ({"commit_timeout": -1}, "commit_timeout"),
        ({"max_pending_epochs": 0}, "max_pending_epochs"),
        ({"max_buffer_bytes": 0}, "max_buffer_bytes"),  # a reorder buffer that holds nothing
        ({"warn_interval": 0}, "warn_interval"),
        ({"epoch_offset": -1}, "epoch_offset"),  # epochs are non-negative
        ({"lease_timeout": 0}, "lease_timeout"),  # a lease that expires as it is taken
    ],
)
def test_invalid_options(tmp_path: Path, options: dict[str, object], fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        _runtime(tmp_path, "bad", **options)
