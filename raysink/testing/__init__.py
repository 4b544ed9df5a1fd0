"""Fakes for testing code that uses raysink (Bytewax ``testing.py``, Quix ``FailingSink``).

``ListSink(directory)``
    A small exactly-once sink. Each committed epoch is one Arrow IPC file
    ``<directory>/committed/<epoch>.arrow``, written atomically, so the file is both the
    data and the marker; ``read()`` returns every committed row. Works across processes.
    ``schema_evolution="add_columns"`` as every sink (``raysink._schema``; any lossless
    widening is applied: each epoch's file holds the schema after it).
``FailingSink(inner, state_dir=...)``
    Wraps any sink and injects failures: the n-th write, the first n pre-commits, commits or
    aborts, stalled commits. Call counters live in ``<state_dir>/counters.json`` (locked), so
    they count across writer actors, the coordinator and restarts.
``InMemoryMetaStore()``
    The ``MetaStore`` protocol on dicts, for coordinator unit tests. Manifests go through a
    JSON round trip, as in the real stores.
``arm_fault`` / ``disarm_faults`` / ``fired``
    Arm the named fault points of ``raysink._faults`` for one runtime.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import fcntl
import json
import os
import shutil
import threading
import time
import uuid
from collections.abc import Collection, Iterator, Mapping, Sequence
from pathlib import Path, PurePosixPath
from typing import Any, Literal, TypeVar

import pyarrow as pa

from raysink import _schema
from raysink._faults import (
    HANDOFF_POINTS,
    POINTS,
    SINK_POINTS,
    InjectedFault,
    _arm_path,
    enabled,
    fault_dir,
    hit,
)
from raysink.coordinator.metastore import _leases
from raysink.coordinator.metastore.base import (
    HISTORY_LIMIT,
    EpochRecord,
    EpochState,
    Lease,
    RuntimeRecord,
    SinkStatusRecord,
)
from raysink.errors import (
    ConfigError,
    DataLossError,
    FencedError,
    MetaStoreError,
    SchemaMismatchError,
    SinkUnavailableError,
)
from raysink.sinks._staging import write_durably
from raysink.sinks.base import CommitResult, Manifest, Sink, SinkWriter

__all__ = [
    "FailingSink",
    "InMemoryMetaStore",
    "InjectedFault",
    "InjectedSinkFailure",
    "ListSink",
    "arm_fault",
    "disarm_faults",
    "fault_dir",
    "fired",
    "fired_context",
]

FaultAction = Literal["kill", "raise", "sleep"]
_F = TypeVar("_F", bound="FailingSink")


# --------------------------------------------------------------------------- files


def _ipc_bytes(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    return bytes(sink.getvalue().to_pybytes())


def _read_ipc(path: Path) -> pa.Table:
    with pa.memory_map(str(path)) as source:
        return pa.ipc.open_file(source).read_all()


def _rmtree(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        shutil.rmtree(path)


# --------------------------------------------------------------------------- ListSink


class ListSink(Sink):
    """An exactly-once sink keeping committed rows as Arrow IPC files in ``directory``.

    Layout: ``staging/<epoch>/<attempt>/w<writer>-<uuid>.arrow`` (written by
    ``pre_commit``; writers buffer in memory until then, ``flush`` does nothing) and
    ``committed/<epoch>.arrow`` (the epoch's rows and its marker in one atomic file).
    ``commit`` and ``abort`` are idempotent. ``key`` is reported to the runtime only: rows
    are appended, never upserted. With ``schema_evolution="add_columns"`` an epoch may add
    columns or widen types (``raysink._schema.evolve``); its committed file holds the
    whole schema after it (``table_schema()``), with the epoch's rows aligned to it.
    """

    kind = "list"

    def __init__(self, directory: str | os.PathLike[str], *,
                 key: Sequence[str] | None = None,
                 schema_evolution: _schema.SchemaEvolution = "fail") -> None:
        self._directory = os.path.abspath(os.fspath(directory))
        self._key = None if key is None else tuple(key)
        self.schema_evolution = _schema.check_evolution_option("ListSink", schema_evolution)

    @property
    def directory(self) -> Path:
        return Path(self._directory)

    @property
    def key(self) -> Sequence[str] | None:
        return self._key

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "directory": self._directory,
                "schema_evolution": self.schema_evolution}

    def evolution_rules(self) -> _schema.Rules:
        """Arrow's types; every lossless widening (each epoch is its own file)."""
        return _schema.Rules(target=f"the ListSink {self._directory!r}",
                             widen=lambda old, new: True)

    def table_schema(self) -> pa.Schema | None:
        """The schema of the newest committed epoch that had one (``add_columns``: the
        table's), else ``None``."""
        for epoch in reversed(self.committed_epochs()):
            with pa.memory_map(str(self._committed(epoch))) as source:
                schema = pa.ipc.open_file(source).schema
            if schema.names:
                return schema
        return None

    def _staging(self, epoch: int) -> Path:
        return self.directory / "staging" / f"{epoch:012d}"

    def _committed(self, epoch: int) -> Path:
        return self.directory / "committed" / f"{epoch:012d}.arrow"

    def validate(self) -> None:
        """The directory (or its nearest existing parent) is a directory. Creates nothing."""
        probe = self.directory
        while not probe.exists():
            probe = probe.parent
        if not probe.is_dir():
            raise SinkUnavailableError(f"{str(probe)!r} is a file; give a directory",
                                       runtime=self.runtime or None, sink=self.name or None)

    def create_writer(self, writer_id: int) -> ListSinkWriter:
        return ListSinkWriter(self, writer_id)

    def commit(self, epoch: int, manifests: Sequence[Manifest]) -> CommitResult:
        """Write ``committed/<epoch>.arrow`` from the staged files, then sweep staging.
        Idempotent: an epoch already committed only has its staging swept."""
        paths = self._staged_paths(epoch, manifests)
        result = CommitResult.ALREADY
        if not self._committed(epoch).exists():
            table = self._read_staged(epoch, paths, manifests)
            hit("sink.mid_commit", runtime=self.runtime, sink=self.name, epoch=epoch)
            write_durably(self._committed(epoch), _ipc_bytes(table))
            result = CommitResult.COMMITTED
        _rmtree(self._staging(epoch))
        return result

    def _read_staged(self, epoch: int, paths: list[Path],
                     manifests: Sequence[Manifest]) -> pa.Table:
        missing = [str(p) for p in paths if not p.exists()]
        if missing:
            raise DataLossError(f"staged files {missing} are gone before commit",
                                runtime=self.runtime, sink=self.name, epoch=epoch)
        tables = [_read_ipc(p) for p in paths]
        if not tables:
            return pa.table({})
        if self.schema_evolution != "add_columns":
            return pa.concat_tables(tables, promote_options="default")
        where = {"runtime": self.runtime, "sink": self.name, "epoch": epoch}
        schema = _schema.union([t.schema for t in tables])
        current = self.table_schema()
        if current is not None:
            schema = _schema.evolve(current, schema, self.evolution_rules(),
                                    where=where).schema
        return _schema.align(tables, schema)

    def abort(self, epoch: int, manifests: Sequence[Manifest] | None) -> None:
        """Delete the listed staged files, or with ``None`` all of ``staging/<epoch>``.
        Idempotent."""
        if manifests is None:
            _rmtree(self._staging(epoch))
            return
        for path in self._staged_paths(epoch, manifests):
            path.unlink(missing_ok=True)

    def committed_epoch(self) -> int | None:
        return max(self.committed_epochs(), default=None)

    def committed_epochs(self) -> list[int]:
        """Every committed epoch, ascending."""
        folder = self.directory / "committed"
        if not folder.is_dir():
            return []
        return sorted(int(p.stem) for p in folder.glob("*.arrow") if p.stem.isdigit())

    def target_exists(self) -> bool:
        return self.directory.is_dir()

    def recreate_marker(self, epoch: int) -> None:
        if not self._committed(epoch).exists():
            write_durably(self._committed(epoch), _ipc_bytes(pa.table({})))

    def read(self) -> pa.Table:
        """Every committed row, in epoch order (an empty table when nothing is committed)."""
        tables = [self.read_epoch(e) for e in self.committed_epochs()]
        non_empty = [t for t in tables if t is not None and t.num_rows]
        if not non_empty:
            return pa.table({})
        return pa.concat_tables(non_empty, promote_options="permissive")

    def read_epoch(self, epoch: int) -> pa.Table | None:
        """The rows committed at ``epoch``, or ``None`` when it is not committed."""
        path = self._committed(epoch)
        return _read_ipc(path) if path.exists() else None

    def _staged_paths(self, epoch: int, manifests: Sequence[Manifest]) -> list[Path]:
        staging = self._staging(epoch)
        paths = []
        for manifest in manifests:
            for staged in manifest.get("files", []):
                relative = staged.get("path")
                pure = PurePosixPath(str(relative))
                path = self.directory.joinpath(*pure.parts)
                if pure.is_absolute() or ".." in pure.parts or staging not in path.parents:
                    raise MetaStoreError(f"manifest path {relative!r} is outside "
                                         f"{str(staging)!r}; refused", runtime=self.runtime,
                                         sink=self.name, epoch=epoch)
                paths.append(path)
        return paths


class ListSinkWriter(SinkWriter):
    """Buffers one epoch's batches in memory; ``pre_commit`` stages them as one IPC file."""

    def __init__(self, sink: ListSink, writer_id: int) -> None:
        self._sink = sink
        self._writer_id = writer_id
        self._batches: list[pa.RecordBatch] = []
        self._last: tuple[tuple[int, int], Manifest] | None = None
        # add_columns: the table's schema (read at the epoch's first batch), the epoch's
        self._target: pa.Schema | None = None
        self._union: pa.Schema | None = None

    def write(self, batch: pa.RecordBatch) -> None:
        if self._sink.schema_evolution == "add_columns":
            self._evolve(batch)
        elif self._batches and not batch.schema.equals(self._batches[0].schema):
            raise SchemaMismatchError(
                f"writer {self._writer_id}: batch schema {batch.schema.names} differs from "
                f"the epoch's {self._batches[0].schema.names}; send one schema per epoch",
                runtime=self._sink.runtime or None, sink=self._sink.name or None)
        self._batches.append(batch)
        self._last = None

    def _evolve(self, batch: pa.RecordBatch) -> None:
        """``add_columns``: the batch must evolve the table's schema, and have a union with
        the epoch's other batches; ``SchemaMismatchError`` naming the column otherwise."""
        where: dict[str, Any] = {"runtime": self._sink.runtime or None,
                                 "sink": self._sink.name or None}
        if not self._batches:
            self._target, self._union = self._sink.table_schema(), None
        if self._target is not None:
            _schema.evolve(self._target, batch.schema, self._sink.evolution_rules(),
                           where=where)
        self._union = _schema.union([batch.schema] if self._union is None
                                    else [self._union, batch.schema])

    def pre_commit(self, epoch: int, attempt: int) -> Manifest:
        """Stage the buffered rows; the same manifest again when re-run with no writes."""
        if self._last is not None and self._last[0] == (epoch, attempt):
            return self._last[1]
        files: list[dict[str, Any]] = []
        rows = sum(b.num_rows for b in self._batches)
        if self._batches:
            name = f"{attempt:04d}/w{self._writer_id:04d}-{uuid.uuid4().hex}.arrow"
            path = self._sink._staging(epoch) / name
            tables = [pa.Table.from_batches([b]) for b in self._batches]
            write_durably(path, _ipc_bytes(pa.concat_tables(tables, promote_options="permissive")))
            files.append({"path": path.relative_to(self._sink.directory).as_posix()})
        manifest: Manifest = {"writer": self._writer_id, "files": files, "rows": rows}
        self._batches, self._last = [], ((epoch, attempt), manifest)
        return manifest

    def rollback(self, epoch: int, attempt: int) -> None:
        if self._last is None or self._last[0] != (epoch, attempt):
            self._batches = []
        self._last = None
        folder = self._sink._staging(epoch) / f"{attempt:04d}"
        if folder.is_dir():
            for path in folder.glob(f"w{self._writer_id:04d}-*.arrow"):
                path.unlink(missing_ok=True)


# --------------------------------------------------------------------------- FailingSink


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


# --------------------------------------------------------------------------- meta store


def _json_round_trip(value: Any, what: str) -> Any:
    try:
        return json.loads(json.dumps(value, allow_nan=False))
    except (TypeError, ValueError) as exc:
        raise MetaStoreError(f"{what} is not JSON-serialisable: {exc}") from exc


class InMemoryMetaStore:
    """The ``MetaStore`` protocol on dicts; thread-safe; for unit tests.

    Epoch records are kept as JSON text (``layout``, ``manifests``) and decoded on every
    read, so anything not JSON-serialisable fails here as in the real stores. ``close``
    keeps the data: the same instance can serve a "restarted" coordinator.
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._runtimes: dict[str, RuntimeRecord] = {}
        self._leases: dict[str, Lease] = {}
        self.clock = time.time  # the store's clock (a test may move it)
        self._epochs: dict[tuple[str, str, int], dict[str, Any]] = {}
        self._statuses: dict[tuple[str, str], SinkStatusRecord] = {}

    @property
    def url(self) -> str:
        return "memory://"

    # runtimes ------------------------------------------------------------------------
    def claim(self, runtime: str, sinks: Mapping[str, str], *,
              add: Collection[str] = (), drop: Collection[str] = (),
              holder: str | None = None) -> RuntimeRecord:
        with self._lock:
            if holder is not None:
                current = self.lease(runtime)
                if current is None or current.holder != holder:
                    raise _leases.in_use(runtime, current)
            old = self._runtimes.get(runtime)
            if old is None:
                record = RuntimeRecord(name=runtime, generation=1, sinks=dict(sinks))
            else:
                _check_sink_set(runtime, old.sinks, sinks, add, drop)
                gone = set(old.dropped) | (set(old.sinks) - set(sinks))
                record = RuntimeRecord(
                    name=runtime, generation=old.generation + 1, sinks=dict(sinks),
                    dropped=tuple(sorted(gone - set(sinks))), epoch_source=old.epoch_source)
            self._runtimes[runtime] = record
            return copy.deepcopy(record)

    def load(self, runtime: str) -> RuntimeRecord | None:
        with self._lock:
            return copy.deepcopy(self._runtimes.get(runtime))

    def bind_source(self, runtime: str, generation: int, source: Mapping[str, Any]) -> None:
        with self._lock:
            old = self._fence(runtime, generation)
            decoded = _json_round_trip(dict(source), "epoch source")
            self._runtimes[runtime] = RuntimeRecord(
                name=old.name, generation=old.generation, sinks=old.sinks,
                dropped=old.dropped, epoch_source=decoded)

    # the lease -----------------------------------------------------------------------
    def acquire_lease(self, runtime: str, holder: str, owner: Mapping[str, Any],
                      seconds: float, *, replace: str | None = None) -> Lease:
        with self._lock:
            current = self.lease(runtime)
            now = self.clock()
            if current is not None and current.holder not in (holder, replace) \
                    and current.live:
                return current
            token = (0 if current is None else current.token) + (
                0 if current is not None and current.holder == holder else 1)
            lease = Lease(runtime=runtime, holder=holder, owner=_json_round_trip(
                dict(owner), "lease owner"), token=token, expires_at=now + seconds, now=now)
            self._leases[runtime] = lease
            return copy.deepcopy(lease)

    def release_lease(self, runtime: str, holder: str) -> None:
        with self._lock:
            current = self._leases.get(runtime)
            if current is not None and current.holder == holder:
                self._leases[runtime] = dataclasses.replace(current, expires_at=min(
                    current.expires_at, self.clock()))

    def lease(self, runtime: str) -> Lease | None:
        with self._lock:
            current = self._leases.get(runtime)
            return None if current is None else dataclasses.replace(
                copy.deepcopy(current), now=self.clock())

    def _fence(self, runtime: str, generation: int) -> RuntimeRecord:
        record = self._runtimes.get(runtime)
        if record is None:
            raise MetaStoreError(f"runtime {runtime!r} was never claimed", runtime=runtime)
        if generation < record.generation:
            raise FencedError(f"generation {generation} is fenced by generation "
                              f"{record.generation}; this coordinator must stop",
                              runtime=runtime)
        if generation > record.generation:
            raise MetaStoreError(f"generation {generation} was never claimed (current "
                                 f"{record.generation})", runtime=runtime)
        return record

    # epochs --------------------------------------------------------------------------
    def records(self, runtime: str) -> list[EpochRecord]:
        with self._lock:
            rows = [row for (rt, _, _), row in self._epochs.items() if rt == runtime]
            return sorted((_decode(row) for row in rows), key=lambda r: (r.epoch, r.sink))

    def put_open(self, runtime: str, generation: int, epoch: int, attempt: int,
                 sinks: Sequence[str], layout: Mapping[str, Any]) -> None:
        with self._lock:
            record = self._fence(runtime, generation)
            text = json.dumps(_json_round_trip(dict(layout), "layout"))
            for sink in sinks:
                self._check_openable(record, sink, epoch, attempt)
            for sink in sinks:
                self._epochs[(runtime, sink, epoch)] = _row(
                    sink, epoch, attempt, EpochState.OPEN, layout=text)

    def _check_openable(self, record: RuntimeRecord, sink: str, epoch: int,
                        attempt: int) -> None:
        if sink not in record.sinks:
            raise MetaStoreError(f"sink {sink!r} is not in the runtime's sink set",
                                 runtime=record.name, sink=sink, epoch=epoch)
        row = self._epochs.get((record.name, sink, epoch))
        if row is None:
            return
        if row["state"] in (EpochState.PENDING, EpochState.COMMITTED):
            raise MetaStoreError(f"epoch is {row['state'].value}; it cannot be reopened",
                                 runtime=record.name, sink=sink, epoch=epoch)
        if row["attempt"] > attempt:
            raise MetaStoreError(f"attempt {attempt} is below the recorded attempt "
                                 f"{row['attempt']}", runtime=record.name, sink=sink,
                                 epoch=epoch)

    def put_decided(self, runtime: str, generation: int, epoch: int, attempt: int,
                    layout: Mapping[str, Any],
                    manifests: Mapping[str, Sequence[Manifest]]) -> None:
        with self._lock:
            record = self._fence(runtime, generation)
            for sink in manifests:
                self._check_openable(record, sink, epoch, attempt)
            layout_text = json.dumps(_json_round_trip(dict(layout), "layout"))
            for sink, items in manifests.items():
                text = json.dumps(_json_round_trip(list(items), f"manifests of {sink}"))
                self._epochs[(runtime, sink, epoch)] = _row(
                    sink, epoch, attempt, EpochState.PENDING, layout=layout_text,
                    manifests=text)

    def put_pending(self, runtime: str, generation: int, epoch: int, attempt: int,
                    manifests: Mapping[str, Sequence[Manifest]]) -> None:
        with self._lock:
            self._fence(runtime, generation)
            encoded = {}
            for sink, items in manifests.items():
                row = self._epochs.get((runtime, sink, epoch))
                if row is None or row["state"] != EpochState.OPEN or row["attempt"] != attempt:
                    raise MetaStoreError(f"epoch is not OPEN at attempt {attempt}",
                                         runtime=runtime, sink=sink, epoch=epoch)
                decoded = _json_round_trip(list(items), f"manifests of sink {sink!r}")
                encoded[sink] = json.dumps(decoded)
            for sink, text in encoded.items():
                row = self._epochs[(runtime, sink, epoch)]
                self._epochs[(runtime, sink, epoch)] = _row(
                    sink, epoch, attempt, EpochState.PENDING, layout=row["layout"],
                    manifests=text)

    def put_committed(self, runtime: str, generation: int, epoch: int, sink: str, *,
                      marked: bool = True) -> None:
        with self._lock:
            self._fence(runtime, generation)
            row = self._epochs.get((runtime, sink, epoch))
            if row is None or row["state"] not in (EpochState.PENDING, EpochState.COMMITTED):
                state = None if row is None else row["state"].value
                raise MetaStoreError(f"only a PENDING epoch can be committed, found {state}",
                                     runtime=runtime, sink=sink, epoch=epoch)
            self._epochs[(runtime, sink, epoch)] = {**row, "state": EpochState.COMMITTED,
                                                    "marked": marked,
                                                    "updated_at": time.time()}
            self._prune_committed(runtime, sink)

    def _prune_committed(self, runtime: str, sink: str) -> None:
        committed = [e for (rt, s, e), row in self._epochs.items()
                     if rt == runtime and s == sink and row["state"] == EpochState.COMMITTED]
        newest = max(committed)
        marked = max((e for e in committed if self._epochs[(runtime, sink, e)]["marked"]),
                     default=None)
        for epoch in committed:
            if epoch not in (newest, marked):
                del self._epochs[(runtime, sink, epoch)]

    def put_aborted(self, runtime: str, generation: int, epoch: int, attempt: int) -> None:
        with self._lock:
            self._fence(runtime, generation)
            keys = [k for k in self._epochs if k[0] == runtime and k[2] == epoch]
            for key in keys:
                state = self._epochs[key]["state"]
                if state in (EpochState.PENDING, EpochState.COMMITTED):
                    raise MetaStoreError(f"epoch is {state.value}; it only rolls forward",
                                         runtime=runtime, sink=key[1], epoch=epoch)
            for key in keys:
                row = self._epochs[key]
                if row["state"] == EpochState.OPEN and row["attempt"] == attempt:
                    self._epochs[key] = {**row, "state": EpochState.ABORTED,
                                         "updated_at": time.time()}

    def delete_aborted(self, runtime: str, generation: int, epoch: int) -> None:
        with self._lock:
            self._fence(runtime, generation)
            for key in [k for k, row in self._epochs.items()
                        if k[0] == runtime and k[2] == epoch
                        and row["state"] == EpochState.ABORTED]:
                del self._epochs[key]

    # status --------------------------------------------------------------------------
    def set_sink_status(self, runtime: str, generation: int, sink: str, state: str,
                        error: str | None = None) -> None:
        with self._lock:
            self._fence(runtime, generation)
            old = self._statuses.get((runtime, sink))
            history = [] if old is None else list(old.history)
            if old is None or old.state != state:
                history.append({"time": time.time(), "state": state, "error": error})
            self._statuses[(runtime, sink)] = SinkStatusRecord(
                sink=sink, state=state, last_error=error, history=history[-HISTORY_LIMIT:])

    def sink_statuses(self, runtime: str) -> dict[str, SinkStatusRecord]:
        with self._lock:
            return {sink: copy.deepcopy(status)
                    for (rt, sink), status in self._statuses.items() if rt == runtime}

    def close(self) -> None:
        """Nothing to release; the data stays for the next user of this instance."""


def _check_sink_set(runtime: str, old: Mapping[str, str], new: Mapping[str, str],
                    add: Collection[str], drop: Collection[str]) -> None:
    changed = sorted(n for n in set(old) & set(new) if old[n] != new[n])
    if changed:
        raise ConfigError(f"sinks {changed} changed kind ({ {n: old[n] for n in changed} } -> "
                          f"{ {n: new[n] for n in changed} }); give them new names",
                          runtime=runtime)
    added = sorted(set(new) - set(old) - set(add))
    dropped = sorted(set(old) - set(new) - set(drop))
    if added or dropped:
        raise ConfigError(
            f"the sink set changed (new {added}, missing {dropped}); pass them in "
            "add=/drop= to change it on purpose", runtime=runtime)


def _row(sink: str, epoch: int, attempt: int, state: EpochState, *, layout: str = "{}",
         manifests: str | None = None) -> dict[str, Any]:
    return {"sink": sink, "epoch": epoch, "attempt": attempt, "state": state,
            "layout": layout, "manifests": manifests, "updated_at": time.time(),
            "marked": True}


def _decode(row: dict[str, Any]) -> EpochRecord:
    manifests = None if row["manifests"] is None else json.loads(row["manifests"])
    return EpochRecord(sink=row["sink"], epoch=row["epoch"], attempt=row["attempt"],
                       state=row["state"], layout=json.loads(row["layout"]),
                       manifests=manifests, updated_at=row["updated_at"],
                       marked=bool(row.get("marked", True)))


# --------------------------------------------------------------------------- faults


def arm_fault(
    runtime: str,
    point: str,
    *,
    action: FaultAction = "kill",
    times: int = 1,
    when: Mapping[str, Any] | None = None,
    seconds: float = 1.0,
) -> Path:
    """Arm ``point`` for ``runtime``: the next ``times`` hits whose context matches ``when``
    (e.g. ``{"sink": "main", "epoch": 3}``) run ``action``. Re-arming replaces the arm and
    clears ``fired``. Returns the arm file.

    Only a process started with ``RAYSINK_FAULT_DIR`` set (the test fixtures set it before
    Ray starts) can arm points, and only actors started with it fire them: elsewhere this
    is a ``ConfigError``."""
    if point not in POINTS + HANDOFF_POINTS + SINK_POINTS:
        raise ConfigError(f"unknown fault point {point!r}; one of "
                          f"{POINTS + HANDOFF_POINTS + SINK_POINTS}")
    if action not in ("kill", "raise", "sleep"):
        raise ConfigError(f"fault action must be 'kill', 'raise' or 'sleep', got {action!r}")
    if times < 1:
        raise ConfigError(f"times must be >= 1, got {times!r}")
    path = _arm_path(runtime, point)
    path.with_suffix(".fired").unlink(missing_ok=True)
    spec = {"action": action, "times": times, "when": dict(when or {}),
            "seconds": seconds, "armed_times": times}
    write_durably(path, json.dumps(spec).encode())
    return path


def disarm_faults(runtime: str) -> None:
    """Remove every arm and ``fired`` record of ``runtime``. Idempotent; a no-op where
    fault injection is off."""
    if not enabled():
        return
    for point in POINTS + HANDOFF_POINTS:
        path = _arm_path(runtime, point)
        path.unlink(missing_ok=True)
        path.with_suffix(".fired").unlink(missing_ok=True)


def fired_context(runtime: str, point: str) -> dict[str, Any] | None:
    """The context ``point`` last fired in for ``runtime`` (e.g. ``{"executor": ...}``),
    once an arm fired its last time; ``None`` before."""
    if not enabled():
        return None
    try:
        spec = json.loads(_arm_path(runtime, point).with_suffix(".fired").read_text())
    except (OSError, ValueError):
        return None
    context = spec.get("fired_with")
    return dict(context) if isinstance(context, dict) else None


def fired(runtime: str, point: str) -> bool:
    """Whether ``point`` fired at least once for ``runtime`` since it was armed."""
    if not enabled():
        return False
    path = _arm_path(runtime, point)
    if path.with_suffix(".fired").exists():
        return True
    try:
        spec = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return int(spec.get("times", 1)) < int(spec.get("armed_times", spec.get("times", 1)))
