"""A decision's claim of an epoch, as one file created exclusively (``ParquetSink``).

Where making an epoch visible takes several steps (a directory's renames), two commits of
the same epoch from different decisions (two drivers with meta stores of their own) could
both move their data in. So a commit first claims the epoch: it writes the claim under a
name of its own (fsynced), then ``os.link``s it to the epoch's claim name, which fails
when the name exists: of two claims exactly one is created, whole, and the loser reads
whose it is. A decision re-running its commit (after a crash) finds its own claim.
"""

from __future__ import annotations

import contextlib
import json
import os
import uuid
from pathlib import Path
from typing import Any

__all__ = ["claim"]


def claim(path: Path, body: dict[str, Any]) -> dict[str, Any]:
    """Create ``path`` holding ``body`` unless it exists; returns the claim ``path`` holds
    afterwards (``body``, or the earlier claim that won)."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    with open(tmp, "w", encoding="utf-8") as handle:
        json.dump(body, handle, sort_keys=True)
        handle.flush()
        os.fsync(handle.fileno())
    try:
        os.link(tmp, path)
    except FileExistsError:
        found: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
        return found
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return body
