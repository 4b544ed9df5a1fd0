"""The staged-files base of the table-format sinks (``DeltaSink``, ``IcebergSink``).

Both stage an epoch alike; a format supplies only its commit, its marker and what is its
own (Delta's add actions and statistics, Iceberg's data files and catalog).

Writer side (``StagedFilesWriter``, in the writer actor)::

    write(batch)         at the epoch's first batch the format reads the table
                         (``_begin``: where to stage, the table's schema; with
                         ``schema_evolution="fail"`` a batch that does not fit the table is
                         refused there); every batch is then checked (``"fail"``: one
                         schema per epoch; ``"add_columns"``: ``raysink._schema.admit``
                         against the table's schema) and encoded into in-memory Parquet,
                         one ``ParquetBuffer`` per slot (a partition and a schema)
    pre_commit(e, a)     the files uploaded under ``<root>/<epoch:012d>/`` and described
                         in the manifest (a file written in another schema than the
                         epoch's carries its own); the writer remembers them
    rollback(e, a)       buffered rows dropped, the attempt's uploaded files deleted

Sink side (``StagedFilesSink``, in the coordinator): the epoch's schema from its manifests
(``_epoch_schema``: with ``add_columns`` the union of its writers' and files' schemas,
else one schema all writers share), the manifests' paths checked to be files staged for
the epoch under one of the sink's staging roots (``_checked_files``: anything else is a
``MetaStoreError``, never followed), and ``abort``: the epoch's staged files deleted,
except those the table references.

A staging root is named as a manifest names its files, ``<root>/<epoch:012d>/<name>``:
Delta's is ``raysink`` (relative to the table, as its add actions name files), Iceberg's
a URI under the table's data location (``raysink.sinks._files`` has the names).
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from raysink import _schema
from raysink.errors import MetaStoreError, SchemaMismatchError
from raysink.sinks._files import (
    STAGED_FILE,
    FilesManifest,
    FileStore,
    epoch_dir,
    files_manifests,
    new_unique,
    staged_file,
)
from raysink.sinks._parquet_buffer import EncodedFile, ParquetBuffer
from raysink.sinks.base import Manifest, Sink, SinkWriter

__all__ = ["EpochState", "StagedFilesSink", "StagedFilesWriter", "file_schemas"]

REMEMBERED_ATTEMPTS = 8
"""Staged attempts a writer can still roll back."""


def file_schemas(manifests: Sequence[Manifest]) -> list[pa.Schema]:
    """The schemas the epoch's staged files were written in (a file's own, else its
    writer's), each once."""
    texts: dict[str, None] = {}
    for m in files_manifests(manifests):
        for f in m.get("files") or []:
            text = f.get("schema", m.get("schema"))
            if isinstance(text, str):
                texts[text] = None
    return [_schema.decode(text) for text in texts]


# --------------------------------------------------------------------------- the sink


