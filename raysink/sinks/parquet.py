"""A plain Parquet directory: the embedded default sink.

Layout of one sink directory (it belongs to one runtime's sink)::

    <path>/
      part-e000000000012-a0001-w0003-<uuid>.parquet      committed data: what readers see
      _raysink/
        staging/
          _writing/w0003-<session>/<uuid>.parquet         flushed, not yet pre-committed
          000000000012/0001/e000000000012-a0001-w0003-<uuid>.parquet    pre-committed
        commits/000000000012.json                          commit log entry: the marker
        commits/000000000013.claim -> <decision>           a commit under way (see commit)

``pyarrow.dataset`` and Spark skip names starting with ``_`` or ``.``, so ``_raysink`` and
temporary files (``.<name>.tmp``) are never read as data.

Writer side (``ParquetSinkWriter``): batches are buffered up to ``row_group_size`` rows and
written with ``pyarrow.parquet.ParquetWriter``; a file rolls once it reaches
``max_file_bytes``. ``flush`` closes the current file: a file is written under a temporary
name, fsynced and renamed, so a flushed file is complete or absent. ``pre_commit`` renames
the flushed files into ``staging/<epoch>/<attempt>/`` (deterministic names from
``staged_name``) and describes them in the manifest::

    {"writer": 3, "epoch": 12, "attempt": 1,
     "files": [{"path": "_raysink/staging/000000000012/0001/e...-<uuid>.parquet",
                "rows": 1000, "bytes": 5120}],
     "rows": 1000, "bytes": 5120,
     "schema": "<base64 of the Arrow IPC schema>" | null}

Paths are relative to the sink directory and must name a file directly inside
``_raysink/staging/<epoch>/<attempt>/``; anything else is refused with ``MetaStoreError``
and never followed.

Coordinator side (``ParquetSink``):

* ``commit(epoch, manifests)`` first claims the epoch for its decision
  (``commits/<epoch>.claim``, a symbolic link created exclusively, its directory fsynced:
  ``raysink.sinks._claims``), renames
  every staged file to ``part-<staged name>`` in the directory, fsyncs it, writes the
  commit log entry (temporary file, fsync, rename, fsync; it names the decision), drops
  the claim, then removes the epoch's staging. Idempotent: with the entry present (or a
  newer one: older entries are pruned) only the staging is swept; a file already moved is
  skipped; a staged file missing without its final file is a ``DataLossError``. A re-run
  after a crash at any step converges (it finds its own claim). A commit that finds
  another decision's claim (another driver of the runtime, with a meta store of its own,
  committing the same epoch) moves nothing, drops its own staged files and returns
  ``ALREADY``: two decisions of one epoch never both land. ``holds_decision`` tells them apart.
* ``abort(epoch, manifests)`` deletes the listed staged files (``None``: the whole
  ``staging/<epoch>``); idempotent; never touches committed files.
* The commit log keeps the newest ``COMMIT_LOG_KEEP`` entries (older ones are deleted
  after each commit): the newest is the marker, the others help a person see what the
  last epochs wrote. A stream of many small epochs keeps a bounded directory.
* ``committed_epoch()`` is the highest epoch with a commit log entry. It is ``None`` when
  the directory, ``_raysink/commits`` or every entry is missing. The coordinator compares it
  with the meta store: behind it with ``target_exists()`` true, the marker was lost and is
  re-created (``recreate_marker``); with the directory gone, the table was lost
  (``DataLossError``).

A plain directory has no atomic multi-file commit: files appear one rename at a time, so a
crash in the middle of ``commit`` shows part of an epoch until the roll-forward re-runs
it. Use ``DeltaSink`` or ``IcebergSink`` where readers need atomic visibility.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import IO, Any, Literal, TypeVar

import pyarrow as pa
import pyarrow.parquet as pq

from raysink import _schema
from raysink._faults import hit
from raysink.errors import (
    ConfigError,
    DataLossError,
    MetaStoreError,
    SchemaMismatchError,
    SinkUnavailableError,
)
from raysink.sinks._claims import claim, claimant
from raysink.sinks._staging import dictionary_columns
from raysink.sinks.base import (
    CommitResult,
    Manifest,
    Sink,
    SinkWriter,
    decision_id,
    staged_name,
)

__all__ = ["ParquetSink", "ParquetSinkWriter"]

logger = logging.getLogger(__name__)

Compression = Literal["zstd", "snappy", "gzip", "brotli", "lz4", "none"]
_COMPRESSIONS = ("zstd", "snappy", "gzip", "brotli", "lz4", "none")
_COMMIT_ENTRY = re.compile(r"(\d{12})\.json")
COMMIT_LOG_KEEP = 100
"""Commit log entries kept per sink directory; older ones are pruned (at every
``_PRUNE_EVERY``-th epoch, so at most ``COMMIT_LOG_KEEP + _PRUNE_EVERY`` remain)."""
_PRUNE_EVERY = 32
_PS = TypeVar("_PS", bound="ParquetSink")


# --------------------------------------------------------------------------- filesystem


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _makedirs(path: Path) -> None:
    """``mkdir -p`` that fsyncs the parent of every directory it creates."""
    missing: list[Path] = []
    probe = path
    while not probe.is_dir():
        missing.append(probe)
        probe = probe.parent
    for directory in reversed(missing):
        try:
            directory.mkdir()
        except FileExistsError:
            if not directory.is_dir():
                raise
        _fsync_dir(directory.parent)


def _atomic_write_text(path: Path, text: str) -> None:
    """Write ``path`` durably: temporary file, fsync, rename, fsync of the directory."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _rmtree(path: Path) -> None:
    """Remove a directory tree; a tree already (partly) gone is fine."""
    with contextlib.suppress(FileNotFoundError):
        shutil.rmtree(path)


