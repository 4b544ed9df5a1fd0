"""Staged Parquet files shared by the table-format sinks (Delta, Iceberg).

A writer encodes its batches into Parquet in memory as they arrive (``ParquetBuffer``,
one per partition), and uploads the finished files at ``pre_commit``, under names that
carry ``(epoch, attempt, writer, uuid)``. Nothing is uploaded before ``pre_commit``
because the epoch is only known then; a writer lost before it re-feeds the attempt, so
earlier durability would buy nothing. ``FileStore`` is a thin, path-relative view of a
``pyarrow.fs`` filesystem that fsyncs local files.

Staged names look like ``<prefix>/<epoch:012d>/e<epoch>-a<attempt>-w<writer>-<uuid>-<n>.parquet``.
"""

from __future__ import annotations

import contextlib
import os
import re
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from raysink.sinks.base import staged_name

__all__ = [
    "STAGED_FILE",
    "FileStore",
    "ParquetBuffer",
    "dictionary_columns",
    "epoch_dir",
    "staged_file_path",
    "write_durably",
]

STAGED_FILE = re.compile(r"e(\d{12})-a(\d{4})-w(\d{4})-[0-9a-f]{32}-\d{4}\.parquet")
"""The base name of every staged file."""


def epoch_dir(prefix: str, epoch: int) -> str:
    """The directory holding every file staged for ``epoch`` (all attempts)."""
    return f"{prefix}/{epoch:012d}"


def staged_file_path(prefix: str, epoch: int, attempt: int, writer: int, unique: str,
                     n: int) -> str:
    """Deterministic relative path of the ``n``-th file one writer staged for an attempt."""
    name = staged_name(epoch, attempt, writer, unique)
    return f"{epoch_dir(prefix, epoch)}/{name}-{n:04d}.parquet"


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


def new_unique() -> str:
    return uuid.uuid4().hex


class FileStore:
    """Relative paths under ``base`` on a ``pyarrow.fs`` filesystem.

    Local files are written with fsync (file and directory), so a staged file that
    ``pre_commit`` reported survives a machine crash.
    """

    def __init__(self, fs: pafs.FileSystem, base: str) -> None:
        self.fs = fs
        self.base = base.rstrip("/")
        self.local = isinstance(fs, pafs.LocalFileSystem)

    def full(self, rel: str) -> str:
        return f"{self.base}/{rel}" if self.base else rel

    def write(self, rel: str, data: pa.Buffer) -> None:
        target = self.full(rel)
        if self.local:
            write_durably(Path(target), data)
            return
        parent = target.rsplit("/", 1)[0] if "/" in target else ""
        if parent:
            self.fs.create_dir(parent, recursive=True)
        with self.fs.open_output_stream(target) as out:
            out.write(data)

    def delete(self, rel: str) -> None:
        """Remove one file; a missing file is fine (idempotent)."""
        with contextlib.suppress(FileNotFoundError):
            self.fs.delete_file(self.full(rel))

    def list_files(self, rel_dir: str) -> list[str]:
        """Files under ``rel_dir`` (recursive), relative to the base; [] when absent."""
        selector = pafs.FileSelector(self.full(rel_dir), recursive=True, allow_not_found=True)
        try:
            infos = self.fs.get_file_info(selector)
        except FileNotFoundError:
            return []
        cut = len(self.base) + 1 if self.base else 0
        return sorted(i.path[cut:] for i in infos if i.type == pafs.FileType.File)

    def remove_empty_dir(self, rel_dir: str) -> None:
        """Remove ``rel_dir`` when it is an empty local directory (object stores have none)."""
        if self.local:
            with contextlib.suppress(OSError):
                os.rmdir(self.full(rel_dir))

    def read_table(self, rel: str) -> pa.Table:
        return pq.read_table(self.full(rel), filesystem=self.fs)

    def entries(self) -> Iterator[pafs.FileInfo]:
        """The top-level entries of the base directory (nothing when it is absent)."""
        selector = pafs.FileSelector(self.base, recursive=False, allow_not_found=True)
        yield from self.fs.get_file_info(selector)


def write_durably(path: Path, data: pa.Buffer | bytes) -> None:
    """Write ``path`` whole or not at all: a uniquely named temporary file, fsync, rename
    into place, fsync of the directory."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    with open(tmp, "wb") as out:
        out.write(memoryview(data))
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
