"""``IcebergSinkWriter``: the staged-files writer (``raysink.sinks._table_format``) with
what is Iceberg's own: at the epoch's first batch it reads the table from the catalog,
checks the batch as pyiceberg will write it, takes the table's current partition spec
(``partition_by`` before the table exists) and stages under the table's data location
(the default location, before the table exists). Rows are split by partition, one file
(or more, by ``max_file_rows``) per partition, each entry naming its spec and values."""

from __future__ import annotations

from collections.abc import Hashable, Iterator
from typing import Any

import pyarrow as pa

from raysink.sinks._files import FileStore
from raysink.sinks._parquet_buffer import EncodedFile
from raysink.sinks._table_format import StagedFilesWriter
from raysink.sinks.iceberg._partition import WriteSpec, table_spec
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
        self._spec = WriteSpec()

    def _begin(self, schema: pa.Schema) -> tuple[str, pa.Schema | None]:
        table = self._opts.load_table()
        self._spec = (WriteSpec(self._opts.partition_by) if table is None
                      else table_spec(table, self._opts.identifier))
        target = None
        if table is not None and self._evolving:
            target = table.schema().as_arrow()
        elif table is not None:
            check_schema(table, self._opts.identifier, schema, self._where)
        return self._opts.staging_roots(table)[0], target

    def _open_store(self, root: str) -> FileStore:
        return self._opts.store(root)

    def _slots(self, batch: pa.RecordBatch) -> Iterator[tuple[Hashable, pa.RecordBatch]]:
        """The batch split by the epoch's partition spec (one piece when unpartitioned)."""
        yield from self._spec.split(batch, self._where)

    def _file_entry(self, part: Hashable, encoded: EncodedFile) -> dict[str, Any]:
        if not self._spec.partitioned:
            return {"bytes": encoded.data.size}
        values = list(part) if isinstance(part, tuple) else []
        return {"bytes": encoded.data.size, "spec": self._spec.signature(),
                "partition": values}
