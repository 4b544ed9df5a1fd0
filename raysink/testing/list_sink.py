"""``ListSink``: a small exactly-once sink keeping each committed epoch as one Arrow IPC
file (the data and the marker at once); works across processes."""

from __future__ import annotations

import os
import uuid
from collections.abc import Sequence
from pathlib import Path, PurePosixPath
from typing import Any

import pyarrow as pa

from raysink import _schema
from raysink._faults import (
    hit,
)
from raysink.errors import (
    DataLossError,
    MetaStoreError,
    SchemaMismatchError,
    SinkUnavailableError,
)
from raysink.sinks._files import FilesManifest, files_manifests, rmtree, write_durably
from raysink.sinks.base import CommitResult, Manifest, Sink, SinkWriter


def _ipc_bytes(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    return bytes(sink.getvalue().to_pybytes())


def _read_ipc(path: Path) -> pa.Table:
    with pa.memory_map(str(path)) as source:
        return pa.ipc.open_file(source).read_all()



# --------------------------------------------------------------------------- ListSink


class ListSink(Sink):
    """An exactly-once sink keeping committed rows as Arrow IPC files in ``directory``.

    Layout: ``staging/<epoch>/<attempt>/w<writer>-<uuid>.arrow`` (written by
    ``pre_commit``; writers buffer in memory until then, ``flush`` does nothing) and
    ``committed/<epoch>.arrow`` (the epoch's rows and its marker in one atomic file).
    ``commit`` and ``abort`` are idempotent. ``key`` is reported to the runtime only: rows
    are appended, never upserted. With ``schema_evolution="add_columns"`` an epoch may add
    columns or widen types (``raysink._schema.evolve``); its committed file holds the
    whole schema after it (``table_schema()``), with the epoch's rows aligned to it.
    """

    kind = "list"

    def __init__(self, directory: str | os.PathLike[str], *,
                 key: Sequence[str] | None = None,
                 schema_evolution: _schema.SchemaEvolution = "fail") -> None:
        self._directory = os.path.abspath(os.fspath(directory))
        self._key = None if key is None else tuple(key)
        self.schema_evolution = _schema.check_evolution_option("ListSink", schema_evolution)

    @property
    def directory(self) -> Path:
        return Path(self._directory)

    @property
    def key(self) -> Sequence[str] | None:
        return self._key

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "directory": self._directory,
                "schema_evolution": self.schema_evolution}

    def evolution_rules(self) -> _schema.Rules:
        """Arrow's types; every lossless widening (each epoch is its own file)."""
        return _schema.Rules(target=f"the ListSink {self._directory!r}",
                             widen=lambda old, new: True)

    def table_schema(self) -> pa.Schema | None:
        """The schema of the newest committed epoch that had one (``add_columns``: the
        table's), else ``None``."""
        for epoch in reversed(self.committed_epochs()):
            with pa.memory_map(str(self._committed(epoch))) as source:
                schema = pa.ipc.open_file(source).schema
            if schema.names:
                return schema
        return None

    def _staging(self, epoch: int) -> Path:
        return self.directory / "staging" / f"{epoch:012d}"

    def _committed(self, epoch: int) -> Path:
        return self.directory / "committed" / f"{epoch:012d}.arrow"

    def validate(self) -> None:
        """The directory (or its nearest existing parent) is a directory. Creates nothing."""
        probe = self.directory
        while not probe.exists():
            probe = probe.parent
        if not probe.is_dir():
            raise SinkUnavailableError(f"{str(probe)!r} is a file; give a directory",
                                       runtime=self.runtime or None, sink=self.name or None)

    def create_writer(self, writer_id: int) -> ListSinkWriter:
        return ListSinkWriter(self, writer_id)

    def commit(self, epoch: int, manifests: Sequence[Manifest]) -> CommitResult:
        """Write ``committed/<epoch>.arrow`` from the staged files, then sweep staging.
        Idempotent: an epoch already committed only has its staging swept."""
        paths = self._staged_paths(epoch, manifests)
        result = CommitResult.ALREADY
        if not self._committed(epoch).exists():
            table = self._read_staged(epoch, paths, manifests)
            hit("sink.mid_commit", runtime=self.runtime, sink=self.name, epoch=epoch)
            write_durably(self._committed(epoch), _ipc_bytes(table))
            result = CommitResult.COMMITTED
        rmtree(self._staging(epoch))
        return result

    def _read_staged(self, epoch: int, paths: list[Path],
                     manifests: Sequence[Manifest]) -> pa.Table:
        missing = [str(p) for p in paths if not p.exists()]
        if missing:
            raise DataLossError(f"staged files {missing} are gone before commit",
                                runtime=self.runtime, sink=self.name, epoch=epoch)
        tables = [_read_ipc(p) for p in paths]
        if not tables:
            return pa.table({})
        if self.schema_evolution != "add_columns":
            return pa.concat_tables(tables, promote_options="default")
        where = {"runtime": self.runtime, "sink": self.name, "epoch": epoch}
        schema = _schema.union([t.schema for t in tables])
        current = self.table_schema()
        if current is not None:
            schema = _schema.evolve(current, schema, self.evolution_rules(),
                                    where=where).schema
        return _schema.align(tables, schema)

    def abort(self, epoch: int, manifests: Sequence[Manifest] | None) -> None:
        """Delete the listed staged files, or with ``None`` all of ``staging/<epoch>``.
        Idempotent."""
        if manifests is None:
            rmtree(self._staging(epoch))
            return
        for path in self._staged_paths(epoch, manifests):
            path.unlink(missing_ok=True)

    def committed_epoch(self) -> int | None:
        return max(self.committed_epochs(), default=None)

    def committed_epochs(self) -> list[int]:
        """Every committed epoch, ascending."""
        folder = self.directory / "committed"
        if not folder.is_dir():
            return []
        return sorted(int(p.stem) for p in folder.glob("*.arrow") if p.stem.isdigit())

    def target_exists(self) -> bool:
        return self.directory.is_dir()

    def recreate_marker(self, epoch: int) -> None:
        if not self._committed(epoch).exists():
            write_durably(self._committed(epoch), _ipc_bytes(pa.table({})))

    def read(self) -> pa.Table:
        """Every committed row, in epoch order (an empty table when nothing is committed)."""
        tables = [self.read_epoch(e) for e in self.committed_epochs()]
        non_empty = [t for t in tables if t is not None and t.num_rows]
        if not non_empty:
            return pa.table({})
        return pa.concat_tables(non_empty, promote_options="permissive")

    def read_epoch(self, epoch: int) -> pa.Table | None:
        """The rows committed at ``epoch``, or ``None`` when it is not committed."""
        path = self._committed(epoch)
        return _read_ipc(path) if path.exists() else None

    def _staged_paths(self, epoch: int, manifests: Sequence[Manifest]) -> list[Path]:
        staging = self._staging(epoch)
        paths = []
        for manifest in files_manifests(manifests):
            for staged in manifest.get("files", []):
                relative = staged.get("path")
                pure = PurePosixPath(str(relative))
                path = self.directory.joinpath(*pure.parts)
                if pure.is_absolute() or ".." in pure.parts or staging not in path.parents:
                    raise MetaStoreError(f"manifest path {relative!r} is outside "
                                         f"{str(staging)!r}; refused", runtime=self.runtime,
                                         sink=self.name, epoch=epoch)
                paths.append(path)
        return paths


