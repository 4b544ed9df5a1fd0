"""``IcebergSinkWriter``: the staged-files writer (``raysink.sinks._table_format``) with
what is Iceberg's own: at the epoch's first batch it reads the table from the catalog,
checks the batch as pyiceberg will write it, and stages under the table's data location
(the default location, before the table exists)."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import pyarrow as pa

from raysink.sinks._files import FileStore
from raysink.sinks._parquet_buffer import EncodedFile
from raysink.sinks._table_format import StagedFilesWriter
from raysink.sinks.iceberg._table import IcebergOptions, check_schema, rules

__all__ = ["IcebergSinkWriter"]


class IcebergSinkWriter(StagedFilesWriter):
    """Encodes an epoch's rows into in-memory Parquet files and uploads them at
    ``pre_commit``; the schema is checked against the table on the epoch's first batch."""

    def __init__(self, opts: IcebergOptions, writer_id: int, where: dict[str, Any]) -> None:
        super().__init__(writer_id, where, evolving=opts.evolving,
                         rules=rules(opts.identifier), max_file_rows=opts.max_file_rows,
                         compression=opts.compression)
        self._opts = opts

    def _begin(self, schema: pa.Schema) -> tuple[str, pa.Schema | None]:
        table = self._opts.load_table()
        target = None
        if table is not None and self._evolving:
            target = table.schema().as_arrow()
        elif table is not None:
            check_schema(table, self._opts.identifier, schema, self._where)
        return self._opts.staging_roots(table)[0], target

    def _open_store(self, root: str) -> FileStore:
        return self._opts.store(root)

    def _file_entry(self, part: Hashable, encoded: EncodedFile) -> dict[str, Any]:
        return {"bytes": encoded.data.size}
