"""Delta compaction by size tier, committed by raysink (``raysink.sinks.delta._compact``):
a compacted file is not rewritten until its own tier is due; the commit is a compare-and-
swap, so a change to the table between plan and commit never doubles or loses a row; a
pass killed between writing and committing leaves files the next pass deletes."""

from __future__ import annotations

import time
import urllib.parse
from datetime import date
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

deltalake = pytest.importorskip("deltalake")

from raysink import Maintenance  # noqa: E402
from raysink.sinks._maintenance import MaintenanceWindow  # noqa: E402
from raysink.sinks.delta import DeltaSink, _compact  # noqa: E402
from tests.support.staging import stage_writers as stage  # noqa: E402

POLICY = Maintenance(min_compact_files=4, keep_snapshots=10_000, keep_seconds=3600,
                     checkpoint_every=1000)


def sink_at(path: Path, policy: Maintenance = POLICY, **options: Any) -> DeltaSink:
    return DeltaSink(str(path), maintenance=policy, **options).bind("rt", "main")


def rows(epoch: int, n: int = 200) -> pa.RecordBatch:
    """Ids, a day, and 64 random bytes a row: files grow with their rows whatever the
    Parquet writer's encodings (sequential ids alone compress so well that four epochs'
    file can stay in the tier of one, as with pyarrow 17)."""
    base = epoch * 1000
    pad = np.random.default_rng(epoch).bytes(64 * n)
    return pa.record_batch({"id": pa.array(range(base, base + n), pa.int64()),
                            "day": pa.array([f"d{epoch % 2}"] * n),
                            "pad": pa.array([pad[i * 64:(i + 1) * 64] for i in range(n)],
                                            pa.binary())})


def commit_epochs(sink: DeltaSink, epochs: range) -> None:
    for epoch in epochs:
        sink.commit(epoch, stage(sink, epoch, [[rows(epoch)]]))


def ids(path: Path) -> list[int]:
    return sorted(deltalake.DeltaTable(str(path)).to_pyarrow_table().column("id").to_pylist())


def expected(epochs: range) -> list[int]:
    return sorted(i for e in epochs for i in rows(e).column("id").to_pylist())


def window(sink: DeltaSink, force: bool = False) -> MaintenanceWindow:
    return MaintenanceWindow(deadline=time.monotonic() + 30,
                             committed_epoch=sink.committed_epoch(), force=force)


def live(path: Path) -> dict[str, int]:
    adds = pa.table(deltalake.DeltaTable(str(path)).get_add_actions(flatten=True)).to_pydict()
    return {urllib.parse.unquote(p): s for p, s in zip(adds["path"], adds["size_bytes"],
                                                       strict=True)}


def test_a_compacted_file_waits_for_its_own_tier(tmp_path: Path) -> None:
    path = tmp_path / "t"
    sink = sink_at(path)
    commit_epochs(sink, range(1, 5))
    first = sink.maintain(window(sink))
    assert (first.files_compacted, first.files_written) == (4, 1)
    (compacted,) = live(path)

    commit_epochs(sink, range(5, 9))  # four more epoch files: their tier is due again
    second = sink.maintain(window(sink))

    assert (second.files_compacted, second.files_written) == (4, 1)
    assert compacted in live(path)  # not rewritten: one file of a higher tier
    assert second.bytes_rewritten < 2 * first.bytes_rewritten
    assert ids(path) == expected(range(1, 9)) and sink.committed_epoch() == 8

    forced = sink.maintain(window(sink, force=True))  # rt.maintain(): every small file
    assert forced.files_compacted == 2 and len(live(path)) == 1
    assert ids(path) == expected(range(1, 9))


def test_partition_values_are_kept_as_the_log_holds_them(tmp_path: Path) -> None:
    path = tmp_path / "t"
    sink = sink_at(path, partition_by=["day"])
    commit_epochs(sink, range(1, 9))
    report = sink.maintain(window(sink))
    assert (report.files_compacted, report.files_written) == (8, 2)
    table = deltalake.DeltaTable(str(path))
    assert sorted(p["day"] for p in table.partitions()) == ["d0", "d1"]
    day0 = table.to_pyarrow_table(filters=[("day", "=", "d0")]).column("id").to_pylist()
    assert sorted(day0) == expected(range(2, 9, 2))
    assert ids(path) == expected(range(1, 9))


