"""Parquet encoded in memory, as the table-format sinks' writers stage it (Delta, Iceberg).

A writer encodes its batches into Parquet in memory as they arrive (``ParquetBuffer``,
one per partition and schema) and uploads the finished files at ``pre_commit``
(``raysink.sinks._table_format``). Nothing is uploaded before ``pre_commit`` because the
epoch is only known then; a writer lost before it re-feeds the attempt, so earlier
durability would buy nothing. ``dictionary_columns`` chooses the columns worth a
dictionary, for the Parquet sink's files too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

__all__ = ["EncodedFile", "ParquetBuffer", "dictionary_columns"]


@dataclass
class _OpenFile:
    sink: pa.BufferOutputStream
    writer: pq.ParquetWriter
    rows: int = 0


@dataclass
class EncodedFile:
    """One finished in-memory Parquet file of a ``ParquetBuffer``."""

    data: pa.Buffer
    rows: int


ROW_GROUP_ROWS = 1_048_576
"""Rows per row group of the files Delta and Iceberg writers encode (delta-rs's and
pyiceberg's own default): a row group per incoming batch encoded about 2x slower."""
ROW_GROUP_BYTES = 128 * 2**20
"""A row group is also written once this many Arrow bytes wait (bounds a writer's memory)."""


_DICTIONARY_SAMPLE = 65_536


def dictionary_columns(sample: pa.Table) -> list[str] | bool:
    """The columns worth dictionary encoding, judged on ``sample`` (the first rows written).

    pyarrow tries a dictionary for every column and falls back to plain encoding once the
    dictionary grows too large: on ids, random keys and measurements that attempt is wasted
    (about a quarter of the encoding time, measured here). A column gets a dictionary when
    at most half of its sampled values are distinct; a schema with nested columns keeps
    pyarrow's default (the option names leaf columns there).
    """
    if any(pa.types.is_nested(f.type) for f in sample.schema):
        return True
    chosen = []
    for field_, column in zip(sample.schema, sample.columns, strict=True):
        if pa.types.is_boolean(field_.type):
            continue  # bit-packed already
        if pa.types.is_dictionary(field_.type):
            chosen.append(field_.name)
            continue
        values = column.slice(0, _DICTIONARY_SAMPLE)
        present = len(values) - values.null_count
        if present == 0 or pc.count_distinct(values).as_py() * 2 <= present:
            chosen.append(field_.name)
    return chosen


@dataclass
class ParquetBuffer:
    """Encodes batches of one schema into in-memory Parquet files of at most ``max_rows``.

    Batches wait until a whole row group (``row_group_rows`` rows or ``ROW_GROUP_BYTES``)
    is there, then it is encoded at once. ``finish()`` encodes what waits, closes the
    current file and returns every file since the last ``finish``.
    """

    schema: pa.Schema
    max_rows: int
    compression: str = "zstd"
    row_group_rows: int = ROW_GROUP_ROWS
    _open: _OpenFile | None = None
    _done: list[EncodedFile] = field(default_factory=list)
    _waiting: list[pa.RecordBatch] = field(default_factory=list)
    _waiting_rows: int = 0
    _waiting_bytes: int = 0

    def write(self, batch: pa.RecordBatch) -> None:
        self._waiting.append(batch)
        self._waiting_rows += batch.num_rows
        self._waiting_bytes += batch.nbytes
        while self._waiting_rows and (self._waiting_rows >= self._group_rows()
                                      or self._waiting_bytes >= ROW_GROUP_BYTES):
            self._write_group(min(self._waiting_rows, self._group_rows()))

    def finish(self) -> list[EncodedFile]:
        while self._waiting_rows:
            self._write_group(min(self._waiting_rows, self._group_rows()))
        self._close()
        done, self._done = self._done, []
        return done

    @property
    def rows(self) -> int:
        return (sum(f.rows for f in self._done) + (self._open.rows if self._open else 0)
                + self._waiting_rows)

    def _group_rows(self) -> int:
        """Rows of the next row group: a whole group, or what the current file has room for."""
        in_file = self._open.rows if self._open else 0
        return max(1, min(self.row_group_rows, self.max_rows - in_file))

    def _write_group(self, rows: int) -> None:
        """Encode the first ``rows`` waiting rows as one row group (zero-copy slices)."""
        table = pa.Table.from_batches(self._waiting, schema=self.schema)
        group, rest = table.slice(0, rows), table.slice(rows)
        current = self._current(group)
        current.writer.write_table(group, row_group_size=rows)
        current.rows += rows
        self._waiting = rest.to_batches()
        self._waiting_rows = rest.num_rows
        self._waiting_bytes = rest.nbytes
        if current.rows >= self.max_rows:
            self._close()

    def _current(self, sample: pa.Table) -> _OpenFile:
        if self._open is None:
            sink = pa.BufferOutputStream()
            writer = pq.ParquetWriter(sink, self.schema, compression=self.compression,
                                      use_dictionary=dictionary_columns(sample))
            self._open = _OpenFile(sink, writer)
        return self._open

    def _close(self) -> None:
        if self._open is None:
            return
        self._open.writer.close()
        self._done.append(EncodedFile(self._open.sink.getvalue(), self._open.rows))
        self._open = None