def _rmdir_if_empty(*paths: Path) -> None:
    for path in paths:
        try:
            path.rmdir()
        except OSError:
            return


# --------------------------------------------------------------------------- schemas


# --------------------------------------------------------------------------- layout


@dataclass(frozen=True, slots=True)
class _Layout:
    """Where everything of one sink directory lives."""

    root: Path

    @property
    def meta(self) -> Path:
        return self.root / "_raysink"

    @property
    def staging(self) -> Path:
        return self.meta / "staging"

    @property
    def commits(self) -> Path:
        return self.meta / "commits"

    @property
    def writing(self) -> Path:
        return self.staging / "_writing"

    def epoch_dir(self, epoch: int) -> Path:
        return self.staging / f"{epoch:012d}"

    def attempt_dir(self, epoch: int, attempt: int) -> Path:
        return self.epoch_dir(epoch) / f"{attempt:04d}"

    def commit_entry(self, epoch: int) -> Path:
        return self.commits / f"{epoch:012d}.json"

    def claim(self, epoch: int) -> Path:
        return self.commits / f"{epoch:012d}.claim"


@dataclass(frozen=True, slots=True)
class _StagedEntry:
    """One validated manifest file entry, and the schema its file was written in."""

    staged: Path
    rows: int
    size: int
    schema: pa.Schema | None = None

    @property
    def final_name(self) -> str:
        return f"part-{self.staged.name}"


