"""Where everything of one Parquet sink directory lives (``Layout``), and the staged
files an epoch's manifests name, each checked to be a file of the epoch's staging before
anything follows it (``staged_entries``)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import pyarrow as pa

from raysink import _schema
from raysink.errors import MetaStoreError
from raysink.sinks.base import Manifest

__all__ = ["Layout", "StagedEntry", "rmdir_if_empty", "staged_entries"]


@dataclass(frozen=True, slots=True)
class Layout:
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
class StagedEntry:
    """One validated manifest file entry, and the schema its file was written in."""

    staged: Path
    rows: int
    size: int
    schema: pa.Schema | None = None

    @property
    def final_name(self) -> str:
        return f"part-{self.staged.name}"


def rmdir_if_empty(*paths: Path) -> None:
    """Remove each of ``paths`` in turn while it is an empty directory."""
    for path in paths:
        try:
            path.rmdir()
        except OSError:
            return


def staged_entries(layout: Layout, epoch: int, manifests: Sequence[Manifest],
                   where: Mapping[str, Any]) -> list[StagedEntry]:
    """Validate every manifest entry of ``epoch``; refuse any path escaping staging
    (``MetaStoreError`` with ``where``: runtime, sink, epoch)."""
    entries: list[StagedEntry] = []
    for manifest in manifests:
        files = manifest.get("files", []) if isinstance(manifest, Mapping) else None
        if not isinstance(files, list):
            raise _refused(f"manifest {manifest!r} has no file list", where)
        schema = manifest.get("schema")
        entries.extend(_staged_entry(layout, epoch, item, schema, where) for item in files)
    return entries


def _staged_entry(layout: Layout, epoch: int, item: Any, schema: Any,
                  where: Mapping[str, Any]) -> StagedEntry:
    if not isinstance(item, Mapping) or not isinstance(item.get("path"), str):
        raise _refused(f"manifest entry {item!r} names no path", where)
    staged = _resolve_staged(layout, epoch, item["path"], where)
    text = item.get("schema", schema)  # a file of another schema than its writer's
    return StagedEntry(staged, int(item.get("rows", 0)), int(item.get("bytes", 0)),
                       _schema.decode(text) if isinstance(text, str) else None)


def _resolve_staged(layout: Layout, epoch: int, relative: str,
                    where: Mapping[str, Any]) -> Path:
    epoch_dir = layout.epoch_dir(epoch)
    pure = PurePosixPath(relative)
    if pure.is_absolute() or ".." in pure.parts or "\\" in relative:
        raise _refused(f"manifest path {relative!r} escapes {str(epoch_dir)!r}", where)
    path = layout.root.joinpath(*pure.parts)
    inside = path.parent.parent == epoch_dir and path.suffix == ".parquet"
    real = Path(os.path.realpath(path))
    if not inside or real.parent.parent != Path(os.path.realpath(epoch_dir)):
        raise _refused(
            f"manifest path {relative!r} is not a staged file of {str(epoch_dir)!r}", where)
    return path


def _refused(message: str, where: Mapping[str, Any]) -> MetaStoreError:
    return MetaStoreError(f"{message}; refused, not followed", **where)
