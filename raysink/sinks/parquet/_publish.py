"""An epoch's staged files moved into the Parquet sink directory, where readers see them.

Each staged file becomes ``part-<staged name>`` beside the others: renamed, or, when it
holds a column in a type narrower than the directory's, written again cast up (every
file of the directory holds a column in one type, as Spark needs). A file already in
place is skipped, so a commit re-run after a crash converges; a staged file gone without
its final file is a ``DataLossError``. The directory is fsynced once every file is in.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from raysink import _schema
from raysink.errors import DataLossError
from raysink.sinks._files import fsync_dir, makedirs
from raysink.sinks.parquet._layout import StagedEntry

__all__ = ["move_into_place"]


def move_into_place(root: Path, entries: Sequence[StagedEntry], schema: pa.Schema | None, *,
                    compression: str, row_group_size: int,
                    where: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Move ``entries`` into ``root`` (cast up to ``schema`` where needed); the entries of
    the commit log that describe them."""
    if not entries:  # an empty epoch: nothing to move, nothing to fsync
        return []
    makedirs(root)
    moved = []
    for entry in entries:
        final = root / entry.final_name
        if final.exists():
            pass
        elif schema is not None and _needs_cast(entry.schema, schema):
            _rewrite(entry, final, schema, compression, row_group_size, where)
        else:
            _rename(entry, final, where)
        moved.append({"path": entry.final_name, "rows": entry.rows, "bytes": entry.size})
    fsync_dir(root)
    return moved


def _needs_cast(written: pa.Schema | None, schema: pa.Schema) -> bool:
    """Whether a file written in ``written`` holds a column in a type narrower than the
    directory's ``schema`` (it is then rewritten cast up)."""
    return written is not None and not _schema.conformed(written, schema).equals(written)


def _rename(entry: StagedEntry, final: Path, where: Mapping[str, Any]) -> None:
    try:
        os.replace(entry.staged, final)
    except FileNotFoundError as exc:
        raise _lost(entry, final, where) from exc


def _rewrite(entry: StagedEntry, final: Path, schema: pa.Schema, compression: str,
             row_group_size: int, where: Mapping[str, Any]) -> None:
    """Write a staged file whose column types are narrower than the directory's as
    ``final`` with them cast up (temporary file, fsync, rename), then drop it."""
    try:
        table = pq.read_table(entry.staged)
    except FileNotFoundError as exc:
        raise _lost(entry, final, where) from exc
    cast = _schema.conform(table, schema)
    tmp = final.with_name(f".{final.name}.tmp")
    with open(tmp, "wb") as handle:
        pq.write_table(cast, handle, compression=None if compression == "none" else compression,
                       row_group_size=row_group_size)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, final)
    entry.staged.unlink(missing_ok=True)


def _lost(entry: StagedEntry, final: Path, where: Mapping[str, Any]) -> DataLossError:
    return DataLossError(
        f"staged file {str(entry.staged)!r} is gone and was never moved to "
        f"{str(final)!r}; the epoch cannot be completed, restore the file or "
        "accept the loss", **where)
