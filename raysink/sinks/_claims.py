"""A decision's claim of an epoch, as one name created exclusively (``ParquetSink``).

Where making an epoch visible takes several steps (a directory's renames), two commits of
the same epoch from different decisions (two drivers with meta stores of their own) could
both move their data in. So a commit first claims the epoch: a symbolic link at the
epoch's claim name whose target is the decision (``decision_id``), created with
``os.symlink``, which fails when the name exists. Of two claims exactly one is created,
whole (the decision is the link itself: nothing is written before or after it), and the
loser reads whose it is. The claim is made durable (its directory fsynced) before any data
moves. A decision re-running its commit (after a crash) finds its own claim.
"""

from __future__ import annotations

import os
from pathlib import Path

from raysink.sinks._files import fsync_dir

__all__ = ["claim", "claimant"]


def claim(path: Path, decision: str) -> str:
    """Claim ``path`` for ``decision`` unless it is claimed already; returns the decision
    that holds it afterwards (``decision``, or the earlier claim's)."""
    try:
        os.symlink(decision, path)
    except FileExistsError:
        return os.readlink(path)
    fsync_dir(path.parent)
    return decision


def claimant(path: Path) -> str | None:
    """The decision that claimed ``path``, or ``None``."""
    try:
        return os.readlink(path)
    except (FileNotFoundError, OSError):
        return None
