"""Files as the file-based sinks stage and keep them: deterministic staged names, a
path-relative view of a ``pyarrow.fs`` filesystem (``FileStore``), and writes that
survive a machine crash once they return (``write_durably``, ``fsync_dir``,
``makedirs``).

A staged file of the table-format sinks is named
``<root>/<epoch:012d>/e<epoch>-a<attempt>-w<writer>-<uuid>-<n>.parquet``: the epoch's
directory holds every attempt's files, and the name alone says which epoch, attempt and
writer staged it (``STAGED_FILE``).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, cast

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from raysink.sinks.base import Manifest, staged_name

__all__ = [
    "STAGED_FILE",
    "FileStore",
    "FilesManifest",
    "epoch_dir",
    "files_manifests",
    "fsync_dir",
    "makedirs",
    "new_unique",
    "rmtree",
    "staged_file",
    "write_durably",
]

STAGED_FILE = re.compile(r"e(\d{12})-a(\d{4})-w(\d{4})-[0-9a-f]{32}-\d{4}\.parquet")
"""The base name of every staged file."""


class FilesManifest(Manifest, total=False):
    """What a writer of a file-based sink staged: its files (``path``, ``rows``, size...;
    a file's own ``schema``, encoded, when it is not the manifest's: its writer's batches
    changed schema within the epoch)."""

    files: list[dict[str, Any]]


def files_manifests(manifests: Sequence[Manifest] | None) -> Sequence[FilesManifest]:
    """The manifests the coordinator hands a file-based sink back, as its writers made
    them."""
    return cast("Sequence[FilesManifest]", manifests or ())


def epoch_dir(root: str, epoch: int) -> str:
    """The directory under ``root`` holding every file staged for ``epoch`` (all
    attempts); with ``root=""``, relative to the root."""
    return f"{root}/{epoch:012d}" if root else f"{epoch:012d}"


def staged_file(epoch: int, attempt: int, writer: int, unique: str, n: int) -> str:
    """Deterministic path, relative to its root, of the ``n``-th file one writer staged
    for an attempt."""
    return f"{epoch_dir('', epoch)}/{staged_name(epoch, attempt, writer, unique)}-{n:04d}.parquet"


def new_unique() -> str:
    """The uuid part of one pre-commit's staged names."""
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


# --------------------------------------------------------------------------- local files


def write_durably(path: Path, data: pa.Buffer | bytes, *, tmp: Path | None = None) -> None:
    """Write ``path`` whole or not at all: a temporary file (``tmp``, else a uniquely named
    one beside ``path``), fsync, rename into place, fsync of the directory. A fixed
    ``tmp`` is overwritten: what a crash left there goes with the next write."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = tmp or path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    with open(tmp, "wb") as out:
        out.write(memoryview(data))
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    """Make the entries of directory ``path`` (creations, renames, removals) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def makedirs(path: Path) -> None:
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
        fsync_dir(directory.parent)


def rmtree(path: Path) -> None:
    """Remove a directory tree; a tree already (partly) gone is fine."""
    with contextlib.suppress(FileNotFoundError):
        shutil.rmtree(path)
