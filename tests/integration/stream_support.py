"""What the stream tests share: the ids a replayable source holds, and a table's ids."""

from __future__ import annotations

from examples.replayable_stream import ROWS_PER_BATCH
from tests.integration.real_targets import ParquetTarget


def source_ids(producers: int, batches: int) -> list[int]:
    """Every id ``producers`` replayable sources of ``batches`` batches write, sorted."""
    return sorted(p * 1_000_000 + i for p in range(producers)
                  for i in range(batches * ROWS_PER_BATCH))


def table_ids(target: ParquetTarget) -> list[int]:
    """The ids the table holds, sorted (none before its first commit)."""
    table = target.table()
    return [] if table is None else sorted(table.column("id").to_pylist())