class StagedFilesSink(Sink):
    """What a table-format sink does with staged files in the coordinator. A format
    names its staging roots and their stores, the files its table references, and how
    its messages name the staging place."""

    @property
    def evolving(self) -> bool:
        return self.schema_evolution == "add_columns"

    def _where(self, epoch: int | None = None) -> dict[str, Any]:
        return {"runtime": self.runtime or None, "sink": self.name or None, "epoch": epoch}

    @abstractmethod
    def _staging_roots(self, table: Any | None) -> list[str]:
        """Where writers stage files for ``table`` (``None``: the table as it is, or none)."""

    @abstractmethod
    def _root_store(self, root: str) -> FileStore:
        """The files under staging root ``root``."""

    @abstractmethod
    def _staging_place(self) -> str:
        """Where staged files belong, for a message (``"of 'ns.table'"``)."""

    def _abort_table(self) -> Any | None:
        """The table an abort checks references against (``None``: loaded by
        ``_referenced`` when it needs it)."""
        return None

    @abstractmethod
    def _referenced(self, table: Any | None) -> set[str]:
        """Paths, as manifests name them, of staged files the table references."""

    def _epoch_schema(self, epoch: int, manifests: Sequence[Manifest]) -> pa.Schema | None:
        """The schema the epoch's writers wrote (``None``: no writer saw one): with
        ``add_columns`` the union of theirs and their files'; else the one they share."""
        where = self._where(epoch)
        if self.evolving:
            return _schema.united(manifests, more=file_schemas(manifests), where=where)
        schemas = _schema.reported(manifests)
        for other in schemas[1:]:
            if not _schema.same(schemas[0], other):
                raise SchemaMismatchError(f"writers staged different schemas: {schemas[0]} "
                                          f"and {other}", **where)
        return schemas[0] if schemas else None

    def _checked_files(self, epoch: int, manifests: Sequence[Manifest] | None,
                       roots: Sequence[str]) -> list[dict[str, Any]]:
        """The manifests' file entries (copies), each a file staged for ``epoch`` under one
        of ``roots``; any other path is a ``MetaStoreError``, never followed."""
        dirs = {epoch_dir(root, epoch) for root in roots}
        files = [dict(f) for m in files_manifests(manifests) for f in m.get("files") or []]
        for f in files:
            path = str(f["path"])
            head, _, base = path.rpartition("/")
            match = STAGED_FILE.fullmatch(base)
            if head not in dirs or match is None or int(match.group(1)) != epoch:
                raise MetaStoreError(f"manifest path {path!r} is not a file staged for epoch "
                                     f"{epoch} {self._staging_place()}; refused",
                                     **self._where(epoch))
        return files

    def abort(self, epoch: int, manifests: Sequence[Manifest] | None) -> None:
        """Delete the epoch's staged files (the listed ones, or with ``None`` every file
        under ``<root>/<epoch>/``) that the table does not reference. Idempotent; creates
        nothing."""
        table = self._abort_table()
        roots = self._staging_roots(table)
        if manifests is None:
            paths = self._staged_paths(epoch, roots)
        else:
            paths = [str(f["path"]) for f in self._checked_files(epoch, manifests, roots)]
        keep = self._referenced(table) if paths else set()
        self._delete_staged(epoch, roots, [p for p in paths if p not in keep])

    def _staged_paths(self, epoch: int, roots: Sequence[str]) -> list[str]:
        """Every file staged for ``epoch`` under ``roots``."""
        return [f"{root}/{rel}" for root in roots
                for rel in self._root_store(root).list_files(epoch_dir("", epoch))
                if STAGED_FILE.fullmatch(rel.rpartition("/")[2])]

    def _delete_staged(self, epoch: int, roots: Sequence[str], paths: Sequence[str]) -> None:
        """Delete ``paths`` (staged files of ``epoch``), then the epoch's directories left
        empty."""
        for root in roots:
            store = self._root_store(root)
            for path in paths:
                if path.startswith(f"{root}/"):
                    store.delete(path[len(root) + 1:])
            store.remove_empty_dir(epoch_dir("", epoch))


# --------------------------------------------------------------------------- the writer


@dataclass
class EpochState:
    """One epoch of one writer: whether it began (the table read at its first batch),
    where it stages, its schema (with ``add_columns`` the union of its batches'), the
    table's schema when it began, a buffer per slot (a partition and a schema)."""

    began: bool = False
    root: str | None = None
    schema: pa.Schema | None = None
    target: pa.Schema | None = None
    buffers: dict[tuple[Hashable, str], ParquetBuffer] = field(default_factory=dict)