class ListSinkWriter(SinkWriter):
    """Buffers one epoch's batches in memory; ``pre_commit`` stages them as one IPC file."""

    def __init__(self, sink: ListSink, writer_id: int) -> None:
        self._sink = sink
        self._writer_id = writer_id
        self._batches: list[pa.RecordBatch] = []
        self._last: tuple[tuple[int, int], Manifest] | None = None
        # add_columns: the table's schema (read at the epoch's first batch), the epoch's
        self._target: pa.Schema | None = None
        self._union: pa.Schema | None = None

    def write(self, batch: pa.RecordBatch) -> None:
        if self._sink.schema_evolution == "add_columns":
            self._evolve(batch)
        elif self._batches and not batch.schema.equals(self._batches[0].schema):
            raise SchemaMismatchError(
                f"writer {self._writer_id}: batch schema {batch.schema.names} differs from "
                f"the epoch's {self._batches[0].schema.names}; send one schema per epoch",
                runtime=self._sink.runtime or None, sink=self._sink.name or None)
        self._batches.append(batch)
        self._last = None

    def _evolve(self, batch: pa.RecordBatch) -> None:
        """``add_columns``: the batch must evolve the table's schema, and have a union with
        the epoch's other batches; ``SchemaMismatchError`` naming the column otherwise."""
        where: dict[str, Any] = {"runtime": self._sink.runtime or None,
                                 "sink": self._sink.name or None}
        if not self._batches:
            self._target, self._union = self._sink.table_schema(), None
        if self._target is not None:
            _schema.evolve(self._target, batch.schema, self._sink.evolution_rules(),
                           where=where)
        self._union = _schema.union([batch.schema] if self._union is None
                                    else [self._union, batch.schema])

    def pre_commit(self, epoch: int, attempt: int) -> Manifest:
        """Stage the buffered rows; the same manifest again when re-run with no writes."""
        if self._last is not None and self._last[0] == (epoch, attempt):
            return self._last[1]
        files: list[dict[str, Any]] = []
        rows = sum(b.num_rows for b in self._batches)
        if self._batches:
            name = f"{attempt:04d}/w{self._writer_id:04d}-{uuid.uuid4().hex}.arrow"
            path = self._sink._staging(epoch) / name
            tables = [pa.Table.from_batches([b]) for b in self._batches]
            write_durably(path, _ipc_bytes(pa.concat_tables(tables, promote_options="permissive")))
            files.append({"path": path.relative_to(self._sink.directory).as_posix()})
        manifest: FilesManifest = {"writer": self._writer_id, "files": files, "rows": rows}
        self._batches, self._last = [], ((epoch, attempt), manifest)
        return manifest

    def rollback(self, epoch: int, attempt: int) -> None:
        if self._last is None or self._last[0] != (epoch, attempt):
            self._batches = []
        self._last = None
        folder = self._sink._staging(epoch) / f"{attempt:04d}"
        if folder.is_dir():
            for path in folder.glob(f"w{self._writer_id:04d}-*.arrow"):
                path.unlink(missing_ok=True)
