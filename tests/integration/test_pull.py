"""Pulls (``raysink.protocol.pull``): data messages whose data the writer fetches itself.

The Spark handoff sends ``ExecutorPartition`` pulls; here a small pull of an Arrow table
held in a file stands in for it (pyspark-free), so the runtime's side of the contract is
proven on its own: exact contents, a failing pull retried as a new attempt, and keyed
routing that puts a key on the same writer whether its rows came by pull or by
``write_arrow``. The unkeyed cases share one runtime, each numbering its epochs after the
last one the runtime committed and checking its own rows over what the table held.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.ipc
import pytest

from raysink import SinkRuntime
from raysink.errors import SinkUnavailableError
from raysink.protocol.pull import Pull, resolve
from raysink.sinks import ParquetSink
from tests.integration.helpers import (
    assert_exactly,
    epoch_table,
    read_ids,
    unique_name,
    writer_owners,
)

pytestmark = pytest.mark.usefixtures("ray_session")


class FilePull(Pull):
    """A table in an Arrow IPC file; with ``fail_once``, the first pull (by anyone) fails,
    as a pull from an executor that went away does."""

    __slots__ = ("fail_once", "path")

    def __init__(self, path: Path, fail_once: Path | None = None) -> None:
        self.path = str(path)
        self.fail_once = None if fail_once is None else str(fail_once)

    def pull(self) -> pa.Table:
        if self.fail_once is not None:
            try:
                Path(self.fail_once).unlink()
            except FileNotFoundError:
                pass
            else:
                raise SinkUnavailableError(f"the source of {self.path} is gone (injected)")
        with pa.memory_map(self.path) as source:
            return pyarrow.ipc.open_file(source).read_all()


def _pulls(tmp_path: Path, table: pa.Table, pieces: int,
           fail_once: Path | None = None) -> list[Pull]:
    size = -(-table.num_rows // pieces)
    tmp_path.mkdir(parents=True, exist_ok=True)
    pulls: list[Pull] = []
    for index in range(pieces):
        path = tmp_path / f"piece-{index}.arrow"
        piece = table.slice(index * size, size)
        with pa.OSFile(str(path), "wb") as sink, pyarrow.ipc.new_file(sink, piece.schema) as w:
            w.write_table(piece)
        pulls.append(FilePull(path, fail_once if index == pieces - 1 else None))
    return pulls


def _runtime(tmp_path: Path, name: str, **options: Any) -> SinkRuntime:
    return SinkRuntime(name, ParquetSink(str(tmp_path / "table")), progress=False,
                       metastore=f"sqlite:///{tmp_path / 'meta.db'}", **options)


@pytest.fixture(scope="module")
def shared(ray_session: None, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[tuple[SinkRuntime, Path]]:
    """A started runtime (two writers) the unkeyed cases share, with its table's path."""
    root = tmp_path_factory.mktemp("pull")
    with _runtime(root, unique_name("pull-shared"), writers=2) as rt:
        yield rt, root / "table"


def _next(rt: SinkRuntime) -> int:
    return (rt.status().last_committed_epoch or 0) + 1


def test_resolve_passes_tables_through_and_pulls_pulls(tmp_path: Path) -> None:
    table = epoch_table(1, 10)
    [pull] = _pulls(tmp_path, table, 1)
    assert resolve(table) is table
    assert resolve(pull).equals(table)


def test_pulled_epochs_hold_exactly_their_rows(tmp_path: Path,
                                               shared: tuple[SinkRuntime, Path]) -> None:
    rt, path = shared
    first, before = _next(rt), read_ids(path)
    for epoch in (first, first + 1):
        pulls = _pulls(tmp_path / f"e{epoch}", epoch_table(epoch, 5000), 5)
        report = rt._write_refs(pulls, None)
        assert (report.epoch, report.rows, report.committed) == (epoch, 5000, True)
        assert report.attempts == 1
    assert_exactly(path, [first, first + 1], 5000, before=before)


def test_a_failing_pull_fails_the_attempt_and_the_retry_is_exact(
        tmp_path: Path, shared: tuple[SinkRuntime, Path]) -> None:
    rt, path = shared
    epoch, before = _next(rt), read_ids(path)
    flag = tmp_path / "fail-once"
    flag.touch()
    report = rt._write_refs(_pulls(tmp_path / "e1", epoch_table(epoch, 4000), 4, flag), None)
    assert not flag.exists()  # the failure happened
    assert report.committed and report.attempts == 2 and report.rows == 4000
    assert report.epoch == epoch
    assert_exactly(path, [epoch], 4000, before=before)


def test_keyed_pulls_route_like_write_arrow(tmp_path: Path) -> None:
    flag = tmp_path / "fail-once"
    flag.touch()
    with _runtime(tmp_path, "pull-keyed", writers=3, key=["customer"]) as rt:
        # one pull fails once inside its split task, which tries it again
        pulled = rt._write_refs(_pulls(tmp_path / "e1", epoch_table(1, 3000), 4, flag), None)
        local = rt.write_arrow(epoch_table(2, 3000))  # the same 37 customers
    assert not flag.exists()
    assert pulled.committed and local.committed
    owners = writer_owners(tmp_path / "table")
    assert len(owners) == 37
    assert all(len(w) == 1 for w in owners.values()), owners  # by pull or not, one writer
    assert len(set().union(*owners.values())) == 3
    assert_exactly(tmp_path / "table", [1, 2], 3000)
    data = ds.dataset(str(tmp_path / "table"), format="parquet")
    counts = Counter(data.to_table(columns=["customer"]).column(0).to_pylist())
    assert sum(counts.values()) == 6000