def _meanwhile(monkeypatch: pytest.MonkeyPatch, action: Any) -> None:
    """Run ``action`` once, after the compacted files are written and before the commit."""
    def at(point: str, **context: Any) -> None:
        if point == "maintenance.mid_compaction":
            monkeypatch.setattr(_compact, "hit", lambda *a, **k: None)
            action()
    monkeypatch.setattr(_compact, "hit", at)


def test_an_outside_optimize_meanwhile_makes_the_pass_give_up_not_double_rows(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """delta-rs checks no conflict for an append's removes: without the compare-and-swap
    this commit went in after the outside OPTIMIZE and every row was there twice."""
    path = tmp_path / "t"
    sink = sink_at(path)
    commit_epochs(sink, range(1, 5))
    _meanwhile(monkeypatch, lambda: deltalake.DeltaTable(str(path)).optimize.compact())

    report = sink.maintain(window(sink))

    assert report.files_compacted == 0 and not report.complete
    assert ids(path) == expected(range(1, 5))
    assert list(path.glob("_raysink/compact/*")) == []  # its written file and journal gone
    assert sink.maintain(window(sink)).complete


def test_an_append_meanwhile_is_committed_over(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "t"
    sink = sink_at(path)
    commit_epochs(sink, range(1, 5))
    _meanwhile(monkeypatch, lambda: commit_epochs(sink, range(5, 6)))

    report = sink.maintain(window(sink))

    assert (report.files_compacted, report.complete) == (4, True)
    assert ids(path) == expected(range(1, 6)) and sink.committed_epoch() == 5
    assert len(live(path)) == 2 and list(path.glob("_raysink/compact/*.json")) == []


def test_a_journal_of_a_committed_pass_keeps_its_files(tmp_path: Path) -> None:
    """Killed between the commit and the journal's deletion: the next pass keeps the
    committed file and drops the journal."""
    path = tmp_path / "t"
    sink = sink_at(path)
    commit_epochs(sink, range(1, 5))
    sink.maintain(window(sink))
    (compacted,) = live(path)
    version = deltalake.DeltaTable(str(path)).version()
    pass_id = compacted.rsplit("/", 1)[1].split("-")[0]
    journal = path / f"_raysink/compact/{pass_id}.json"
    journal.write_text(f'{{"pass": "{pass_id}", "version": {version - 1}, '
                       f'"outputs": ["{compacted}"]}}')

    sink.maintain(window(sink))

    assert not journal.exists() and (path / compacted).exists()
    assert ids(path) == expected(range(1, 5))


def test_files_from_before_a_schema_change_are_read_as_the_table_is_now(
        tmp_path: Path) -> None:
    path = tmp_path / "t"
    sink = sink_at(path, schema_evolution="add_columns")
    commit_epochs(sink, range(1, 3))
    wider = rows(3).append_column("note", pa.array(["n"] * 200))
    sink.commit(3, stage(sink, 3, [[wider]]))

    report = sink.maintain(window(sink, force=True))

    assert report.files_compacted == 3 and len(live(path)) == 1
    table = deltalake.DeltaTable(str(path)).to_pyarrow_table()
    notes = dict(zip(table.column("id").to_pylist(), table.column("note").to_pylist(),
                     strict=True))
    assert ids(path) == expected(range(1, 4))
    assert {notes[i] for i in expected(range(1, 3))} == {None}
    assert {notes[i] for i in expected(range(3, 4))} == {"n"}


def test_typed_and_null_partitions_keep_their_values(tmp_path: Path) -> None:
    path = tmp_path / "t"
    sink = sink_at(path, partition_by=["k", "day"])
    for epoch in range(1, 5):
        batch = pa.record_batch({
            "id": pa.array(range(epoch * 10, epoch * 10 + 4), pa.int64()),
            "k": pa.array([1, None, 1, None], pa.int32()),
            "day": pa.array([date(2024, 1, 2)] * 4, pa.date32())})
        sink.commit(epoch, stage(sink, epoch, [[batch]]))
    before = sorted(map(str, deltalake.DeltaTable(str(path)).partitions()))

    report = sink.maintain(window(sink))

    assert (report.files_compacted, report.files_written) == (8, 2)
    table = deltalake.DeltaTable(str(path))
    assert sorted(map(str, table.partitions())) == before
    got = table.to_pyarrow_table().to_pylist()
    assert sorted((r["id"], r["k"], r["day"]) for r in got) == sorted(
        (e * 10 + i, [1, None][i % 2], date(2024, 1, 2)) for e in range(1, 5) for i in range(4))
