"""The Delta sink leaves a version checksum file (``_delta_log/<v>.crc``) for the newest
version after each commit and maintenance pass, exact for that version, and only that one
(``raysink.sinks.delta._checksum``: it spares a fresh Spark reader two jobs). Real tables,
no Ray; Spark reading such a table is ``tests/spark/test_read_back.py``."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pyarrow as pa
import pytest

deltalake = pytest.importorskip("deltalake")

from raysink.sinks.delta._checksum import checksum  # noqa: E402
from tests.unit.test_delta_maintenance import (  # noqa: E402
    TIGHT,
    commit_epochs,
    content,
    expected,
    sink_at,
    window,
)


def checksums(path: Path) -> dict[int, dict[str, Any]]:
    return {int(p.name.split(".")[0]): json.loads(p.read_text())
            for p in (path / "_delta_log").glob("*.crc")}


def assert_exact(path: Path, crc: dict[str, Any]) -> None:
    """The checksum says what the table at its newest version holds."""
    dt = deltalake.DeltaTable(str(path))
    sizes = pa.table(dt.get_add_actions(flatten=False)).column("size_bytes").to_pylist()
    assert (crc["numFiles"], crc["tableSizeBytes"]) == (len(sizes), sum(sizes))
    assert (crc["numMetadata"], crc["numProtocol"]) == (1, 1)
    meta = crc["metadata"]
    assert meta["id"] == dt.metadata().id
    assert json.loads(meta["schemaString"]) == json.loads(dt.schema().to_json())
    assert meta["partitionColumns"] == dt.metadata().partition_columns
    assert meta["format"] == {"provider": "parquet", "options": {}}
    protocol = dt.protocol()
    assert (crc["protocol"]["minReaderVersion"], crc["protocol"]["minWriterVersion"]) == (
        protocol.min_reader_version, protocol.min_writer_version)
    assert "setTransactions" not in crc  # unknown to a reader, never a partial list


def test_each_commit_leaves_the_newest_versions_checksum_only(tmp_path: Path) -> None:
    path = tmp_path / "t"
    sink = sink_at(path, partition_by=["day"])
    for epoch in range(1, 4):
        commit_epochs(sink, range(epoch, epoch + 1))
        latest = deltalake.DeltaTable(str(path)).version()
        found = checksums(path)
        assert list(found) == [latest]
        assert_exact(path, found[latest])
    assert content(path) == expected(range(1, 4))  # the file changes nothing a reader reads


def test_a_pass_leaves_the_checksum_of_its_compaction(tmp_path: Path) -> None:
    path = tmp_path / "t"
    sink = sink_at(path, TIGHT.replace(keep_snapshots=100, keep_seconds=3600))
    commit_epochs(sink, range(1, 6))
    (path / "_delta_log" / f"{1:020d}.crc").write_text("{}")  # one a restart left behind

    report = sink.maintain(window(sink))

    assert "compact" in report.steps
    latest = deltalake.DeltaTable(str(path)).version()
    found = checksums(path)
    assert list(found) == [latest]
    assert_exact(path, found[latest])
    assert content(path) == expected(range(1, 6))


def test_a_table_with_a_feature_it_does_not_know_gets_none() -> None:
    def table(features: list[str] | None, config: dict[str, str]) -> Any:
        protocol = SimpleNamespace(min_reader_version=3, min_writer_version=7,
                                   reader_features=features, writer_features=features)
        metadata = SimpleNamespace(id="x", name=None, description=None, created_time=None,
                                   partition_columns=[], configuration=config)
        return SimpleNamespace(protocol=lambda: protocol, metadata=lambda: metadata)

    assert checksum(table(["deletionVectors"], {})) is None
    assert checksum(table(["inCommitTimestamp"], {})) is None
    assert checksum(table(None, {"delta.enableInCommitTimestamps": "true"})) is None
