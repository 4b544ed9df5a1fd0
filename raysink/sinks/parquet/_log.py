"""The commit log of a Parquet sink directory: one JSON entry per committed epoch under
``_raysink/commits/`` (the newest is the marker; each records the directory's schema
after its epoch, the decision that committed it and the entry's ``format``, none in
raysink 0.1.0's: ``raysink.sinks._format``), and the claims of epochs whose commit is
under way (``raysink.sinks._claims``)."""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass
from typing import Any

from raysink.sinks._claims import claim, claimant
from raysink.sinks._files import makedirs, write_durably
from raysink.sinks._format import MARKER_FORMAT, check_marker
from raysink.sinks.parquet._layout import Layout

__all__ = ["CommitLog"]

_COMMIT_ENTRY = re.compile(r"(\d{12})\.json")


@dataclass(frozen=True, slots=True)
class CommitLog:
    """The commit log of the directory ``layout`` describes."""

    layout: Layout

    def epochs(self) -> list[int]:
        """The epochs of the log's entries (a bounded list: it is pruned)."""
        try:
            names = os.listdir(self.layout.commits)
        except (FileNotFoundError, NotADirectoryError):
            return []
        return [int(found.group(1)) for found in map(_COMMIT_ENTRY.fullmatch, names) if found]

    def newest(self, *, runtime: str | None, sink: str | None) -> int | None:
        """The newest entry's epoch (the marker), its format checked (``check_marker``:
        none is raysink 0.1.0's format 1; a newer one is refused)."""
        epoch = max(self.epochs(), default=None)
        if epoch is not None:
            try:
                entry = self.read(epoch)
            except (OSError, ValueError):  # gone since listed, or being replaced
                entry = None
            check_marker(entry, runtime=runtime, sink=sink,
                         where=str(self.layout.commit_entry(epoch)))
        return epoch

    def has(self, epoch: int) -> bool:
        return self.layout.commit_entry(epoch).exists()

    def read(self, epoch: int) -> dict[str, Any]:
        """The entry of ``epoch``; ``OSError`` or ``ValueError`` when it is unreadable."""
        entry: dict[str, Any] = json.loads(self.layout.commit_entry(epoch).read_text())
        return entry

    def write(self, epoch: int, files: list[dict[str, Any]], schema: str | None,
              **fields: Any) -> None:
        """Write the entry of ``epoch`` durably (a temporary file a crash left is
        overwritten): its files, rows and schema, the time, and ``fields``."""
        makedirs(self.layout.commits)
        entry = {
            "epoch": epoch,
            "files": files,
            "rows": sum(int(f["rows"]) for f in files),
            "schema": schema,
            "committed_at": time.time(),
            "format": MARKER_FORMAT,
            **fields,
        }
        path = self.layout.commit_entry(epoch)
        write_durably(path, json.dumps(entry, sort_keys=True).encode(),
                      tmp=path.with_name(f".{path.name}.tmp"))

    def claim(self, epoch: int, decision: str) -> str:
        """Claim ``epoch`` for ``decision``; the decision that holds it afterwards."""
        makedirs(self.layout.commits)
        return claim(self.layout.claim(epoch), decision)

    def release(self, epoch: int) -> None:
        """Drop the claim of ``epoch`` (its entry is written)."""
        self.layout.claim(epoch).unlink(missing_ok=True)

    def decision(self, epoch: int) -> str | None:
        """The decision the entry of ``epoch`` names, else the one claiming it (its commit
        under way); ``None`` when neither is there or names one."""
        try:
            found = json.loads(self.layout.commit_entry(epoch).read_text()).get("decision")
        except (OSError, ValueError, AttributeError):
            found = None
        return str(found) if found else claimant(self.layout.claim(epoch))

    def prune(self, keep: int) -> None:
        """Delete all but the newest ``keep`` entries (the newest is the marker), and the
        claims a crash left of epochs the marker holds."""
        epochs = sorted(self.epochs())
        for old in epochs[:-keep]:
            self.layout.commit_entry(old).unlink(missing_ok=True)
        for path in self.layout.commits.glob("*.claim"):
            if epochs and path.stem.isdigit() and int(path.stem) <= epochs[-1]:
                path.unlink(missing_ok=True)
