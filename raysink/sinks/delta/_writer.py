"""``DeltaSinkWriter``: the staged-files writer (``raysink.sinks._table_format``) with
what is Delta's own: rows split by partition (a partition's values live in the add
action, not in the file), upsert keys checked at every write, and each file's add
action prepared at ``pre_commit`` (size, partition values, statistics)."""

from __future__ import annotations

import time
from collections.abc import Hashable, Iterator
from datetime import date
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from raysink import _schema
from raysink.errors import SchemaMismatchError
from raysink.sinks._files import FileStore
from raysink.sinks._parquet_buffer import EncodedFile
from raysink.sinks._table_format import StagedFilesWriter
from raysink.sinks.delta._stats import file_stats
from raysink.sinks.delta._table import (
    DeltaOptions,
    TableCache,
    check_keys,
    rules,
    table_schema,
)

__all__ = ["DeltaSinkWriter"]


def _partition_value(value: Any) -> str | None:
    """Delta's string form of a partition value."""
    if value is None:
        return None
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, date):
        return value.isoformat()
    return str(value)


class DeltaSinkWriter(StagedFilesWriter):
    """Encodes an epoch's rows into Parquet in memory (per partition, rolling at
    ``max_file_rows``) and uploads them at ``pre_commit``. Schema, key and null checks run
    on every ``write``, so bad data fails the epoch before anything is staged."""

    def __init__(self, opts: DeltaOptions, writer_id: int, where: dict[str, Any]) -> None:
        super().__init__(writer_id, where, evolving=opts.evolving, rules=rules(opts.uri),
                         max_file_rows=opts.max_file_rows, compression=opts.compression)
        self._opts = opts
        self._table = TableCache(opts)

    def _begin(self, schema: pa.Schema) -> tuple[str, pa.Schema | None]:
        dt = self._table.current()
        target = None if dt is None else table_schema(dt)
        if target is not None and not self._evolving:
            refused = _schema.refusal(target, schema, self._rules, where=self._where)
            if refused is not None:
                raise refused
        return self._opts.staging, target

    def _open_store(self, root: str) -> FileStore:
        return self._opts.store(root)

    def _check(self, batch: pa.RecordBatch) -> None:
        missing = [c for c in self._opts.partition_by if c not in batch.schema.names]
        if missing:
            raise SchemaMismatchError(f"partition columns {missing!r} are not in the batch",
                                      **self._where)
        if self._opts.key:
            check_keys(batch, self._opts.key, self._where)

    def _slots(self, batch: pa.RecordBatch) -> Iterator[tuple[Hashable, pa.RecordBatch]]:
        """Append mode: the batch split by partition (its values as Delta writes them, the
        partition columns left out of the file)."""
        cols = list(self._opts.partition_by)
        if not cols or self._opts.mode == "upsert":
            yield (), batch
            return
        table = pa.Table.from_batches([batch])
        combos = table.select(cols).group_by(cols, use_threads=False).aggregate([])
        for combo in combos.to_pylist():
            mask = None
            for c in cols:
                column, value = table.column(c), combo[c]
                m = (pc.is_null(column) if value is None
                     else pc.equal(column, pa.scalar(value, column.type)))
                mask = m if mask is None else pc.and_(mask, m)
            part = table.filter(mask).drop_columns(cols).combine_chunks()
            values = tuple(_partition_value(combo[c]) for c in cols)
            for piece in part.to_batches():
                yield values, piece

    def _file_schema(self, schema: pa.Schema) -> pa.Schema:
        if self._opts.mode == "append" and self._opts.partition_by:
            return pa.schema([f for f in schema if f.name not in self._opts.partition_by])
        return schema

    def _file_entry(self, part: Hashable, encoded: EncodedFile) -> dict[str, Any]:
        """The add action's fields: size, partition values, time, statistics."""
        values = part if isinstance(part, tuple) else ()
        partition = dict(zip(self._opts.partition_by, values, strict=True)) \
            if self._opts.mode == "append" else {}
        return {"size": encoded.data.size, "partition_values": partition,
                "modification_time": int(time.time() * 1000),
                "stats": file_stats(encoded.data, encoded.rows)}
