"""What the SQL meta stores share: the schema, JSON codecs and the protocol's logic.

``SqlMetaStore`` implements every ``MetaStore`` method once, on top of two hooks a backend
provides: ``_transaction(write=...)``, a context manager yielding a ``Tx`` (one database
transaction, committed when the block ends, rolled back on any exception, database errors
turned into ``MetaStoreError``), ``_LOCK``, what a query appends to lock the rows it reads
(``FOR UPDATE`` on PostgreSQL; nothing on SQLite, whose ``BEGIN IMMEDIATE`` already holds
the database's write lock) and ``_NOW``, an expression of the database's clock in seconds
since the Unix epoch (leases never compare two machines' clocks). Statements use ``?``
placeholders; ``Tx`` adapts them.

Tables (the same DDL on both backends; JSON is stored as text, never pickle)::

    raysink_runtimes     (name PK, generation, sinks, dropped, epoch_source, updated_at)
    raysink_epochs       (runtime, sink, epoch PK; attempt, state, layout, manifests,
                          updated_at, marked, written_by)
    raysink_sink_status  (runtime, sink PK; state, last_error, history, updated_at)
    raysink_leases       (runtime PK; holder, owner, token, expires_at)   see _leases
    raysink_schema       (id PK = 1; version, raysink, updated_at)        see _versions

The schema's version is checked, and an older store migrated, when a store is opened
(``_versions``); ``written_by`` is the raysink release that recorded the epoch (NULL:
recorded by raysink 0.1.0).

Durability: OPEN, PENDING and ABORTED records and the runtime's identity are on disk when
the call returns; COMMITTED records and sink status are written without forcing them
(``durable=False``), since a lost COMMITTED record is found again from the sink's marker.

Fencing: every mutating method reads the runtime's row inside its transaction and raises
``FencedError`` unless the stored generation equals the caller's, before changing anything.
"""

from __future__ import annotations

import abc
import json
import logging
import re
import time
from collections.abc import Collection, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, ClassVar, Literal
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from raysink.coordinator.metastore import _leases
from raysink.coordinator.metastore._versions import raysink_version
from raysink.coordinator.metastore.base import (
    HISTORY_LIMIT,
    EpochRecord,
    EpochState,
    Lease,
    ManifestJSON,
    RuntimeRecord,
    SinkStatusRecord,
    check_sink_set,
)
from raysink.errors import FencedError, MetaStoreError

logger = logging.getLogger(__name__)

RUNTIMES = "raysink_runtimes"
EPOCHS = "raysink_epochs"
STATUS = "raysink_sink_status"
TABLES = (RUNTIMES, EPOCHS, STATUS, _leases.LEASES)

_STATES = ", ".join(f"'{state.value}'" for state in EpochState)

SCHEMA: tuple[str, ...] = (
    f"""CREATE TABLE IF NOT EXISTS {RUNTIMES} (
        name TEXT PRIMARY KEY,
        generation BIGINT NOT NULL,
        sinks TEXT NOT NULL,
        dropped TEXT NOT NULL,
        epoch_source TEXT,
        updated_at DOUBLE PRECISION NOT NULL)""",
    f"""CREATE TABLE IF NOT EXISTS {EPOCHS} (
        runtime TEXT NOT NULL,
        sink TEXT NOT NULL,
        epoch BIGINT NOT NULL,
        attempt BIGINT NOT NULL,
        state TEXT NOT NULL CHECK (state IN ({_STATES})),
        layout TEXT NOT NULL,
        manifests TEXT,
        updated_at DOUBLE PRECISION NOT NULL,
        marked INTEGER NOT NULL DEFAULT 1,
        written_by TEXT,
        PRIMARY KEY (runtime, sink, epoch))""",
    f"""CREATE TABLE IF NOT EXISTS {STATUS} (
        runtime TEXT NOT NULL,
        sink TEXT NOT NULL,
        state TEXT NOT NULL,
        last_error TEXT,
        history TEXT NOT NULL,
        updated_at DOUBLE PRECISION NOT NULL,
        PRIMARY KEY (runtime, sink))""",
    _leases.DDL,
)
"""DDL shared by SQLite and PostgreSQL (SQLite maps the type names by affinity)."""