class StagedFilesWriter(SinkWriter):
    """Encodes an epoch's rows into in-memory Parquet files (rolling at
    ``max_file_rows``) and uploads them at ``pre_commit``. Bad data fails the write that
    brings it, before anything is staged."""

    def __init__(self, writer_id: int, where: dict[str, Any], *, evolving: bool,
                 rules: _schema.Rules, max_file_rows: int, compression: str) -> None:
        self._writer_id = writer_id
        self._where = where
        self._evolving = evolving
        self._rules = rules
        self._max_file_rows = max_file_rows
        self._compression = compression
        self._epoch = EpochState()
        self._staged: dict[tuple[int, int], list[tuple[str, str]]] = {}
        self._stores: dict[str, FileStore] = {}

    @abstractmethod
    def _begin(self, schema: pa.Schema) -> tuple[str, pa.Schema | None]:
        """At the epoch's first batch (of schema ``schema``): the root to stage under and
        the table's schema (``None``: no table yet). With ``fail``, a ``schema`` that
        does not fit the table is a ``SchemaMismatchError``."""

    @abstractmethod
    def _open_store(self, root: str) -> FileStore:
        """The files under staging root ``root``."""

    @abstractmethod
    def _file_entry(self, part: Hashable, encoded: EncodedFile) -> dict[str, Any]:
        """What a manifest's file entry holds besides its path, rows and own schema."""

    def _check(self, batch: pa.RecordBatch) -> None:
        """The format's own checks of every batch (after the schema's)."""

    def _slots(self, batch: pa.RecordBatch) -> Iterator[tuple[Hashable, pa.RecordBatch]]:
        """``batch`` in pieces, each with the part (partition) it goes to."""
        yield (), batch

    def _file_schema(self, schema: pa.Schema) -> pa.Schema:
        """What a file of an epoch of ``schema`` holds (Delta: not partition columns)."""
        return schema

    def write(self, batch: pa.RecordBatch) -> None:
        epoch = self._epoch
        if not epoch.began:
            epoch.root, epoch.target = self._begin(batch.schema)
            epoch.began = True
        batch = self._admit(batch)
        self._check(batch)
        if batch.num_rows == 0:
            return
        for part, piece in self._slots(batch):
            slot = (part, _schema.encode(piece.schema))
            buffer = epoch.buffers.get(slot)
            if buffer is None:
                buffer = ParquetBuffer(piece.schema, self._max_file_rows, self._compression)
                epoch.buffers[slot] = buffer
            buffer.write(piece)

    def _admit(self, batch: pa.RecordBatch) -> pa.RecordBatch:
        """``add_columns``: the batch must evolve the table's schema; it is cast up to the
        table's wider types and the epoch's schema becomes the union of its batches'.
        ``fail``: every batch of the epoch has its first batch's schema."""
        epoch = self._epoch
        if self._evolving:
            batch, epoch.schema = _schema.admit(batch, epoch.target, epoch.schema,
                                                self._rules, where=self._where)
        elif epoch.schema is None:
            epoch.schema = batch.schema.remove_metadata()
        elif not _schema.same(epoch.schema, batch.schema):
            raise SchemaMismatchError(f"batch schema {batch.schema} differs from the epoch's "
                                      f"{epoch.schema}", **self._where)
        return batch

    def pre_commit(self, epoch: int, attempt: int) -> FilesManifest:
        """Upload the epoch's files under ``<root>/<epoch>/`` and describe them."""
        files: list[dict[str, Any]] = []
        size = 0
        state = self._epoch
        if state.root is not None:
            root, unique = state.root, new_unique()
            store = self._store(root)
            for (part, _), buffer in state.buffers.items():
                own = self._own_schema(buffer.schema)
                for encoded in buffer.finish():
                    rel = staged_file(epoch, attempt, self._writer_id, unique, len(files))
                    store.write(rel, encoded.data)
                    self._remember(epoch, attempt, root, rel)
                    files.append({"path": f"{root}/{rel}", "rows": encoded.rows,
                                  **self._file_entry(part, encoded), **own})
                    size += encoded.data.size
        self._epoch = EpochState()
        schema = state.schema
        return {"writer": self._writer_id, "epoch": epoch, "attempt": attempt, "files": files,
                "rows": sum(f["rows"] for f in files), "bytes": size,
                "schema": _schema.encode(schema) if schema is not None else None}

    def _own_schema(self, written: pa.Schema) -> dict[str, str]:
        """``{"schema": ...}`` for a file written in another schema than the epoch's (the
        writer's batches changed schema within it), else ``{}``."""
        schema = self._epoch.schema
        if schema is None or _schema.same(self._file_schema(schema), written):
            return {}
        return {"schema": _schema.encode(written)}

    def _store(self, root: str) -> FileStore:
        store = self._stores.get(root)
        if store is None:
            store = self._stores[root] = self._open_store(root)
        return store

    def _remember(self, epoch: int, attempt: int, root: str, rel: str) -> None:
        self._staged.setdefault((epoch, attempt), []).append((root, rel))
        while len(self._staged) > REMEMBERED_ATTEMPTS:
            del self._staged[min(self._staged)]

    def rollback(self, epoch: int, attempt: int) -> None:
        """Drop buffered rows and delete the files this writer staged for the attempt."""
        self._epoch = EpochState()
        for root, rel in self._staged.pop((epoch, attempt), []):
            self._store(root).delete(rel)

    def close(self) -> None:
        self._epoch = EpochState()
        self._stores.clear()