# --------------------------------------------------------------------------- the sink


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
    def layout(self) -> _Layout:
        return _Layout(Path(self._path))

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
        for epoch in sorted(self._logged_epochs(), reverse=True):
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
        entries = self._staged_entries(epoch, manifests)
        result = CommitResult.ALREADY
        if not self._is_committed(epoch):
            decision = decision_id(epoch, manifests)
            if not self._claim(epoch, decision):
                for entry in entries:  # this decision's, never moved: another one holds it
                    entry.staged.unlink(missing_ok=True)
                return CommitResult.ALREADY
            schema = self._epoch_schema(epoch, manifests, entries)
            moved = self._move_into_place(epoch, entries, schema)
            hit("sink.mid_commit", runtime=self.runtime, sink=self.name, epoch=epoch)
            self._write_commit_entry(epoch, moved,
                                     None if schema is None else _schema.encode(schema),
                                     decision=decision)
            self.layout.claim(epoch).unlink(missing_ok=True)
            self._unpruned += 1
            if self._unpruned >= _PRUNE_EVERY:
                self._prune_commit_log()
            logger.debug("parquet sink %r committed epoch %d (%d files)",
                         self.name, epoch, len(moved))
            result = CommitResult.COMMITTED
        _rmtree(self.layout.epoch_dir(epoch))
        return result

    def _claim(self, epoch: int, decision: str) -> bool:
        """Claim ``epoch`` for ``decision``; ``False`` when another decision holds it."""
        _makedirs(self.layout.commits)
        holder = claim(self.layout.claim(epoch), decision)
        if holder == decision:
            return True
        logger.warning("parquet sink %r: epoch %d is claimed by another decision (%s): this "
                       "one's rows are not written", self.name, epoch, holder)
        return False

    def holds_decision(self, epoch: int, manifests: Sequence[Manifest]) -> bool | None:
        """Whether the commit log entry of ``epoch`` (or its claim, while its commit is
        under way) names the decision ``manifests``; ``None`` when neither is there or
        names one (an entry pruned, re-created, or written by an older raysink)."""
        decision = decision_id(epoch, manifests)
        try:
            found = json.loads(self.layout.commit_entry(epoch).read_text()).get("decision")
        except (OSError, ValueError, AttributeError):
            found = None
        found = found or claimant(self.layout.claim(epoch))
        return None if found is None else bool(found == decision)

    def _epoch_schema(self, epoch: int, manifests: Sequence[Manifest],
                      entries: Sequence[_StagedEntry]) -> pa.Schema | None:
        """The directory's schema after ``epoch``: its writers' schemas (the union, with
        ``add_columns``) evolving the directory's. The same on a re-run after a crash (the
        log entry is written last)."""
        current = self.table_schema()
        schemas = [_schema.decode(text) for m in manifests
                   if isinstance(text := m.get("schema"), str)]
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
        if self.layout.commit_entry(epoch).exists():
            return True
        latest = self.committed_epoch()  # its own entry may have been pruned
        return latest is not None and latest >= epoch

    def _prune_commit_log(self) -> None:
        """Delete all but the newest ``COMMIT_LOG_KEEP`` entries (the newest is the marker),
        and the claims a crash left of epochs the marker holds."""
        epochs = sorted(self._logged_epochs())
        for old in epochs[:-COMMIT_LOG_KEEP]:
            self.layout.commit_entry(old).unlink(missing_ok=True)
        for path in self.layout.commits.glob("*.claim"):
            if epochs and path.stem.isdigit() and int(path.stem) <= epochs[-1]:
                path.unlink(missing_ok=True)
        self._unpruned = 0

    def _move_into_place(self, epoch: int, entries: list[_StagedEntry],
                         schema: pa.Schema | None) -> list[dict[str, Any]]:
        if not entries:  # an empty epoch: nothing to move, nothing to fsync
            return []
        root = self.layout.root
        _makedirs(root)
        moved = []
        for entry in entries:
            final = root / entry.final_name
            if final.exists():
                pass
            elif schema is not None and _needs_cast(entry.schema, schema):
                self._rewrite_staged(epoch, entry, final, schema)
            else:
                self._rename_staged(epoch, entry, final)
            moved.append({"path": entry.final_name, "rows": entry.rows, "bytes": entry.size})
        _fsync_dir(root)
        return moved

    def _rename_staged(self, epoch: int, entry: _StagedEntry, final: Path) -> None:
        try:
            os.replace(entry.staged, final)
        except FileNotFoundError as exc:
            raise self._staged_lost(epoch, entry, final) from exc

    def _rewrite_staged(self, epoch: int, entry: _StagedEntry, final: Path,
                        schema: pa.Schema) -> None:
        """Write a staged file whose column types are narrower than the directory's as
        ``final`` with them cast up (temporary file, fsync, rename), then drop it: every
        file of the directory holds a column in one type, as Spark needs."""
        try:
            table = pq.read_table(entry.staged)
        except FileNotFoundError as exc:
            raise self._staged_lost(epoch, entry, final) from exc
        cast = _schema.conform(table, schema)
        tmp = final.with_name(f".{final.name}.tmp")
        compression = None if self._compression == "none" else self._compression
        with open(tmp, "wb") as handle:
            pq.write_table(cast, handle, compression=compression,
                           row_group_size=self._row_group_size)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, final)
        entry.staged.unlink(missing_ok=True)

    def _staged_lost(self, epoch: int, entry: _StagedEntry, final: Path) -> DataLossError:
        return DataLossError(
            f"staged file {str(entry.staged)!r} is gone and was never moved to "
            f"{str(final)!r}; the epoch cannot be completed, restore the file or "
            "accept the loss", **self._error_fields(epoch))

    def _write_commit_entry(
        self, epoch: int, files: list[dict[str, Any]], schema: str | None, **extra: Any
    ) -> None:
        _makedirs(self.layout.commits)
        entry = {
            "epoch": epoch,
            "runtime": self.runtime,
            "sink": self.name,
            "files": files,
            "rows": sum(int(f["rows"]) for f in files),
            "schema": schema,
            "committed_at": time.time(),
            **extra,
        }
        _atomic_write_text(self.layout.commit_entry(epoch), json.dumps(entry, sort_keys=True))

    def _read_commit_entry(self, epoch: int) -> dict[str, Any]:
        try:
            entry: dict[str, Any] = json.loads(self.layout.commit_entry(epoch).read_text())
        except (OSError, ValueError) as exc:
            raise self._unavailable(
                f"commit log entry of epoch {epoch} in {self._path!r} is unreadable: {exc}"
            ) from exc
        return entry

    # abort ---------------------------------------------------------------------------
    def abort(self, epoch: int, manifests: Sequence[Manifest] | None) -> None:
        """Delete staged files of ``epoch``: those listed, or with ``None`` the whole
        ``staging/<epoch>``. Idempotent; committed files are never touched."""
        if manifests is None:
            _rmtree(self.layout.epoch_dir(epoch))
            return
        for entry in self._staged_entries(epoch, manifests):
            entry.staged.unlink(missing_ok=True)
            _rmdir_if_empty(entry.staged.parent, entry.staged.parent.parent)

    # markers -------------------------------------------------------------------------
    def committed_epoch(self) -> int | None:
        """The highest epoch with a commit log entry; ``None`` when the directory, the log or
        every entry is missing."""
        return max(self._logged_epochs(), default=None)

    def _logged_epochs(self) -> list[int]:
        """The epochs of the commit log's entries (a bounded list: it is pruned)."""
        try:
            names = os.listdir(self.layout.commits)
        except (FileNotFoundError, NotADirectoryError):
            return []
        return [int(found.group(1)) for found in map(_COMMIT_ENTRY.fullmatch, names) if found]

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
        if not self.layout.commit_entry(epoch).exists():
            schema = self.table_schema()
            self._write_commit_entry(epoch, [], None if schema is None
                                     else _schema.encode(schema), recreated=True)

    # manifests -----------------------------------------------------------------------
    def _staged_entries(self, epoch: int, manifests: Sequence[Manifest]) -> list[_StagedEntry]:
        """Validate every manifest entry of ``epoch``; refuse any path escaping staging."""
        entries: list[_StagedEntry] = []
        for manifest in manifests:
            files = manifest.get("files", []) if isinstance(manifest, Mapping) else None
            if not isinstance(files, list):
                raise self._refused(epoch, f"manifest {manifest!r} has no file list")
            schema = manifest.get("schema")
            entries.extend(self._staged_entry(epoch, item, schema) for item in files)
        return entries

    def _staged_entry(self, epoch: int, item: Any, schema: Any) -> _StagedEntry:
        if not isinstance(item, Mapping) or not isinstance(item.get("path"), str):
            raise self._refused(epoch, f"manifest entry {item!r} names no path")
        staged = self._resolve_staged(epoch, item["path"])
        text = item.get("schema", schema)  # a file of another schema than its writer's
        return _StagedEntry(staged, int(item.get("rows", 0)), int(item.get("bytes", 0)),
                            _schema.decode(text) if isinstance(text, str) else None)

    def _resolve_staged(self, epoch: int, relative: str) -> Path:
        epoch_dir = self.layout.epoch_dir(epoch)
        pure = PurePosixPath(relative)
        if pure.is_absolute() or ".." in pure.parts or "\\" in relative:
            raise self._refused(epoch, f"manifest path {relative!r} escapes {str(epoch_dir)!r}")
        path = self.layout.root.joinpath(*pure.parts)
        inside = path.parent.parent == epoch_dir and path.suffix == ".parquet"
        real = Path(os.path.realpath(path))
        if not inside or real.parent.parent != Path(os.path.realpath(epoch_dir)):
            raise self._refused(
                epoch, f"manifest path {relative!r} is not a staged file of {str(epoch_dir)!r}")
        return path

    def _refused(self, epoch: int, message: str) -> MetaStoreError:
        return MetaStoreError(f"{message}; refused, not followed", **self._error_fields(epoch))


def _needs_cast(written: pa.Schema | None, schema: pa.Schema) -> bool:
    """Whether a file written in ``written`` holds a column in a type narrower than the
    directory's ``schema`` (it is then rewritten cast up)."""
    return written is not None and not _schema.conformed(written, schema).equals(written)


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


# --------------------------------------------------------------------------- the writer


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
                    _rmtree(old)
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
        _makedirs(self._writing_dir)
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
        _fsync_dir(current.final.parent)
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
        manifest: Manifest = {
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
        _makedirs(target)
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
        _fsync_dir(target)
        _fsync_dir(self._writing_dir)
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
            _rmdir_if_empty(target, target.parent)

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
        _rmtree(self._writing_dir)