COLUMNS_ADDED: tuple[tuple[str, str, str], ...] = (
    (EPOCHS, "marked", "INTEGER NOT NULL DEFAULT 1"),
)
"""``(table, column, definition)`` added to a table before schema versions were recorded:
a store created before is brought up to date when it is opened (``ALTER TABLE ... ADD
COLUMN``). Later changes are steps of ``_versions.STEPS``."""

_RUNTIME_COLUMNS = "name, generation, sinks, dropped, epoch_source"
SELECT_RUNTIME = f"SELECT {_RUNTIME_COLUMNS} FROM {RUNTIMES} WHERE name = ?"

_EPOCH_COLUMNS = ("sink, epoch, attempt, state, layout, manifests, updated_at, marked, "
                  "written_by")

_REDACTED = "***"
_CONNINFO_PASSWORD = re.compile(r"(password\s*=\s*)('(?:[^'\\]|\\.)*'|\S+)", re.IGNORECASE)


def redact_url(url: str) -> str:
    """``url`` with any password replaced by ``***`` (userinfo, ``?password=`` or a
    ``password=`` key of a libpq key/value string)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return _CONNINFO_PASSWORD.sub(rf"\g<1>{_REDACTED}", url)
    if not parts.scheme or not parts.netloc:
        return _CONNINFO_PASSWORD.sub(rf"\g<1>{_REDACTED}", url)
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, _, hostport = netloc.rpartition("@")
        if ":" in userinfo:
            userinfo = userinfo.split(":", 1)[0] + ":" + _REDACTED
        netloc = f"{userinfo}@{hostport}"
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        query = urlencode([(k, _REDACTED if k.lower() == "password" else v) for k, v in pairs],
                          safe="*")
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


# --------------------------------------------------------------------------- JSON


def encode(value: Any, what: str, **where: Any) -> str:
    """``value`` as JSON text; ``MetaStoreError`` when it is not JSON-serialisable."""
    try:
        return json.dumps(value, allow_nan=False, sort_keys=True)
    except (TypeError, ValueError) as exc:
        raise MetaStoreError(f"{what} is not JSON-serialisable ({exc}); keep manifests, "
                             "layouts and epoch sources to JSON types", **where) from exc


def _typed(value: Any, kind: type, what: str) -> Any:
    if not isinstance(value, kind):
        raise ValueError(f"{what} should be a JSON {kind.__name__}, got {value!r:.80}")
    return value


def _corrupt(url: str, table: str, exc: Exception, **where: Any) -> MetaStoreError:
    return MetaStoreError(
        f"a row of table {table} in meta store {url} does not decode ({exc}); it is "
        "corrupt: repair or delete that row (or restore the store from a backup), then "
        "restart the runtime", **where)


def runtime_from_row(row: Sequence[Any], url: str) -> RuntimeRecord:
    """Decode a ``raysink_runtimes`` row; ``MetaStoreError`` when it is corrupt."""
    name = str(row[0])
    try:
        sinks = _typed(json.loads(row[2]), dict, "sinks")
        dropped = _typed(json.loads(row[3]), list, "dropped")
        source = None if row[4] is None else _typed(json.loads(row[4]), dict, "epoch_source")
        return RuntimeRecord(name=name, generation=int(row[1]),
                             sinks={str(k): str(v) for k, v in sinks.items()},
                             dropped=tuple(str(d) for d in dropped), epoch_source=source)
    except (TypeError, ValueError) as exc:
        raise _corrupt(url, RUNTIMES, exc, runtime=name) from exc


def epoch_from_row(row: Sequence[Any], runtime: str, url: str) -> EpochRecord:
    """Decode a ``raysink_epochs`` row (columns ``_EPOCH_COLUMNS``)."""
    sink, epoch = str(row[0]), int(row[1])
    try:
        manifests = None if row[5] is None else _typed(json.loads(row[5]), list, "manifests")
        return EpochRecord(sink=sink, epoch=epoch, attempt=int(row[2]),
                           state=EpochState(row[3]),
                           layout=_typed(json.loads(row[4]), dict, "layout"),
                           manifests=manifests, updated_at=float(row[6]),
                           marked=bool(row[7]),
                           written_by=None if row[8] is None else str(row[8]))
    except (TypeError, ValueError) as exc:
        raise _corrupt(url, EPOCHS, exc, runtime=runtime, sink=sink, epoch=epoch) from exc


def status_from_row(row: Sequence[Any], runtime: str, url: str) -> SinkStatusRecord:
    """Decode a ``raysink_sink_status`` row (sink, state, last_error, history)."""
    sink = str(row[0])
    try:
        history = _typed(json.loads(row[3]), list, "history")
        return SinkStatusRecord(sink=sink, state=str(row[1]), last_error=row[2],
                                history=[_typed(h, dict, "history entry") for h in history])
    except (TypeError, ValueError) as exc:
        raise _corrupt(url, STATUS, exc, runtime=runtime, sink=sink) from exc




# --------------------------------------------------------------------------- transactions


class Tx:
    """One open transaction; statements are written with ``?`` placeholders."""

    def __init__(self, cursor: Any, paramstyle: Literal["qmark", "format"]) -> None:
        self._cursor = cursor
        self._format = paramstyle == "format"

    def _sql(self, sql: str) -> str:
        return sql.replace("?", "%s") if self._format else sql

    def rows(self, sql: str, *params: Any) -> list[tuple[Any, ...]]:
        self._cursor.execute(self._sql(sql), params)
        return [tuple(row) for row in self._cursor.fetchall()]

    def one(self, sql: str, *params: Any) -> tuple[Any, ...] | None:
        rows = self.rows(sql, *params)
        return rows[0] if rows else None

    def run(self, sql: str, *params: Any) -> int:
        """Execute a statement; returns the number of rows it changed."""
        self._cursor.execute(self._sql(sql), params)
        count: int = self._cursor.rowcount
        return count


class SqlMetaStore(abc.ABC):
    """The ``MetaStore`` protocol over SQL; see the module docstring for the hooks."""

    _LOCK: ClassVar[str] = ""
    _NOW: ClassVar[str]

    @property
    @abc.abstractmethod
    def url(self) -> str:
        """The store's address with any password redacted."""

    @abc.abstractmethod
    def _transaction(self, *, write: bool, durable: bool = True
                     ) -> AbstractContextManager[Tx]:
        """One transaction: commit on success, roll back on any exception, database
        errors raised as ``MetaStoreError``. ``durable=False``: the commit need not be
        on disk when it returns (it survives a crash of the process, maybe not of the
        machine); only for records the protocol can lose."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the connection (idempotent)."""

    def _now(self, tx: Tx) -> float:
        row = tx.one(f"SELECT {self._NOW}")
        assert row is not None
        return float(row[0])

    # runtimes ------------------------------------------------------------------------
    def claim(self, runtime: str, sinks: Mapping[str, str], *,
              add: Collection[str] = (), drop: Collection[str] = (),
              holder: str | None = None) -> RuntimeRecord:
        """Create the runtime (generation 1) or start its next generation; with
        ``holder``, only for the holder of the runtime's lease."""
        with self._transaction(write=True) as tx:
            if holder is not None:
                _leases.check_holder(tx, runtime, holder, self._now(tx), self._LOCK)
            old = self._lock_runtime(tx, runtime)
            if old is None and self._insert_runtime(tx, runtime, sinks):
                record = RuntimeRecord(name=runtime, generation=1, sinks=dict(sinks))
            else:
                # ``old`` is None when another process inserted the row concurrently.
                old = old or self._require(self._lock_runtime(tx, runtime), runtime)
                record = self._next_generation(tx, old, sinks, add, drop)
        logger.info("runtime %r claimed generation %d in %s", runtime, record.generation,
                    self.url)
        return record

    def _require(self, record: RuntimeRecord | None, runtime: str) -> RuntimeRecord:
        if record is None:
            raise MetaStoreError(f"runtime {runtime!r} was never claimed in meta store "
                                 f"{self.url}; claim it first (was the store replaced?)",
                                 runtime=runtime)
        return record

    def _insert_runtime(self, tx: Tx, runtime: str, sinks: Mapping[str, str]) -> bool:
        text = encode(dict(sinks), "sink set", runtime=runtime)
        return tx.run(f"INSERT INTO {RUNTIMES} ({_RUNTIME_COLUMNS}, updated_at) "
                      "VALUES (?, 1, ?, '[]', NULL, ?) ON CONFLICT (name) DO NOTHING",
                      runtime, text, time.time()) == 1

    def _next_generation(self, tx: Tx, old: RuntimeRecord, sinks: Mapping[str, str],
                         add: Collection[str], drop: Collection[str]) -> RuntimeRecord:
        check_sink_set(old.name, old.sinks, sinks, add, drop)
        gone = (set(old.dropped) | (set(old.sinks) - set(sinks))) - set(sinks)
        record = RuntimeRecord(name=old.name, generation=old.generation + 1,
                               sinks=dict(sinks), dropped=tuple(sorted(gone)),
                               epoch_source=old.epoch_source)
        tx.run(f"UPDATE {RUNTIMES} SET generation = ?, sinks = ?, dropped = ?, "
               "updated_at = ? WHERE name = ?", record.generation,
               encode(record.sinks, "sink set", runtime=old.name),
               encode(list(record.dropped), "dropped sinks", runtime=old.name),
               time.time(), old.name)
        return record

    def _lock_runtime(self, tx: Tx, runtime: str) -> RuntimeRecord | None:
        row = tx.one(SELECT_RUNTIME + self._LOCK, runtime)
        return None if row is None else runtime_from_row(row, self.url)

    def _fence(self, tx: Tx, runtime: str, generation: int) -> RuntimeRecord:
        """The runtime's record, locked; ``FencedError`` unless ``generation`` is current."""
        record = self._require(self._lock_runtime(tx, runtime), runtime)
        if record.generation != generation:
            why = ("a newer coordinator claimed the runtime" if record.generation > generation
                   else "that generation was never claimed here")
            raise FencedError(f"generation {generation} is fenced: the meta store holds "
                              f"generation {record.generation} ({why}); this coordinator "
                              "must stop", runtime=runtime)
        return record

    def load(self, runtime: str) -> RuntimeRecord | None:
        """The runtime's record, or ``None`` when it was never claimed."""
        with self._transaction(write=False) as tx:
            row = tx.one(SELECT_RUNTIME, runtime)
        return None if row is None else runtime_from_row(row, self.url)

    def bind_source(self, runtime: str, generation: int, source: Mapping[str, Any]) -> None:
        """Record the runtime's epoch source, replacing the previous one."""
        text = encode(dict(source), "epoch source", runtime=runtime)
        with self._transaction(write=True) as tx:
            self._fence(tx, runtime, generation)
            tx.run(f"UPDATE {RUNTIMES} SET epoch_source = ?, updated_at = ? WHERE name = ?",
                   text, time.time(), runtime)

    # the lease -----------------------------------------------------------------------
    def acquire_lease(self, runtime: str, holder: str, owner: Mapping[str, Any],
                      seconds: float, *, replace: str | None = None) -> Lease:
        """Take or renew the lease when it is free for ``holder`` (see ``MetaStore``)."""
        with self._transaction(write=True) as tx:
            return _leases.acquire(tx, runtime, holder, owner, seconds, self._now(tx),
                                   replace=replace, lock=self._LOCK)

    def release_lease(self, runtime: str, holder: str) -> None:
        """Give the lease up at once (idempotent; nothing when another holds it)."""
        with self._transaction(write=True) as tx:
            _leases.release(tx, runtime, holder, self._now(tx))

    def lease(self, runtime: str) -> Lease | None:
        """The runtime's lease, or ``None`` when it was never taken."""
        with self._transaction(write=False) as tx:
            return _leases.read(tx, runtime, self._now(tx))

    # epochs --------------------------------------------------------------------------
    def records(self, runtime: str) -> list[EpochRecord]:
        """Every epoch record of the runtime, ordered by ``(epoch, sink)``."""
        with self._transaction(write=False) as tx:
            rows = tx.rows(f"SELECT {_EPOCH_COLUMNS} FROM {EPOCHS} WHERE runtime = ? "
                           "ORDER BY epoch, sink", runtime)
        return [epoch_from_row(row, runtime, self.url) for row in rows]

    def _epoch_rows(self, tx: Tx, runtime: str, epoch: int) -> dict[str, tuple[str, int]]:
        """``sink -> (state, attempt)`` of one epoch."""
        rows = tx.rows(f"SELECT sink, state, attempt FROM {EPOCHS} "
                       "WHERE runtime = ? AND epoch = ?", runtime, epoch)
        return {str(sink): (str(state), int(attempt)) for sink, state, attempt in rows}

    def put_open(self, runtime: str, generation: int, epoch: int, attempt: int,
                 sinks: Sequence[str], layout: Mapping[str, Any]) -> None:
        """Record ``(epoch, attempt)`` OPEN for every sink in one transaction."""
        text = encode(dict(layout), "layout", runtime=runtime, epoch=epoch)
        with self._transaction(write=True) as tx:
            record = self._fence(tx, runtime, generation)
            existing = self._epoch_rows(tx, runtime, epoch)
            for sink in sinks:
                _check_openable(record, sink, epoch, attempt, existing.get(sink))
            now = time.time()
            for sink in sinks:
                tx.run(f"INSERT INTO {EPOCHS} (runtime, {_EPOCH_COLUMNS}) "
                       "VALUES (?, ?, ?, ?, ?, ?, NULL, ?, 1, ?) "
                       "ON CONFLICT (runtime, sink, epoch) DO UPDATE SET "
                       "attempt = excluded.attempt, state = excluded.state, "
                       "layout = excluded.layout, manifests = NULL, "
                       "updated_at = excluded.updated_at, marked = 1, "
                       "written_by = excluded.written_by",
                       runtime, sink, epoch, attempt, EpochState.OPEN.value, text, now,
                       raysink_version())
        logger.debug("runtime %r epoch %d attempt %d OPEN for %s", runtime, epoch, attempt,
                     list(sinks))

    def put_decided(self, runtime: str, generation: int, epoch: int, attempt: int,
                    layout: Mapping[str, Any],
                    manifests: Mapping[str, Sequence[ManifestJSON]]) -> None:
        """Record an attempt that was never recorded OPEN straight PENDING for every sink,
        in one transaction (its open travelled with the data)."""
        layout_text = encode(dict(layout), "layout", runtime=runtime, epoch=epoch)
        texts = {sink: encode(list(items), f"manifests of sink {sink!r}", runtime=runtime,
                              sink=sink, epoch=epoch) for sink, items in manifests.items()}
        with self._transaction(write=True) as tx:
            record = self._fence(tx, runtime, generation)
            existing = self._epoch_rows(tx, runtime, epoch)
            for sink in texts:
                _check_openable(record, sink, epoch, attempt, existing.get(sink))
            now = time.time()
            for sink, text in texts.items():
                tx.run(f"INSERT INTO {EPOCHS} (runtime, {_EPOCH_COLUMNS}) "
                       "VALUES (?, ?, ?, ?, ?, ?, ?, ?, 1, ?) "
                       "ON CONFLICT (runtime, sink, epoch) DO UPDATE SET "
                       "attempt = excluded.attempt, state = excluded.state, "
                       "layout = excluded.layout, manifests = excluded.manifests, "
                       "updated_at = excluded.updated_at, marked = 1, "
                       "written_by = excluded.written_by",
                       runtime, sink, epoch, attempt, EpochState.PENDING.value, layout_text,
                       text, now, raysink_version())
        logger.debug("runtime %r epoch %d attempt %d decided (PENDING) for %s", runtime,
                     epoch, attempt, sorted(texts))

    def put_pending(self, runtime: str, generation: int, epoch: int, attempt: int,
                    manifests: Mapping[str, Sequence[ManifestJSON]]) -> None:
        """Record the epoch PENDING for every sink in ``manifests``, in one transaction."""
        texts = {sink: encode(list(items), f"manifests of sink {sink!r}", runtime=runtime,
                              sink=sink, epoch=epoch) for sink, items in manifests.items()}
        with self._transaction(write=True) as tx:
            self._fence(tx, runtime, generation)
            existing = self._epoch_rows(tx, runtime, epoch)
            for sink in texts:
                if existing.get(sink) != (EpochState.OPEN.value, attempt):
                    raise MetaStoreError(
                        f"epoch is not OPEN at attempt {attempt} (found "
                        f"{_describe(existing.get(sink))}); only the open attempt can "
                        "become pending",
                        runtime=runtime, sink=sink, epoch=epoch)
            now = time.time()
            for sink, text in texts.items():
                tx.run(f"UPDATE {EPOCHS} SET state = ?, manifests = ?, updated_at = ?, "
                       "written_by = ? WHERE runtime = ? AND sink = ? AND epoch = ?",
                       EpochState.PENDING.value, text, now, raysink_version(), runtime, sink,
                       epoch)
        logger.debug("runtime %r epoch %d attempt %d PENDING for %s", runtime, epoch,
                     attempt, sorted(texts))

    def put_committed(self, runtime: str, generation: int, epoch: int, sink: str, *,
                      marked: bool = True) -> None:
        """Record one sink's epoch COMMITTED (idempotent) and prune its older ones.

        Not forced to disk: a COMMITTED record lost to a power cut leaves the epoch
        PENDING, and recovery finds the sink's (durable) marker and records it again."""
        with self._transaction(write=True, durable=False) as tx:
            self._fence(tx, runtime, generation)
            found = self._epoch_rows(tx, runtime, epoch).get(sink)
            if found is None or found[0] not in (EpochState.PENDING, EpochState.COMMITTED):
                raise MetaStoreError(
                    f"only a PENDING epoch can be committed, found "
                    f"{'no record' if found is None else found[0]}",
                    runtime=runtime, sink=sink, epoch=epoch)
            tx.run(f"UPDATE {EPOCHS} SET state = ?, marked = ?, updated_at = ? "
                   "WHERE runtime = ? AND sink = ? AND epoch = ?",
                   EpochState.COMMITTED.value, int(marked), time.time(), runtime, sink, epoch)
            pruned = self._prune_committed(tx, runtime, sink)
        logger.debug("runtime %r sink %r epoch %d COMMITTED (%d older pruned)", runtime,
                     sink, epoch, pruned)

    def _prune_committed(self, tx: Tx, runtime: str, sink: str) -> int:
        """Delete the sink's COMMITTED rows but the newest and the newest marked one (the
        epoch whose marker the target must still hold, when epochs without a marker came
        after it)."""
        committed = EpochState.COMMITTED.value
        newest = (f"SELECT MAX(epoch) FROM {EPOCHS} "
                  "WHERE runtime = ? AND sink = ? AND state = ?")
        return tx.run(f"DELETE FROM {EPOCHS} WHERE runtime = ? AND sink = ? AND state = ? "
                      f"AND epoch < ({newest}) "
                      f"AND epoch <> COALESCE(({newest} AND marked = 1), -1)",
                      runtime, sink, committed, runtime, sink, committed,
                      runtime, sink, committed)

    def put_aborted(self, runtime: str, generation: int, epoch: int, attempt: int) -> None:
        """Record every sink's OPEN ``(epoch, attempt)`` ABORTED; refuse a decided epoch."""
        with self._transaction(write=True) as tx:
            self._fence(tx, runtime, generation)
            for sink, (state, _) in sorted(self._epoch_rows(tx, runtime, epoch).items()):
                if state in (EpochState.PENDING, EpochState.COMMITTED):
                    raise MetaStoreError(f"epoch is {state}; a decided epoch only rolls "
                                         "forward and cannot be aborted",
                                         runtime=runtime, sink=sink, epoch=epoch)
            tx.run(f"UPDATE {EPOCHS} SET state = ?, updated_at = ? WHERE runtime = ? "
                   "AND epoch = ? AND attempt = ? AND state = ?",
                   EpochState.ABORTED.value, time.time(), runtime, epoch, attempt,
                   EpochState.OPEN.value)
        logger.debug("runtime %r epoch %d attempt %d ABORTED", runtime, epoch, attempt)

    def delete_aborted(self, runtime: str, generation: int, epoch: int) -> None:
        """Delete the epoch's ABORTED rows (idempotent)."""
        with self._transaction(write=True) as tx:
            self._fence(tx, runtime, generation)
            tx.run(f"DELETE FROM {EPOCHS} WHERE runtime = ? AND epoch = ? AND state = ?",
                   runtime, epoch, EpochState.ABORTED.value)

    # status --------------------------------------------------------------------------
    def set_sink_status(self, runtime: str, generation: int, sink: str, state: str,
                        error: str | None = None) -> None:
        """Set a sink's status; a change of state appends to its bounded history (not
        forced to disk: status is information, not a decision)."""
        with self._transaction(write=True, durable=False) as tx:
            self._fence(tx, runtime, generation)
            row = tx.one(f"SELECT sink, state, last_error, history FROM {STATUS} "
                         "WHERE runtime = ? AND sink = ?", runtime, sink)
            old = None if row is None else status_from_row(row, runtime, self.url)
            history = [] if old is None else list(old.history)
            if old is None or old.state != state:
                history.append({"time": time.time(), "state": state, "error": error})
            text = encode(history[-HISTORY_LIMIT:], "status history", runtime=runtime,
                          sink=sink)
            tx.run(f"INSERT INTO {STATUS} (runtime, sink, state, last_error, history, "
                   "updated_at) VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (runtime, sink) "
                   "DO UPDATE SET state = excluded.state, last_error = excluded.last_error, "
                   "history = excluded.history, updated_at = excluded.updated_at",
                   runtime, sink, state, error, text, time.time())

    def sink_statuses(self, runtime: str) -> dict[str, SinkStatusRecord]:
        """Every sink's persisted status."""
        with self._transaction(write=False) as tx:
            rows = tx.rows(f"SELECT sink, state, last_error, history FROM {STATUS} "
                           "WHERE runtime = ? ORDER BY sink", runtime)
        return {str(row[0]): status_from_row(row, runtime, self.url) for row in rows}

    def __enter__(self) -> SqlMetaStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"


def _check_openable(record: RuntimeRecord, sink: str, epoch: int, attempt: int,
                    found: tuple[str, int] | None) -> None:
    """``MetaStoreError`` when ``sink`` cannot take ``(epoch, attempt)`` OPEN."""
    if sink not in record.sinks:
        raise MetaStoreError(f"sink {sink!r} is not in the runtime's sink set "
                             f"{sorted(record.sinks)}", runtime=record.name, sink=sink,
                             epoch=epoch)
    if found is None:
        return
    state, recorded = found
    if state in (EpochState.PENDING, EpochState.COMMITTED):
        raise MetaStoreError(f"epoch is {state}; it cannot be reopened",
                             runtime=record.name, sink=sink, epoch=epoch)
    if recorded > attempt:
        raise MetaStoreError(f"attempt {attempt} is below the recorded attempt {recorded}; "
                             "open a newer attempt", runtime=record.name, sink=sink,
                             epoch=epoch)


def _describe(found: tuple[str, int] | None) -> str:
    return "no record" if found is None else f"{found[0]} at attempt {found[1]}"
