"""``ParquetSink``: the picklable description of a Parquet directory, and the
coordinator's calls (validate, commit, abort, the marker)."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import pyarrow as pa
import pyarrow.parquet as pq

from raysink import _schema
from raysink._faults import hit
from raysink.errors import (
    ConfigError,
    DataLossError,
    SchemaMismatchError,
    SinkUnavailableError,
)
from raysink.sinks._files import rmtree
from raysink.sinks.base import CommitResult, Manifest, Sink, decision_id
from raysink.sinks.parquet._layout import Layout, StagedEntry, rmdir_if_empty, staged_entries
from raysink.sinks.parquet._log import CommitLog
from raysink.sinks.parquet._publish import move_into_place
from raysink.sinks.parquet._writer import ParquetSinkWriter

__all__ = ["COMMIT_LOG_KEEP", "Compression", "ParquetSink"]

logger = logging.getLogger("raysink.sinks.parquet")

Compression = Literal["zstd", "snappy", "gzip", "brotli", "lz4", "none"]
_COMPRESSIONS = ("zstd", "snappy", "gzip", "brotli", "lz4", "none")
COMMIT_LOG_KEEP = 100
"""Commit log entries kept per sink directory; older ones are pruned (at every
``_PRUNE_EVERY``-th epoch, so at most ``COMMIT_LOG_KEEP + _PRUNE_EVERY`` remain)."""
_PRUNE_EVERY = 32


class ParquetSink(Sink):
    """Append Arrow batches to a directory of Parquet files, exactly once per epoch.

    ``path`` is a local (or mounted) directory; it is created at the first flush or commit,
    never by ``validate``. ``schema``, when given, is the schema every batch must have
    (the directory's first schema, with ``schema_evolution="add_columns"``).
    The object is immutable and picklable: it holds options only, no open files.

    The directory's schema is the one its newest commit log entry records
    (``table_schema()``); read the directory with it, so that files written before a column
    was added read as nulls there: ``pyarrow.dataset.dataset(path, schema=
    sink.table_schema())``, or in Spark ``spark.read.option("mergeSchema", "true")``.
    ``schema_evolution="add_columns"`` adds new columns (a batch of a type narrower than
    the directory's is cast up); a wider type is refused, since Spark cannot read Parquet
    files holding one column in two types.

    No table maintenance (``maintain`` does nothing): readers list the directory, so a
    compaction cannot swap small files for a large one atomically, and a reader between
    the steps would count rows twice or miss them. Each writer writes at least one file
    per epoch it received rows in (more past ``max_file_bytes``): the files grow with
    the epochs, by ``writers`` per epoch. For a long stream of small epochs make epochs
    larger and writers fewer, or use ``DeltaSink``/``IcebergSink``, which compact
    (``docs/maintenance.md``).
    """

    kind = "parquet"

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        compression: Compression = "zstd",
        row_group_size: int = 131_072,
        max_file_bytes: int = 128 * 1024 * 1024,
        schema: pa.Schema | None = None,
        schema_evolution: _schema.SchemaEvolution = "fail",
    ) -> None:
        self._path = _check_path(path)
        self.schema_evolution = _schema.check_evolution_option("ParquetSink", schema_evolution)
        self._compression: Compression = _check_choice("compression", compression)
        self._row_group_size = _check_positive("row_group_size", row_group_size)
        self._max_file_bytes = _check_positive("max_file_bytes", max_file_bytes)
        if schema is not None and not isinstance(schema, pa.Schema):
            raise ConfigError(f"ParquetSink schema must be a pyarrow.Schema, got {schema!r}")
        self._schema = schema
        self._unpruned = _PRUNE_EVERY  # commits since the log was pruned: prune at the first

    # options -------------------------------------------------------------------------
    @property
    def path(self) -> str:
        return self._path

    @property
    def compression(self) -> Compression:
        return self._compression

    @property
    def row_group_size(self) -> int:
        return self._row_group_size

    @property
    def max_file_bytes(self) -> int:
        return self._max_file_bytes

    @property
    def schema(self) -> pa.Schema | None:
        return self._schema

    @property
    def layout(self) -> Layout:
        return Layout(Path(self._path))

    @property
    def _log(self) -> CommitLog:
        return CommitLog(self.layout)

    def describe(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "path": self._path,
            "compression": self._compression,
            "row_group_size": self._row_group_size,
            "max_file_bytes": self._max_file_bytes,
            "schema": None if self._schema is None else self._schema.names,
            "schema_evolution": self.schema_evolution,
        }

    def evolution_rules(self) -> _schema.Rules:
        """Arrow's own types; no widening (Spark's ``mergeSchema`` refuses a column held
        as int32 in one file and int64 in another)."""
        return _schema.Rules(
            target=f"the Parquet directory {self._path!r}",
            refuses_widening="Spark cannot read one column written in two types in one "
                             "Parquet directory")

    def table_schema(self) -> pa.Schema | None:
        """The directory's schema: the newest readable commit log entry's (every entry
        records the schema after its epoch, ``null`` while no epoch had one), else the
        ``schema`` option, else ``None``. One entry read, not the whole log: this runs in
        every commit."""
        for epoch in sorted(self._log.epochs(), reverse=True):
            try:
                text = self._read_commit_entry(epoch).get("schema")
            except SinkUnavailableError:
                continue  # pruned meanwhile, or unreadable: an older entry tells
            return self._schema if text is None else _schema.decode(text)
        return self._schema

    def _error_fields(self, epoch: int | None = None) -> dict[str, Any]:
        return {"runtime": self.runtime or None, "sink": self.name or None, "epoch": epoch}

    # validate ------------------------------------------------------------------------
    def validate(self) -> None:
        """Check that the directory can be ours. Creates nothing, changes nothing."""
        root = Path(self._path)
        if root.exists() or root.is_symlink():
            self._validate_existing(root)
        else:
            self._validate_creatable(root)

    def _unavailable(self, message: str) -> SinkUnavailableError:
        return SinkUnavailableError(message, **self._error_fields())

    def _validate_existing(self, root: Path) -> None:
        if not root.is_dir():
            raise self._unavailable(f"path {str(root)!r} is a file; give a directory")
        if not os.access(root, os.W_OK | os.X_OK):
            raise self._unavailable(f"directory {str(root)!r} is not writable")
        meta = self.layout.meta
        if meta.exists() and not meta.is_dir():
            raise self._unavailable(f"{str(meta)!r} is a file; raysink keeps its log there")
        first_parquet = self._check_foreign_content(root)
        self._check_owner()
        if self._schema is not None and first_parquet is not None:
            self._check_target_schema(first_parquet)

    def _check_foreign_content(self, root: Path) -> Path | None:
        """Refuse directories holding anything but flat Parquet files; return one of them."""
        first: Path | None = None
        for entry in sorted(os.scandir(root), key=lambda e: e.name):
            if entry.name == "_delta_log":
                raise self._unavailable(
                    f"{str(root)!r} holds a Delta table; use DeltaSink or give another path")
            if entry.name.startswith(("_", ".")):
                continue
            if entry.is_dir() or not entry.name.endswith(".parquet"):
                raise self._unavailable(
                    f"{str(root)!r} holds {entry.name!r}, which is not a Parquet file written "
                    "beside ours (a partitioned, Iceberg or foreign dataset?); give an empty "
                    "directory or one of flat Parquet files")
            first = first or Path(entry.path)
        return first

    def _check_owner(self) -> None:
        """The directory's commit log must belong to this runtime's sink (when bound)."""
        latest = self.committed_epoch()
        if latest is None or not self.runtime:
            return
        entry = self._read_commit_entry(latest)
        owner = (entry.get("runtime"), entry.get("sink"))
        if owner != (self.runtime, self.name):
            raise self._unavailable(
                f"{self._path!r} is committed to by runtime {owner[0]!r} sink {owner[1]!r}; "
                "give another path (its epochs would be skipped as already committed)")

    def _check_target_schema(self, sample: Path) -> None:
        assert self._schema is not None
        diffs = _schema.differences(self._schema, pq.read_schema(sample))
        if diffs:
            raise SchemaMismatchError(
                f"the files in {self._path!r} differ from the given schema: "
                f"{'; '.join(diffs)}; give a matching schema or another path",
                **self._error_fields())

    def _validate_creatable(self, root: Path) -> None:
        ancestor = root.parent
        while not (ancestor.exists() or ancestor.is_symlink()):
            ancestor = ancestor.parent
        if not ancestor.is_dir():
            raise self._unavailable(
                f"cannot create {str(root)!r}: {str(ancestor)!r} is a file; give a directory")
        if not os.access(ancestor, os.W_OK | os.X_OK):
            raise self._unavailable(
                f"cannot create {str(root)!r}: {str(ancestor)!r} is not writable")

    # writers -------------------------------------------------------------------------
    def create_writer(self, writer_id: int) -> ParquetSinkWriter:
        if writer_id < 0:
            raise ConfigError(f"writer_id must be >= 0, got {writer_id!r}")
        return ParquetSinkWriter(self, writer_id)

    # commit --------------------------------------------------------------------------
    def commit(self, epoch: int, manifests: Sequence[Manifest]) -> CommitResult:
        """Move the epoch's staged files into place and write its commit log entry.

        Idempotent and safe to re-run after a crash at any point: with the entry present
        only the staging is swept (``ALREADY``); moved files are skipped.
        """
        entries = staged_entries(self.layout, epoch, manifests, self._error_fields(epoch))
        result = CommitResult.ALREADY
        if not self._is_committed(epoch):
            decision = decision_id(epoch, manifests)
            if not self._claim(epoch, decision):
                for entry in entries:  # this decision's, never moved: another one holds it
                    entry.staged.unlink(missing_ok=True)
                return CommitResult.ALREADY
            schema = self._epoch_schema(epoch, manifests, entries)
            moved = move_into_place(self.layout.root, entries, schema,
                                    compression=self._compression,
                                    row_group_size=self._row_group_size,
                                    where=self._error_fields(epoch))
            hit("sink.mid_commit", runtime=self.runtime, sink=self.name, epoch=epoch)
            self._write_commit_entry(epoch, moved,
                                     None if schema is None else _schema.encode(schema),
                                     decision=decision)
            self._log.release(epoch)
            self._unpruned += 1
            if self._unpruned >= _PRUNE_EVERY:
                self._log.prune(COMMIT_LOG_KEEP)
                self._unpruned = 0
            logger.debug("parquet sink %r committed epoch %d (%d files)",
                         self.name, epoch, len(moved))
            result = CommitResult.COMMITTED
        rmtree(self.layout.epoch_dir(epoch))
        return result

    def _claim(self, epoch: int, decision: str) -> bool:
        """Claim ``epoch`` for ``decision``; ``False`` when another decision holds it."""
        holder = self._log.claim(epoch, decision)
        if holder == decision:
            return True
        logger.warning("parquet sink %r: epoch %d is claimed by another decision (%s): this "
                       "one's rows are not written", self.name, epoch, holder)
        return False

    def holds_decision(self, epoch: int, manifests: Sequence[Manifest]) -> bool | None:
        """Whether the commit log entry of ``epoch`` (or its claim, while its commit is
        under way) names the decision ``manifests``; ``None`` when neither is there or
        names one (an entry pruned, re-created, or written by an older raysink)."""
        found = self._log.decision(epoch)
        return None if found is None else found == decision_id(epoch, manifests)

    def _epoch_schema(self, epoch: int, manifests: Sequence[Manifest],
                      entries: Sequence[StagedEntry]) -> pa.Schema | None:
        """The directory's schema after ``epoch``: its writers' schemas (the union, with
        ``add_columns``) evolving the directory's. The same on a re-run after a crash (the
        log entry is written last)."""
        current = self.table_schema()
        schemas = _schema.reported(manifests)
        schemas += [e.schema for e in entries if e.schema is not None]
        if not schemas:
            return current
        if self.schema_evolution != "add_columns":
            return current if current is not None else schemas[0]
        epoch_schema = _schema.union(schemas)
        if current is None:
            return epoch_schema
        return _schema.evolve(current, epoch_schema, self.evolution_rules(),
                              where=self._error_fields(epoch)).schema

    def _is_committed(self, epoch: int) -> bool:
        if self._log.has(epoch):
            return True
        latest = self.committed_epoch()  # its own entry may have been pruned
        return latest is not None and latest >= epoch

    def _write_commit_entry(
        self, epoch: int, files: list[dict[str, Any]], schema: str | None, **extra: Any
    ) -> None:
        self._log.write(epoch, files, schema, runtime=self.runtime, sink=self.name, **extra)

    def _read_commit_entry(self, epoch: int) -> dict[str, Any]:
        try:
            return self._log.read(epoch)
        except (OSError, ValueError) as exc:
            raise self._unavailable(
                f"commit log entry of epoch {epoch} in {self._path!r} is unreadable: {exc}"
            ) from exc

    # abort ---------------------------------------------------------------------------
    def abort(self, epoch: int, manifests: Sequence[Manifest] | None) -> None:
        """Delete staged files of ``epoch``: those listed, or with ``None`` the whole
        ``staging/<epoch>``. Idempotent; committed files are never touched."""
        if manifests is None:
            rmtree(self.layout.epoch_dir(epoch))
            return
        for entry in staged_entries(self.layout, epoch, manifests, self._error_fields(epoch)):
            entry.staged.unlink(missing_ok=True)
            rmdir_if_empty(entry.staged.parent, entry.staged.parent.parent)

    # markers -------------------------------------------------------------------------
    def committed_epoch(self) -> int | None:
        """The highest epoch with a commit log entry; ``None`` when the directory, the log or
        every entry is missing; ``NewerVersionError`` when a newer raysink wrote it."""
        return self._log.newest(runtime=self.runtime or None, sink=self.name or None)

    def target_exists(self) -> bool:
        """Whether the directory exists (probed by the coordinator before it re-creates a
        missing marker: a missing directory after commits is a deleted table)."""
        return self.layout.root.is_dir()

    def recreate_marker(self, epoch: int) -> None:
        """Re-create the commit log entry of ``epoch`` (its files are not listed).

        Raises ``DataLossError`` when the whole directory is gone: that is a deleted table,
        not a deleted marker, and re-creating the marker would hide it.
        """
        if not self.target_exists():
            raise DataLossError(
                f"directory {self._path!r} was deleted after raysink committed epoch "
                f"{epoch} to it; restore it, or give a new path", **self._error_fields(epoch))
        if not self._log.has(epoch):
            schema = self.table_schema()
            self._write_commit_entry(epoch, [], None if schema is None
                                     else _schema.encode(schema), recreated=True)


def _check_path(path: str | os.PathLike[str]) -> str:
    text = os.fspath(path)
    if not isinstance(text, str) or not text:
        raise ConfigError(f"ParquetSink path must be a non-empty str or path, got {path!r}")
    if text.startswith("file://"):
        text = text[len("file://"):]
    elif "://" in text:
        raise ConfigError(
            f"ParquetSink writes to local or mounted filesystems only, got {text!r}; "
            "use DeltaSink or IcebergSink for object stores")
    return os.path.abspath(text)


def _check_choice(option: str, value: Any) -> Compression:
    if value not in _COMPRESSIONS:
        raise ConfigError(f"ParquetSink {option} must be one of {_COMPRESSIONS}, got {value!r}")
    result: Compression = value
    return result


def _check_positive(option: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"ParquetSink {option} must be a positive int, got {value!r}")
    return value

