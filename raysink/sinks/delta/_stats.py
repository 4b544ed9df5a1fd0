"""Delta's per-file statistics (an add action's ``stats``), read from a staged file's
Parquet footer so the commit never reads the file itself.

``numRecords``, and per top-level column ``nullCount`` and, where every row group has a
range of a type summarised exactly, ``minValues``/``maxValues``. Floats, timestamps and
strings longer than ``STAT_STRING_MAX`` are left out: a truncated or rounded bound would
let a reader skip a file holding the value it looks for.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import date
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

__all__ = ["file_stats"]

STAT_STRING_MAX = 32


def _stat_value(value: Any) -> Any:
    """A JSON stats value, or ``None`` when the type is not summarised (floats, timestamps
    and long strings are left out: a truncated max would skip files wrongly)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        return value if len(value) <= STAT_STRING_MAX else None
    if isinstance(value, date) and type(value) is date:
        return value.isoformat()
    return None


@dataclass
class _ColumnStats:
    nulls: int = 0
    nulls_known: bool = True
    low: Any = None
    high: Any = None
    ranged: bool = True


def file_stats(data: pa.Buffer, rows: int) -> str:
    """Delta ``stats`` JSON of one Parquet file, from its footer."""
    meta = pq.ParquetFile(pa.BufferReader(data)).metadata
    top = set(meta.schema.to_arrow_schema().names)
    columns: dict[str, _ColumnStats] = {}
    for g in range(meta.num_row_groups):
        group = meta.row_group(g)
        for c in range(group.num_columns):
            chunk = group.column(c)
            if chunk.path_in_schema in top:
                _merge_stats(columns.setdefault(chunk.path_in_schema, _ColumnStats()),
                             chunk.statistics, group.num_rows)
    doc: dict[str, Any] = {"numRecords": rows, "minValues": {}, "maxValues": {}, "nullCount": {}}
    for name, col in columns.items():
        if col.nulls_known:
            doc["nullCount"][name] = col.nulls
        if col.ranged and col.low is not None and col.high is not None:
            doc["minValues"][name] = col.low
            doc["maxValues"][name] = col.high
    return json.dumps(doc)


def _merge_stats(col: _ColumnStats, stats: Any, group_rows: int) -> None:
    if stats is None or not stats.has_null_count:
        col.nulls_known = False
    else:
        col.nulls += stats.null_count
    if stats is None or not stats.has_min_max:
        # an all-null row group has no range and does not widen one
        col.ranged = col.ranged and stats is not None and stats.null_count == group_rows
        return
    low, high = _stat_value(stats.min), _stat_value(stats.max)
    if low is None or high is None:
        col.ranged = False
        return
    col.low = low if col.low is None else min(col.low, low)
    col.high = high if col.high is None else max(col.high, high)
