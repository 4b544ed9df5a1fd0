"""``ParquetSinkWriter``: one writer actor's rows as Parquet files of the sink directory.

Files flushed before the epoch is known live in the writer's own
``_raysink/staging/_writing/w<id>-<session>/`` (written under a temporary name, fsynced
and renamed: a flushed file is whole or absent) and move into
``staging/<epoch>/<attempt>/`` at ``pre_commit``.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.parquet as pq

from raysink import _schema
from raysink.errors import SchemaMismatchError
from raysink.sinks._files import FilesManifest, fsync_dir, makedirs, rmtree
from raysink.sinks._parquet_buffer import dictionary_columns
from raysink.sinks.base import Manifest, SinkWriter, staged_name
from raysink.sinks.parquet._layout import rmdir_if_empty

if TYPE_CHECKING:
    from raysink.sinks.parquet._sink import ParquetSink

__all__ = ["ParquetSinkWriter"]


@dataclass(slots=True)
class _OpenFile:
    tmp: Path
    final: Path
    handle: IO[bytes]
    writer: pq.ParquetWriter
    rows: int = 0


@dataclass(frozen=True, slots=True)
class _FlushedFile:
    path: Path
    rows: int
    size: int
    schema: pa.Schema


class ParquetSinkWriter(SinkWriter):
    """Stages one writer actor's rows as Parquet files (see the module docstring).

    Files flushed before the epoch is known live in this writer's own
    ``_raysink/staging/_writing/w<id>-<session>/`` and move into
    ``staging/<epoch>/<attempt>/`` at ``pre_commit``. ``open`` sweeps what an earlier
    incarnation of the same writer id left there. Within one epoch every batch must have
    one schema (the sink's, when given, and the directory's): a differing batch raises
    ``SchemaMismatchError`` and is not kept; the writer stays usable. With
    ``schema_evolution="add_columns"`` a batch may evolve the directory's schema
    (``raysink._schema.evolve``; narrower types are cast up): a batch of another schema
    than the one before closes the current file, and the manifest reports the union.
    """

    def __init__(self, sink: ParquetSink, writer_id: int) -> None:
        self._sink = sink
        self._writer_id = writer_id
        self._layout = sink.layout
        self._session = uuid.uuid4().hex[:12]
        self._schema: pa.Schema | None = sink.schema
        self._buffer: list[pa.RecordBatch] = []
        self._buffered_rows = 0
        self._current: _OpenFile | None = None
        self._flushed: list[_FlushedFile] = []
        self._last: tuple[tuple[int, int], Manifest] | None = None
        self._opened = False
        self._evolving = sink.schema_evolution == "add_columns"
        if self._evolving:
            self._schema = None  # the option is the directory's first schema, see table_schema
        # the directory's schema, read at the epoch's first batch; the union of what the
        # epoch wrote (add_columns)
        self._target: pa.Schema | None = None
        self._target_read = False
        self._written: pa.Schema | None = None

    @property
    def _writing_dir(self) -> Path:
        return self._layout.writing / f"w{self._writer_id:04d}-{self._session}"

    def open(self) -> None:
        """Sweep unfinished files of earlier incarnations of this writer id. Idempotent."""
        if self._opened:
            return
        prefix = f"w{self._writer_id:04d}-"
        if self._layout.writing.is_dir():
            for old in self._layout.writing.iterdir():
                if old.name.startswith(prefix) and old != self._writing_dir:
                    rmtree(old)
        self._opened = True

    # write ---------------------------------------------------------------------------
    def write(self, batch: pa.RecordBatch) -> None:
        batch = self._conform(batch)
        if batch.num_rows == 0:
            return
        self._last = None
        self._buffer.append(batch)
        self._buffered_rows += batch.num_rows
        if self._buffered_rows >= self._sink.row_group_size:
            self._write_buffer()

    def _conform(self, batch: pa.RecordBatch) -> pa.RecordBatch:
        """The batch in the epoch's schema; ``SchemaMismatchError`` when it cannot be."""
        if not self._target_read:
            self._target, self._target_read = self._sink.table_schema(), True
        if self._evolving:
            return self._evolve(batch)
        if self._schema is None:
            self._check_directory(batch.schema)
            self._schema = batch.schema
            return batch
        if batch.schema.equals(self._schema, check_metadata=True):
            return batch
        diffs = _schema.differences(self._schema, batch.schema)
        if diffs:
            raise SchemaMismatchError(
                f"writer {self._writer_id}: batch schema differs from the epoch's: "
                f"{'; '.join(diffs)}; send one schema per epoch",
                **self._sink._error_fields())
        return pa.RecordBatch.from_arrays(batch.columns, schema=self._schema)

    def _check_directory(self, schema: pa.Schema) -> None:
        """The epoch's first batch has the directory's columns and types (``fail``)."""
        if self._target is None:
            return
        refused = _schema.refusal(self._target, schema, self._sink.evolution_rules(),
                                  where=self._sink._error_fields())
        if refused is not None:
            raise refused

    def _evolve(self, batch: pa.RecordBatch) -> pa.RecordBatch:
        """``add_columns``: the batch must evolve the directory's schema; it is cast up to
        the directory's wider types, and a change of schema closes the current file."""
        batch, self._written = _schema.admit(batch, self._target, self._written,
                                             self._sink.evolution_rules(),
                                             where=self._sink._error_fields())
        if self._schema is not None:
            if batch.schema.equals(self._schema, check_metadata=False):
                return pa.RecordBatch.from_arrays(batch.columns, schema=self._schema)
            self.flush()  # one schema per file
        self._schema = batch.schema
        return batch

    def _write_buffer(self, *, everything: bool = False) -> None:
        """Write full row groups of the buffer (with ``everything``, the remainder too)."""
        if not self._buffer:
            return
        table = pa.Table.from_batches(self._buffer, schema=self._schema)
        step = self._sink.row_group_size
        keep = 0 if everything else table.num_rows % step
        cut = table.num_rows - keep
        self._buffer = table.slice(cut).to_batches() if keep else []
        self._buffered_rows = keep
        for offset in range(0, cut, step):
            chunk = table.slice(offset, step)
            current = self._current or self._open_file(chunk)
            current.writer.write_table(chunk, row_group_size=step)
            current.rows += chunk.num_rows
            if current.handle.tell() >= self._sink.max_file_bytes:
                self._finish_file()

    def _open_file(self, sample: pa.Table) -> _OpenFile:
        makedirs(self._writing_dir)
        unique = uuid.uuid4().hex
        tmp = self._writing_dir / f".{unique}.parquet.tmp"
        handle = open(tmp, "wb")  # noqa: SIM115 - closed by _finish_file / _drop_current
        compression = None if self._sink.compression == "none" else self._sink.compression
        writer = pq.ParquetWriter(handle, self._schema, compression=compression,
                                  use_dictionary=dictionary_columns(sample))
        self._current = _OpenFile(tmp, self._writing_dir / f"{unique}.parquet", handle, writer)
        return self._current

    def _finish_file(self) -> None:
        """Close the current file: footer, fsync, rename into place, fsync the directory."""
        current, self._current = self._current, None
        if current is None:
            return
        current.writer.close()
        current.handle.flush()
        os.fsync(current.handle.fileno())
        size = current.handle.tell()
        current.handle.close()
        os.replace(current.tmp, current.final)
        fsync_dir(current.final.parent)
        self._flushed.append(_FlushedFile(current.final, current.rows, size,
                                          current.writer.schema))

    def flush(self) -> None:
        """Write buffered rows and close the current file: flushed rows are durable."""
        self._write_buffer(everything=True)
        self._finish_file()

    # pre-commit ----------------------------------------------------------------------
    def pre_commit(self, epoch: int, attempt: int) -> Manifest:
        """Flush, move this epoch's files into ``staging/<epoch>/<attempt>/`` and describe
        them. Calling it again for the same attempt with nothing written in between returns
        the same manifest."""
        if self._last is not None and self._last[0] == (epoch, attempt):
            return self._last[1]
        self.flush()
        schema = self._written if self._evolving else self._schema
        files = self._stage_flushed(epoch, attempt, schema)
        manifest: FilesManifest = {
            "writer": self._writer_id,
            "epoch": epoch,
            "attempt": attempt,
            "files": files,
            "rows": sum(f["rows"] for f in files),
            "bytes": sum(f["bytes"] for f in files),
            "schema": None if schema is None else _schema.encode(schema),
        }
        self._flushed = []
        self._new_epoch()
        self._last = ((epoch, attempt), manifest)
        return manifest

    def _new_epoch(self) -> None:
        """Forget the epoch's schemas: the next one starts from the directory's."""
        self._schema = None if self._evolving else self._sink.schema
        self._target, self._target_read, self._written = None, False, None

    def _stage_flushed(self, epoch: int, attempt: int,
                       schema: pa.Schema | None) -> list[dict[str, Any]]:
        if not self._flushed:
            return []
        target = self._layout.attempt_dir(epoch, attempt)
        makedirs(target)
        files = []
        for flushed in self._flushed:
            name = staged_name(epoch, attempt, self._writer_id, flushed.path.stem) + ".parquet"
            os.replace(flushed.path, target / name)
            relative = (target / name).relative_to(self._layout.root).as_posix()
            entry: dict[str, Any] = {"path": relative, "rows": flushed.rows,
                                     "bytes": flushed.size}
            if schema is not None and not _schema.same(flushed.schema, schema):
                entry["schema"] = _schema.encode(flushed.schema)
            files.append(entry)
        fsync_dir(target)
        fsync_dir(self._writing_dir)
        return files

    # rollback / close ----------------------------------------------------------------
    def rollback(self, epoch: int, attempt: int) -> None:
        """Delete this writer's staged files of ``(epoch, attempt)``; unless that attempt was
        already pre-committed, also drop everything written since the last pre-commit.
        Idempotent."""
        if self._last is None or self._last[0] != (epoch, attempt):
            self._discard_unstaged()
        self._last = None
        target = self._layout.attempt_dir(epoch, attempt)
        prefix = staged_name(epoch, attempt, self._writer_id, "")
        if target.is_dir():
            for staged in target.iterdir():
                if staged.name.startswith(prefix):
                    staged.unlink(missing_ok=True)
            rmdir_if_empty(target, target.parent)

    def _discard_unstaged(self) -> None:
        self._drop_current()
        for flushed in self._flushed:
            flushed.path.unlink(missing_ok=True)
        self._flushed, self._buffer, self._buffered_rows = [], [], 0
        self._new_epoch()

    def _drop_current(self) -> None:
        current, self._current = self._current, None
        if current is None:
            return
        try:
            current.writer.close()
        finally:
            current.handle.close()
            current.tmp.unlink(missing_ok=True)

    def close(self) -> None:
        """Drop rows never pre-committed and this writer's unfinished files."""
        self._discard_unstaged()
        rmtree(self._writing_dir)
