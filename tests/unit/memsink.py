"""An in-process sink for state-machine tests: staged and visible rows in plain dicts.

Visible rows remember the ``(epoch, attempt)`` they came from, so tests can prove that an
epoch is visible exactly once and only from the attempt that was decided.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import pyarrow as pa

from raysink.sinks.base import CommitResult, Manifest, Sink, SinkWriter


@dataclass
class MemoryTarget:
    """What survives a coordinator crash: the target's staged and visible data."""

    staged: dict[tuple[int, int, int], list[int]] = field(default_factory=dict)
    visible: list[tuple[int, int, int]] = field(default_factory=list)  # (epoch, attempt, row)
    marker: int | None = None
    fail_commits: int = 0
    fail_after_commits: int = 0  # commits that land, then fail on the client's side
    fail_aborts: int = 0  # sweeps refused (the target unreachable)
    commits: int = 0
    exists: bool = True  # False: created by the first commit that carries rows
    unreachable: bool = False  # True: reading the marker fails (the target is down)


class MemoryWriter(SinkWriter):
    def __init__(self, target: MemoryTarget, writer_id: int) -> None:
        self.target = target
        self.writer_id = writer_id
        self.buffer: list[int] = []

    def write(self, batch: pa.RecordBatch) -> None:
        self.buffer.extend(batch.column(0).to_pylist())

    def pre_commit(self, epoch: int, attempt: int) -> Manifest:
        self.target.staged[(epoch, attempt, self.writer_id)] = list(self.buffer)
        rows = len(self.buffer)
        self.buffer.clear()
        return {"epoch": epoch, "attempt": attempt, "writer": self.writer_id, "rows": rows}

    def rollback(self, epoch: int, attempt: int) -> None:
        self.buffer.clear()
        self.target.staged.pop((epoch, attempt, self.writer_id), None)


class MemorySink(Sink):
    kind = "memory"

    def __init__(self, target: MemoryTarget) -> None:
        self.target = target

    def validate(self) -> None:
        return None

    def create_writer(self, writer_id: int) -> MemoryWriter:
        return MemoryWriter(self.target, writer_id)

    def commit(self, epoch: int, manifests: Sequence[Manifest]) -> CommitResult:
        if self.target.fail_commits > 0:
            self.target.fail_commits -= 1
            raise ConnectionError("target refused the commit (injected)")
        if self.target.marker is not None and self.target.marker >= epoch:
            return CommitResult.ALREADY
        if not self.target.exists:
            if not any(m["rows"] for m in manifests):
                return CommitResult.NO_TARGET  # nothing to create it with: no marker either
            self.target.exists = True
        for manifest in manifests:
            key = (epoch, int(manifest["attempt"]), int(manifest["writer"]))
            rows = self.target.staged.pop(key)
            self.target.visible.extend((epoch, key[1], row) for row in rows)
        self.target.marker = epoch
        self.target.commits += 1
        if self.target.fail_after_commits > 0:
            self.target.fail_after_commits -= 1
            raise ConnectionError("the commit landed, its answer was lost (injected)")
        return CommitResult.COMMITTED

    def abort(self, epoch: int, manifests: Sequence[Manifest] | None) -> None:
        if self.target.fail_aborts > 0:
            self.target.fail_aborts -= 1
            raise ConnectionError("target refused the sweep (injected)")
        for key in [k for k in self.target.staged if k[0] == epoch]:
            del self.target.staged[key]

    def committed_epoch(self) -> int | None:
        if self.target.unreachable:
            raise ConnectionError("target unreachable (injected)")
        return self.target.marker

    def holds_decision(self, epoch: int, manifests: Sequence[Manifest]) -> bool | None:
        """Whether the epoch's visible rows came from the attempt ``manifests`` staged
        (``None``: no visible row of it to tell by)."""
        attempts = {a for e, a, _ in self.target.visible if e == epoch}
        if not attempts or not manifests:
            return None
        return attempts == {int(m["attempt"]) for m in manifests}

    def target_exists(self) -> bool:
        return self.target.exists

    def recreate_marker(self, epoch: int) -> None:
        self.target.marker = epoch

    def visible_epochs(self) -> list[int]:
        return sorted({e for e, _, _ in self.target.visible})
