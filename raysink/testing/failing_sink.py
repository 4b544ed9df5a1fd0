"""``FailingSink``: wraps any sink and injects failures (the n-th write, the first n
pre-commits, commits or aborts, stalled commits), counted across processes."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar

import pyarrow as pa

from raysink import _schema
from raysink._faults import (
    InjectedFault,
)
from raysink.errors import (
    ConfigError,
    SinkUnavailableError,
)
from raysink.sinks._files import write_durably
from raysink.sinks.base import CommitResult, Manifest, Sink, SinkWriter

_F = TypeVar("_F", bound="FailingSink")


class InjectedSinkFailure(InjectedFault):
    """Raised by ``FailingSink`` at an injected failure."""


class _Counters:
    """Call counters shared by every process that sees ``state_dir`` (flock-protected)."""

    def __init__(self, state_dir: Path) -> None:
        self._path = state_dir / "counters.json"
        self._lock = state_dir / "counters.lock"

    @contextlib.contextmanager
    def _locked(self) -> Iterator[dict[str, int]]:
        self._path.parent.mkdir(parents=True, exist_ok=True)
        with open(self._lock, "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield self._load()
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _load(self) -> dict[str, int]:
        try:
            counts: dict[str, int] = json.loads(self._path.read_text())
        except (FileNotFoundError, ValueError):
            counts = {}
        return counts

    def bump(self, key: str) -> int:
        """Count one call of ``key``; the new count (the first call is 1)."""
        with self._locked() as counts:
            counts[key] = counts.get(key, 0) + 1
            write_durably(self._path, json.dumps(counts).encode())
            return counts[key]

    def read(self) -> dict[str, int]:
        with self._locked() as counts:
            return counts


class FailingSink(Sink):
    """Wraps ``inner`` and injects failures, counting calls across processes.

    * ``fail_write_at=n``: the n-th ``write`` call (from 1, over all writers) raises.
    * ``fail_pre_commit_times=n``: the first n ``pre_commit`` calls raise, staging nothing.
    * ``fail_commit_times=n``: the first n ``commit`` calls raise; ``fail_commit_mode``
      ``"before"`` leaves the target untouched, ``"after"`` raises after the inner commit
      succeeded (a commit that failed on the client after reaching the target).
    * ``stall_commit_seconds``: commits sleep this long first (the first
      ``stall_commit_times`` of them, or every one when ``None``).
    * ``fail_abort_times=n``: the first n ``abort`` calls raise.
    * ``stall_flush_seconds``: writers' flushes sleep this long first (the first
      ``stall_flush_times`` of them, or every one when ``None``): a flush that hangs.
    * ``outage_file``: while this file exists the target is "down" for the operations in
      ``outage_ops`` (``"commit"``, ``"pre_commit"``, ``"write"``): they raise
      ``SinkUnavailableError``, as a real unreachable target does.

    Failures raise ``InjectedSinkFailure``. The kind, key, marker and schema evolution are
    the inner sink's, so a runtime may be reopened without the wrapper. ``counts()`` also
    counts the writers' ``close`` calls.
    """

    def __init__(
        self,
        inner: Sink,
        *,
        state_dir: str | os.PathLike[str],
        fail_write_at: int | None = None,
        fail_pre_commit_times: int = 0,
        fail_commit_times: int = 0,
        fail_commit_mode: Literal["before", "after"] = "before",
        stall_commit_seconds: float = 0.0,
        stall_commit_times: int | None = None,
        fail_abort_times: int = 0,
        stall_flush_seconds: float = 0.0,
        stall_flush_times: int | None = None,
        outage_file: str | os.PathLike[str] | None = None,
        outage_ops: Sequence[str] = ("commit",),
    ) -> None:
        if fail_write_at is not None and fail_write_at < 1:
            raise ConfigError(f"fail_write_at counts from 1, got {fail_write_at!r}")
        if fail_commit_mode not in ("before", "after"):
            raise ConfigError(f"fail_commit_mode must be 'before' or 'after', "
                              f"got {fail_commit_mode!r}")
        self._inner = inner
        self.kind = inner.kind
        self.schema_evolution = inner.schema_evolution
        self._state_dir = os.path.abspath(os.fspath(state_dir))
        self._fail_write_at = fail_write_at
        self._fail_pre_commit_times = fail_pre_commit_times
        self._fail_commit_times = fail_commit_times
        self._fail_commit_mode = fail_commit_mode
        self._stall_commit_seconds = stall_commit_seconds
        self._stall_commit_times = stall_commit_times
        self._fail_abort_times = fail_abort_times
        self._stall_flush_seconds = stall_flush_seconds
        self._stall_flush_times = stall_flush_times
        self._outage_file = None if outage_file is None else os.path.abspath(outage_file)
        self._outage_ops = tuple(outage_ops)

    @property
    def inner(self) -> Sink:
        return self._inner

    @property
    def key(self) -> Sequence[str] | None:
        return self._inner.key

    @property
    def marker_id(self) -> str:
        return self._inner.marker_id

    def describe(self) -> dict[str, Any]:
        return {**self._inner.describe(), "failing": True}

    def evolution_rules(self) -> _schema.Rules:
        return self._inner.evolution_rules()

    def bind(self: _F, runtime: str, name: str) -> _F:
        bound = super().bind(runtime, name)
        bound._inner = self._inner.bind(runtime, name)
        return bound

    def counts(self) -> dict[str, int]:
        """Calls seen so far, by operation (``write``, ``pre_commit``, ``commit``, ``abort``)."""
        prefix = f"{self.runtime}:{self.name}:"
        return {k[len(prefix):]: v for k, v in self._counters.read().items()
                if k.startswith(prefix)}

    @property
    def _counters(self) -> _Counters:
        return _Counters(Path(self._state_dir))

    def _count(self, operation: str) -> int:
        return self._counters.bump(f"{self.runtime}:{self.name}:{operation}")

    def _check_outage(self, operation: str) -> None:
        if (self._outage_file is not None and operation in self._outage_ops
                and os.path.exists(self._outage_file)):
            raise SinkUnavailableError(
                f"FailingSink {self.name!r}: the target is down for {operation} (injected "
                f"outage while {self._outage_file} exists)", runtime=self.runtime,
                sink=self.name)

    def _failure(self, operation: str, call: int, epoch: int | None = None) -> InjectedSinkFailure:
        where = "" if epoch is None else f" of epoch {epoch}"
        return InjectedSinkFailure(
            f"FailingSink {self.name!r} (runtime {self.runtime!r}): injected failure of "
            f"{operation} call {call}{where}")

    def validate(self) -> None:
        self._inner.validate()

    def create_writer(self, writer_id: int) -> SinkWriter:
        return _FailingWriter(self, self._inner.create_writer(writer_id))

    def commit(self, epoch: int, manifests: Sequence[Manifest]) -> CommitResult:
        self._check_outage("commit")
        call = self._count("commit")
        stall = self._stall_commit_times is None or call <= self._stall_commit_times
        if self._stall_commit_seconds > 0 and stall:
            time.sleep(self._stall_commit_seconds)
        failing = call <= self._fail_commit_times
        if failing and self._fail_commit_mode == "before":
            raise self._failure("commit", call, epoch)
        marked = self._inner.commit(epoch, manifests)
        if failing:
            raise self._failure("commit", call, epoch)
        return marked

    def abort(self, epoch: int, manifests: Sequence[Manifest] | None) -> None:
        call = self._count("abort")
        if call <= self._fail_abort_times:
            raise self._failure("abort", call, epoch)
        self._inner.abort(epoch, manifests)

    def committed_epoch(self) -> int | None:
        return self._inner.committed_epoch()

    def holds_decision(self, epoch: int, manifests: Sequence[Manifest]) -> bool | None:
        return self._inner.holds_decision(epoch, manifests)

    def recreate_marker(self, epoch: int) -> None:
        self._inner.recreate_marker(epoch)

    def target_exists(self) -> bool:
        return self._inner.target_exists()

    def close(self) -> None:
        self._inner.close()


class _FailingWriter(SinkWriter):
    def __init__(self, sink: FailingSink, inner: SinkWriter) -> None:
        self._sink = sink
        self._inner = inner

    def open(self) -> None:
        self._inner.open()

    def write(self, batch: pa.RecordBatch) -> None:
        self._sink._check_outage("write")
        call = self._sink._count("write")
        if call == self._sink._fail_write_at:
            raise self._sink._failure("write", call)
        self._inner.write(batch)

    def flush(self) -> None:
        seconds = self._sink._stall_flush_seconds
        if seconds > 0:
            limit = self._sink._stall_flush_times
            if limit is None or self._sink._count("stalled_flush") <= limit:
                time.sleep(seconds)
        self._inner.flush()

    def pre_commit(self, epoch: int, attempt: int) -> Manifest:
        self._sink._check_outage("pre_commit")
        call = self._sink._count("pre_commit")
        if call <= self._sink._fail_pre_commit_times:
            raise self._sink._failure("pre_commit", call, epoch)
        return self._inner.pre_commit(epoch, attempt)

    def rollback(self, epoch: int, attempt: int) -> None:
        self._inner.rollback(epoch, attempt)

    def close(self) -> None:
        self._sink._count("close")
        self._inner.close()
