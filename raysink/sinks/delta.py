"""A Delta Lake table written through ``deltalake`` (delta-rs).

Layout inside the table directory::

    <path>/
      _delta_log/...                                        the Delta log
      raysink/<epoch:012d>/e<epoch>-a<attempt>-w<writer>-<uuid>-<n>.parquet    staged files

Writers encode their rows into Parquet in memory and upload the files at ``pre_commit``
under ``raysink/<epoch>/``. Delta readers only read files the log references, so a staged
file is invisible until ``commit`` adds it. The prefix is deliberately not hidden (no
leading ``_``): once committed the file is an ordinary data file that ``VACUUM`` may
remove after a later compaction; a staged file is protected by the vacuum retention
period (7 days by default), so never vacuum with a retention shorter than the longest
outage an epoch may have to survive.

Manifest of one writer for one attempt (append mode; upsert stages whole rows the same
way, with empty ``partition_values``)::

    {"writer": 3, "epoch": 12, "attempt": 1,
     "files": [{"path": "raysink/000000000012/e...-0000.parquet", "size": 5120,
                "partition_values": {"day": "2024-01-01"}, "modification_time": 1700000000000,
                "stats": "{\\"numRecords\\": 1000, ...}", "rows": 1000}],
     "rows": 1000, "bytes": 5120,
     "schema": "<base64 Arrow IPC schema>" | null}

Commit: one Delta commit carrying ``Transaction(app_id=marker_id, version=epoch)``.
Append mode adds the staged files; upsert mode reads the staged rows, keeps the last row
per key (manifest order, then row order) and MERGEs them. ``commit`` checks
``transaction_version(marker_id) >= epoch`` first (delta-rs does not skip an app
transaction already committed), so it is idempotent; a concurrent commit of the same
epoch from another instance makes ours fail with ``CommitFailedError`` (app id conflict),
after which the marker is re-checked. The commit's metadata names the decision
(``raysink.sink``, ``raysink.epoch``, ``raysink.decision``), so ``holds_decision`` can tell a
decision's own earlier commit from another driver's.

Schema evolution (``schema_evolution="add_columns"``): writers check each batch against
the table's schema (``raysink._schema.evolve``: new columns are added, a type narrower
than the table's is cast up; a wider one is refused, since delta-rs cannot write the
type-widening table feature). An epoch whose files all fit the table's schema commits
its staged files as above. One that adds columns, or whose files hold a column in a type
the table stores otherwise, is committed as ONE Delta commit carrying the metadata action
(the new schema), the data and the transaction marker: its staged rows are read, cast to
the new schema and written again by ``write_deltalake(schema_mode="merge")`` (upserts:
``merge(merge_schema=True)``), and the staged files are deleted after. A crash before
that commit leaves the old schema and none of the epoch's rows; the re-run commits both.

A missing table: ``committed_epoch()`` is ``None`` and ``target_exists()`` is ``False``.
The coordinator, which knows from the meta store whether this sink ever committed rows,
raises ``DataLossError`` when it did; otherwise ``commit`` creates the table, an empty
epoch included (its writers saw the schema). Only an epoch that carried no schema at all
creates nothing: ``commit`` returns ``False`` and the meta store records it unmarked.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import time
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path
from types import ModuleType
from typing import Any, Literal

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from raysink import _schema
from raysink._faults import hit
from raysink.errors import (
    ConfigError,
    DataLossError,
    MetaStoreError,
    SchemaMismatchError,
    SinkUnavailableError,
)
from raysink.sinks._staging import (
    STAGED_FILE,
    FileStore,
    ParquetBuffer,
    epoch_dir,
    new_unique,
    staged_file_path,
)
from raysink.sinks.base import CommitResult, Manifest, Sink, SinkWriter, decision_id

__all__ = ["DeltaSink", "DeltaSinkWriter"]

logger = logging.getLogger(__name__)

STAGING_PREFIX = "raysink"
DECISION_KEYS = ("raysink.sink", "raysink.epoch", "raysink.decision")
"""Commit metadata of a raysink commit: its marker id, epoch and decision (``holds_decision``)."""
HISTORY_SEARCHED = 100
_STAT_STRING_MAX = 32
_SEQ = "__raysink_seq"
_REMEMBERED_ATTEMPTS = 8  # staged attempts a writer can still roll back


def _deltalake() -> ModuleType:
    try:
        import deltalake
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ConfigError("DeltaSink needs deltalake: pip install 'raysink[delta]'") from exc
    return deltalake


def _is_local(path: str) -> bool:
    return "://" not in path or path.startswith("file://")


def _local_path(path: str) -> str:
    return os.path.abspath(path.removeprefix("file://"))


# --------------------------------------------------------------------------- schema


def _delta_fields(schema: pa.Schema) -> dict[str, Any]:
    """Column name -> Delta type (JSON form) of an Arrow schema."""
    dl = _deltalake()
    doc = json.loads(dl.Schema.from_arrow(schema).to_json())
    return {f["name"]: f["type"] for f in doc["fields"]}


@functools.lru_cache(maxsize=512)
def _delta_type(dtype: pa.DataType) -> str:
    """The Delta type (its JSON form) that stores Arrow ``dtype``."""
    return json.dumps(_delta_fields(pa.schema([pa.field("c", dtype)]))["c"], sort_keys=True)


def _delta_key(field: pa.Field) -> Hashable:
    return _delta_type(field.type)


def _rules(uri: str) -> _schema.Rules:
    """Delta's rules: Delta types; no widening (delta-rs cannot write the typeWidening
    table feature)."""
    return _schema.Rules(target=f"the Delta table {uri!r}", key=_delta_key,
                         refuses_widening="delta-rs cannot change a Delta column's type")


def _table_schema(dt: Any) -> pa.Schema:
    """The table's schema in Arrow."""
    return pa.schema(dt.schema().to_arrow())


@dataclass(frozen=True, slots=True)
class _SchemaPlan:
    """What a commit does to the table's schema: ``schema`` after it, ``changed`` (an
    existing table gains columns), ``rewrite`` (the staged rows are written again); and
    the ``decision`` it commits (``decision_id``, kept in the commit's metadata)."""

    schema: pa.Schema | None
    changed: bool = False
    rewrite: bool = False
    decision: str | None = None


def _file_schemas(manifests: Sequence[Manifest]) -> list[pa.Schema]:
    """The schemas the epoch's staged files were written in (each once)."""
    texts: dict[str, None] = {}
    for m in manifests:
        for f in m.get("files") or []:
            text = f.get("schema", m.get("schema"))
            if isinstance(text, str):
                texts[text] = None
    return [_schema.decode(text) for text in texts]


def _fits(written: pa.Schema, schema: pa.Schema) -> bool:
    """Whether a file written in ``written`` holds each column as the table stores it."""
    return all(_delta_type(f.type) == _delta_type(schema.field(f.name).type)
               for f in written if f.name in schema.names)


def _data_schema(data: pa.Schema, schema: pa.Schema) -> pa.Schema:
    """The rows' schema with each column as nullable as the table's (new ones nullable)."""
    return pa.schema([f.with_nullable(schema.field(f.name).nullable)
                      if f.name in schema.names else f.with_nullable(True) for f in data])


def _with_partition_values(table: pa.Table, values: dict[str, str | None],
                           schema: pa.Schema) -> pa.Table:
    """A staged file's rows with their partition columns back (Delta keeps those in the
    add action, as strings), cast up to ``schema``'s types."""
    for name, value in values.items():
        dtype = schema.field(name).type
        column = (pa.nulls(table.num_rows, dtype) if value is None
                  else pa.array([value] * table.num_rows, pa.string()).cast(dtype))
        table = table.append_column(pa.field(name, dtype), column)
    return _schema.conform(table, schema)


# --------------------------------------------------------------------------- stats


def _stat_value(value: Any) -> Any:
    """A JSON stats value, or ``None`` when the type is not summarised (floats, timestamps
    and long strings are left out: a truncated max would skip files wrongly)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        return value if len(value) <= _STAT_STRING_MAX else None
    if isinstance(value, date) and type(value) is date:
        return value.isoformat()
    return None


@dataclass
class _ColumnStats:
    nulls: int = 0
    nulls_known: bool = True
    low: Any = None
    high: Any = None
    ranged: bool = True


def _file_stats(data: pa.Buffer, rows: int) -> str:
    """Delta ``stats`` JSON of one Parquet file, from its footer."""
    meta = pq.ParquetFile(pa.BufferReader(data)).metadata
    top = set(meta.schema.to_arrow_schema().names)
    columns: dict[str, _ColumnStats] = {}
    for g in range(meta.num_row_groups):
        group = meta.row_group(g)
        for c in range(group.num_columns):
            chunk = group.column(c)
            if chunk.path_in_schema in top:
                _merge_stats(columns.setdefault(chunk.path_in_schema, _ColumnStats()),
                             chunk.statistics, group.num_rows)
    doc: dict[str, Any] = {"numRecords": rows, "minValues": {}, "maxValues": {}, "nullCount": {}}
    for name, col in columns.items():
        if col.nulls_known:
            doc["nullCount"][name] = col.nulls
        if col.ranged and col.low is not None and col.high is not None:
            doc["minValues"][name] = col.low
            doc["maxValues"][name] = col.high
    return json.dumps(doc)


def _merge_stats(col: _ColumnStats, stats: Any, group_rows: int) -> None:
    if stats is None or not stats.has_null_count:
        col.nulls_known = False
    else:
        col.nulls += stats.null_count
    if stats is None or not stats.has_min_max:
        # an all-null row group has no range and does not widen one
        col.ranged = col.ranged and stats is not None and stats.null_count == group_rows
        return
    low, high = _stat_value(stats.min), _stat_value(stats.max)
    if low is None or high is None:
        col.ranged = False
        return
    col.low = low if col.low is None else min(col.low, low)
    col.high = high if col.high is None else max(col.high, high)


def _partition_value(value: Any) -> str | None:
    """Delta's string form of a partition value."""
    if value is None:
        return None
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, date):
        return value.isoformat()
    return str(value)


# --------------------------------------------------------------------------- options


@dataclass(frozen=True, kw_only=True, slots=True)
class _DeltaOptions:
    uri: str
    partition_by: tuple[str, ...]
    mode: Literal["append", "upsert"]
    key: tuple[str, ...] | None
    storage_options: dict[str, str] | None
    schema_evolution: _schema.SchemaEvolution
    max_file_rows: int
    compression: str

    @property
    def evolving(self) -> bool:
        return self.schema_evolution == "add_columns"

    @property
    def local(self) -> bool:
        return _is_local(self.uri)

    def store(self) -> FileStore:
        """The table directory as a ``FileStore`` (relative paths)."""
        if self.local:
            return FileStore(pafs.LocalFileSystem(), self.uri)
        from deltalake.fs import DeltaStorageHandler

        return FileStore(pafs.PyFileSystem(DeltaStorageHandler(self.uri, self.storage_options)), "")

    def load(self) -> Any | None:
        """The table, or ``None`` when there is none at ``uri``."""
        dl = _deltalake()
        if self.local and not os.path.isdir(os.path.join(self.uri, "_delta_log")):
            return None
        try:
            return dl.DeltaTable(self.uri, storage_options=self.storage_options)
        except dl.exceptions.TableNotFoundError:
            return None


class _TableCache:
    """One process's copy of the table, kept between calls and brought up to date.

    A full load replays the log from the last checkpoint and lists every file of the
    table, so its time and memory grow with the table: the coordinator checks the marker
    and commits, and every writer checks its first batch against the table's schema, at
    every epoch. ``update_incremental`` reads only the commits made since. Only a local
    table is cached: there a deleted or re-created table shows in its ``_delta_log``
    directory (gone, or another inode) before the copy is trusted. A table in an object
    store is loaded whole each time: nothing cheap tells that one was deleted.
    """

    def __init__(self, opts: _DeltaOptions) -> None:
        self._opts = opts
        self._table: Any | None = None
        self._log_inode: int | None = None

    def current(self) -> Any | None:
        """The table at its latest version, or ``None`` when there is none."""
        if not self._opts.local:
            return self._opts.load()
        try:
            inode = os.stat(os.path.join(self._opts.uri, "_delta_log")).st_ino
        except (FileNotFoundError, NotADirectoryError):
            self._table = self._log_inode = None
            return None
        if self._table is not None and inode == self._log_inode:
            try:
                self._table.update_incremental()
                return self._table
            except Exception as exc:  # fall back to a full load
                logger.debug("incremental update of %s failed: %s", self._opts.uri, exc)
        self._table, self._log_inode = self._opts.load(), inode
        return self._table

    def __getstate__(self) -> dict[str, Any]:
        return {"_opts": self._opts, "_table": None, "_log_inode": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)


class DeltaSink(Sink):
    """Exactly-once appends or upserts into a Delta table.

    ``path`` is a local directory or an object-store URI (``s3://``, ``az://``, ``gs://``;
    ``storage_options`` as for ``deltalake``). ``mode="upsert"`` needs ``key``: within and
    across epochs the last row per key wins. ``schema_evolution="add_columns"`` lets a
    batch add nullable columns, committed with the epoch's rows in one Delta commit; a
    type narrower than the table's is cast up; any other difference is a
    ``SchemaMismatchError`` naming the column.
    ``commit`` and ``abort`` are idempotent; ``validate`` creates nothing.
    """

    kind = "delta"

    def __init__(
        self,
        path: str,
        *,
        partition_by: Sequence[str] | None = None,
        mode: Literal["append", "upsert"] = "append",
        key: Sequence[str] | None = None,
        storage_options: dict[str, str] | None = None,
        schema_evolution: _schema.SchemaEvolution = "fail",
        max_file_rows: int = 1_000_000,
        compression: str = "zstd",
    ) -> None:
        if mode not in ("append", "upsert"):
            raise ConfigError(f"DeltaSink mode must be 'append' or 'upsert', got {mode!r}")
        self.schema_evolution = _schema.check_evolution_option("DeltaSink", schema_evolution)
        if key is not None and mode != "upsert":
            raise ConfigError(f"DeltaSink key={list(key)!r} only applies to mode='upsert'")
        if max_file_rows < 1:
            raise ConfigError(f"DeltaSink max_file_rows must be positive, got {max_file_rows!r}")
        uri = _local_path(path) if _is_local(path) else path.rstrip("/")
        self._opts = _DeltaOptions(
            uri=uri, partition_by=tuple(partition_by or ()), mode=mode,
            key=tuple(key) if key is not None else None,
            storage_options=dict(storage_options) if storage_options else None,
            schema_evolution=schema_evolution, max_file_rows=max_file_rows,
            compression=compression)
        self._cache = _TableCache(self._opts)

    # ------------------------------------------------------------------ description

    @property
    def path(self) -> str:
        return self._opts.uri

    @property
    def mode(self) -> str:
        return self._opts.mode

    @property
    def key(self) -> Sequence[str] | None:
        return self._opts.key

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "path": self._opts.uri, "mode": self._opts.mode,
                "key": list(self._opts.key) if self._opts.key else None,
                "partition_by": list(self._opts.partition_by),
                "schema_evolution": self._opts.schema_evolution}

    def _where(self, epoch: int | None = None) -> dict[str, Any]:
        return {"runtime": self.runtime or None, "sink": self.name or None, "epoch": epoch}

    def evolution_rules(self) -> _schema.Rules:
        return _rules(self._opts.uri)

    def _check_key(self) -> None:
        if self._opts.mode == "upsert" and not self._opts.key:
            raise ConfigError("DeltaSink(mode='upsert') needs key=[...] naming the upsert key",
                              **self._where())

    # ------------------------------------------------------------------ validate

    def validate(self) -> None:
        """Check the target without creating anything: the options, and that ``path`` is
        empty, absent (creatable) or a Delta table with the same partitioning."""
        self._check_key()
        try:
            dt = self._opts.load()
        except Exception as exc:
            raise SinkUnavailableError(f"cannot open {self._opts.uri!r} as a Delta table: {exc}",
                                       **self._where()) from exc
        if dt is not None:
            self._check_partitioning(dt)
            return
        if self._opts.local:
            self._validate_local_absent(Path(self._opts.uri))
        else:
            self._check_foreign(self._opts.store())

    def _check_partitioning(self, dt: Any) -> None:
        existing = tuple(dt.metadata().partition_columns)
        if existing != self._opts.partition_by:
            raise ConfigError(f"the Delta table at {self._opts.uri!r} is partitioned by "
                              f"{list(existing)!r}, got partition_by="
                              f"{list(self._opts.partition_by)!r}", **self._where())

    def _validate_local_absent(self, root: Path) -> None:
        if root.is_dir():
            self._check_foreign(self._opts.store())
            return
        probe = root
        while not probe.exists():
            probe = probe.parent
        if not probe.is_dir():
            raise SinkUnavailableError(f"{str(probe)!r} is a file, so the Delta table "
                                       f"{self._opts.uri!r} cannot be created there; "
                                       "choose another path", **self._where())

    def _check_foreign(self, store: FileStore) -> None:
        try:
            names = [info.base_name for info in store.entries()]
        except FileNotFoundError:
            return
        except NotADirectoryError as exc:
            raise self._holds_else() from exc
        except OSError as exc:
            raise SinkUnavailableError(f"cannot list {self._opts.uri!r}: {exc}",
                                       **self._where()) from exc
        # our staging, and an empty log left by a creation that crashed, are ours
        if any(name not in (STAGING_PREFIX, "_delta_log") for name in names):
            raise self._holds_else()

    def _holds_else(self) -> SinkUnavailableError:
        return SinkUnavailableError(
            f"{self._opts.uri!r} holds something that is not a Delta table (no _delta_log); "
            "point the sink at an empty or absent directory or an existing Delta table",
            **self._where())

    # ------------------------------------------------------------------ writer

    def create_writer(self, writer_id: int) -> DeltaSinkWriter:
        self._check_key()
        return DeltaSinkWriter(self._opts, writer_id, self._where())

    # ------------------------------------------------------------------ commit

    def commit(self, epoch: int, manifests: Sequence[Manifest]) -> CommitResult:
        """Add the epoch's staged files (or MERGE its rows) in one Delta commit carrying
        ``Transaction(marker_id, epoch)``. Idempotent: ``ALREADY`` when the marker says
        ``epoch`` is in; a lost race with another committer of the same epoch is
        recognised by re-checking the marker. ``NO_TARGET``: no table and no schema to
        create one with (an empty epoch nobody saw a schema for), nothing written."""
        self._check_key()
        files = self._checked_files(epoch, manifests)
        dt = self._cache.current()
        if dt is not None and self._has_marker(dt, epoch):
            self._cleanup_committed(epoch, files, rewritten=None)
            return CommitResult.ALREADY
        schema = self._epoch_schema(epoch, manifests)
        commit_failed = _deltalake().exceptions.CommitFailedError
        try:
            committed = self._commit_once(dt, epoch, manifests, files, schema)
        except commit_failed:
            dt = self._opts.load()
            if dt is None or not self._has_marker(dt, epoch):
                raise
            logger.info("Delta sink %s: epoch %d was committed concurrently", self.marker_id,
                        epoch)
            self._cleanup_committed(epoch, files, rewritten=None)
            return CommitResult.ALREADY
        if committed is not None:
            self._cleanup_committed(epoch, files, rewritten=committed.rewrite)
            logger.info("Delta sink %s committed epoch %d (%d files%s)", self.marker_id,
                        epoch, len(files), ", schema changed" if committed.changed else "")
            return CommitResult.COMMITTED
        return CommitResult.NO_TARGET

    def _commit_once(self, dt: Any | None, epoch: int, manifests: Sequence[Manifest],
                     files: list[dict[str, Any]], schema: pa.Schema | None
                     ) -> _SchemaPlan | None:
        """One Delta commit of the epoch; what it did to the schema, or ``None`` when there
        was no table and nothing to create one with."""
        if schema is None and dt is None:
            logger.info("Delta sink %s: epoch %d is empty and there is no table yet; "
                        "nothing to commit", self.marker_id, epoch)
            return None
        plan = dataclasses.replace(self._plan_schema(dt, epoch, manifests, schema),
                                   decision=decision_id(epoch, manifests))
        if self._opts.mode == "upsert":
            self._commit_upsert(dt, epoch, manifests, plan)
        elif plan.rewrite:
            self._commit_rewritten(dt, epoch, files, plan)
        else:
            self._commit_append(dt, epoch, files, plan)
        return plan

    def _plan_schema(self, dt: Any | None, epoch: int, manifests: Sequence[Manifest],
                     schema: pa.Schema | None) -> _SchemaPlan:
        """The table's schema after the epoch, and whether the epoch's files are rewritten
        (a new schema, or files holding a column in a type the table stores otherwise)."""
        if not self._opts.evolving or schema is None:
            if dt is not None and schema is not None:
                self._check_fits(dt, schema, epoch)
            return _SchemaPlan(schema=schema)
        if dt is None:  # created from the epoch's schema
            fits = all(_fits(s, schema) for s in _file_schemas(manifests))
            return _SchemaPlan(schema=schema, rewrite=not fits)
        evolution = _schema.evolve(_table_schema(dt), schema, self.evolution_rules(),
                                   where=self._where(epoch))
        final = evolution.schema
        fits = all(_fits(s, final) for s in _file_schemas(manifests))
        return _SchemaPlan(schema=final, changed=evolution.changed,
                           rewrite=evolution.changed or not fits)

    def _commit_properties(self, epoch: int, plan: _SchemaPlan | None = None) -> Any:
        """The marker (an app transaction) and, for a decision, which one it is."""
        dl = _deltalake()
        metadata = None if plan is None or plan.decision is None else {
            DECISION_KEYS[0]: self.marker_id, DECISION_KEYS[1]: str(epoch),
            DECISION_KEYS[2]: plan.decision}
        return dl.CommitProperties(
            custom_metadata=metadata,
            app_transactions=[dl.Transaction(app_id=self.marker_id, version=epoch)])

    def _commit_append(self, dt: Any | None, epoch: int, files: list[dict[str, Any]],
                       plan: _SchemaPlan) -> None:
        from deltalake.transaction import AddAction, create_table_with_add_actions

        actions = [AddAction(f["path"], int(f["size"]), dict(f["partition_values"]),
                             int(f["modification_time"]), True, f["stats"]) for f in files]
        hit("sink.mid_commit", runtime=self.runtime, sink=self.name, epoch=epoch)
        if dt is None:
            assert plan.schema is not None
            try:
                create_table_with_add_actions(
                    self._opts.uri, _deltalake().Schema.from_arrow(plan.schema), actions,
                    mode="error", partition_by=list(self._opts.partition_by) or None,
                    storage_options=self._opts.storage_options,
                    commit_properties=self._commit_properties(epoch, plan))
            except _deltalake().exceptions.DeltaError as exc:
                # another committer created the table first: never append blindly
                if self._opts.load() is None:
                    raise
                raise _deltalake().exceptions.CommitFailedError(str(exc)) from exc
            return
        dt.create_write_transaction(actions, "append", dt.schema(),
                                    commit_properties=self._commit_properties(epoch, plan))

    def _commit_upsert(self, dt: Any | None, epoch: int, manifests: Sequence[Manifest],
                       plan: _SchemaPlan) -> None:
        if dt is None:
            assert plan.schema is not None
            dt = _deltalake().DeltaTable.create(
                self._opts.uri, plan.schema, mode="ignore",
                partition_by=list(self._opts.partition_by) or None,
                storage_options=self._opts.storage_options)
            if plan.schema is not None:
                self._check_fits(dt, plan.schema, epoch)
        source = self._latest_rows(epoch, manifests, plan.schema)
        hit("sink.mid_commit", runtime=self.runtime, sink=self.name, epoch=epoch)
        if source is None or source.num_rows == 0:
            if plan.changed:  # no rows, but new columns: the metadata action and the marker
                self._write_merged(dt, _schema.loosen(plan.schema).empty_table(), epoch,
                                   plan)
                return
            dt.create_write_transaction([], "append", dt.schema(),
                                        commit_properties=self._commit_properties(epoch, plan))
            return
        assert self._opts.key is not None
        predicate = " AND ".join(f"t.`{k}` = s.`{k}`" for k in self._opts.key)
        (dt.merge(source, predicate, source_alias="s", target_alias="t",
                  merge_schema=plan.changed,
                  commit_properties=self._commit_properties(epoch, plan))
         .when_matched_update_all().when_not_matched_insert_all().execute())

    def _latest_rows(self, epoch: int, manifests: Sequence[Manifest],
                     schema: pa.Schema | None) -> pa.Table | None:
        """The epoch's staged rows (cast up to ``schema``'s types), last row per key
        (manifest order, then row order)."""
        store = self._opts.store()
        tables = [store.read_table(f["path"]) for m in manifests for f in m.get("files") or []]
        if not tables:
            return None
        if schema is not None:
            tables = [_schema.conform(t, schema) for t in tables]
        rows = pa.concat_tables(tables, promote_options="permissive")
        if schema is not None:
            rows = rows.cast(_data_schema(rows.schema, schema))
        assert self._opts.key is not None
        _check_keys(rows, self._opts.key, self._where(epoch))
        return _last_per_key(rows, self._opts.key)

    def _commit_rewritten(self, dt: Any | None, epoch: int, files: list[dict[str, Any]],
                          plan: _SchemaPlan) -> None:
        """Append mode, an epoch that changes the schema (or whose files hold a column in
        another type than the table's): its rows read, cast up to the new schema and
        written again in ONE commit with the metadata action and the marker."""
        assert plan.schema is not None
        store = self._opts.store()
        parts = [_with_partition_values(store.read_table(f["path"]),
                                        f.get("partition_values") or {}, plan.schema)
                 for f in files]
        rows = (pa.concat_tables(parts, promote_options="permissive") if parts
                else plan.schema.empty_table())
        rows = rows.cast(_data_schema(rows.schema, plan.schema))
        hit("sink.mid_commit", runtime=self.runtime, sink=self.name, epoch=epoch)
        self._write_merged(dt, rows, epoch, plan)

    def _write_merged(self, dt: Any | None, rows: pa.Table, epoch: int,
                      plan: _SchemaPlan) -> None:
        """One ``write_deltalake`` commit: ``rows``, the schema they add, the marker."""
        _deltalake().write_deltalake(
            dt if dt is not None else self._opts.uri, rows, mode="append", schema_mode="merge",
            partition_by=list(self._opts.partition_by) or None,
            storage_options=None if dt is not None else self._opts.storage_options,
            commit_properties=self._commit_properties(epoch, plan))

    def _check_fits(self, dt: Any, schema: pa.Schema, epoch: int) -> None:
        """``fail``: the epoch's schema must be the table's (Delta types, by name)."""
        refused = _schema.refusal(_table_schema(dt), schema, self.evolution_rules(),
                                  where=self._where(epoch))
        if refused is not None:
            raise refused

    def holds_decision(self, epoch: int, manifests: Sequence[Manifest]) -> bool | None:
        """Whether the commit that carried this sink's marker at ``epoch`` (looked for in
        the last ``HISTORY_SEARCHED`` versions' commit metadata) is the decision
        ``manifests``; ``None`` when it is not found there."""
        dt = self._opts.load()
        if dt is None:
            return None
        for info in dt.history(limit=HISTORY_SEARCHED):
            if (info.get(DECISION_KEYS[0]), info.get(DECISION_KEYS[1])) == (
                    self.marker_id, str(epoch)) and DECISION_KEYS[2] in info:
                return bool(info[DECISION_KEYS[2]] == decision_id(epoch, manifests))
        return None

    def _has_marker(self, dt: Any, epoch: int) -> bool:
        version = dt.transaction_version(self.marker_id)
        return version is not None and version >= epoch  # version 0 is falsy

    def _epoch_schema(self, epoch: int, manifests: Sequence[Manifest]) -> pa.Schema | None:
        schemas = [_schema.decode(text) for m in manifests if (text := m.get("schema"))]
        if not schemas:
            return None
        if self._opts.evolving:
            try:
                return _schema.union(schemas + _file_schemas(manifests))
            except SchemaMismatchError as exc:
                raise SchemaMismatchError(exc.message, column=exc.column,
                                          **self._where(epoch)) from None
        first = schemas[0]
        for other in schemas[1:]:
            if not _schema.same(first, other):
                raise SchemaMismatchError(
                    f"writers staged different schemas: {first} and {other}",
                    **self._where(epoch))
        return first

    def _checked_files(self, epoch: int, manifests: Sequence[Manifest] | None
                       ) -> list[dict[str, Any]]:
        files = [dict(f) for m in manifests or () for f in m.get("files") or []]
        for f in files:
            self._check_path(epoch, str(f["path"]))
        return files

    def _check_path(self, epoch: int, path: str) -> None:
        """Refuse any manifest path that is not a staged file of ``epoch``."""
        head, _, base = path.rpartition("/")
        match = STAGED_FILE.fullmatch(base)
        if (head != epoch_dir(STAGING_PREFIX, epoch) or match is None
                or int(match.group(1)) != epoch):
            raise MetaStoreError(f"manifest path {path!r} is not a file staged for epoch {epoch} "
                                 f"under {self._opts.uri!r}/{STAGING_PREFIX}; refused",
                                 **self._where(epoch))

    def _cleanup_committed(self, epoch: int, files: list[dict[str, Any]],
                           rewritten: bool | None) -> None:
        """Upsert mode, or an epoch whose rows were written again (``rewritten``; ``None``:
        not known, a re-run): the staged files were read into the commit, so they go (a
        re-run of an evolving append keeps those the table references)."""
        if self._opts.mode != "upsert" and rewritten is not True:
            if rewritten is None and self._opts.evolving and files:
                self.abort(epoch, [{"writer": -1, "rows": 0, "files": files}])
            return
        store = self._opts.store()
        for f in files:
            store.delete(f["path"])
        store.remove_empty_dir(epoch_dir(STAGING_PREFIX, epoch))

    # ------------------------------------------------------------------ abort, markers

    def abort(self, epoch: int, manifests: Sequence[Manifest] | None) -> None:
        """Delete the epoch's staged files (the listed ones, or every file under
        ``raysink/<epoch>/`` with ``None``), never one the table references. Idempotent."""
        store = self._opts.store()
        if manifests is None:
            paths = [p for p in store.list_files(epoch_dir(STAGING_PREFIX, epoch))
                     if STAGED_FILE.fullmatch(p.rpartition("/")[2])]
        else:
            paths = [f["path"] for f in self._checked_files(epoch, manifests)]
        keep = self._referenced() if paths and self._opts.mode == "append" else set()
        for path in paths:
            if path not in keep:
                store.delete(path)
        store.remove_empty_dir(epoch_dir(STAGING_PREFIX, epoch))

    def _referenced(self) -> set[str]:
        dt = self._opts.load()
        if dt is None:
            return set()
        return set(dt.get_add_actions(flatten=False).column("path").to_pylist())

    def committed_epoch(self) -> int | None:
        """The epoch of this sink's transaction marker; ``None`` when the table is missing
        (see ``target_exists``) or has no marker of this sink."""
        dt = self._cache.current()
        if dt is None:
            return None
        version = dt.transaction_version(self.marker_id)
        return None if version is None else int(version)

    def target_exists(self) -> bool:
        """Whether the Delta table exists. With ``committed_epoch() is None`` this tells a
        lost table (``DataLossError`` when the meta store says rows were committed) from a
        table that never received data (created by the next ``commit``)."""
        return self._opts.load() is not None

    def recreate_marker(self, epoch: int) -> None:
        """Write the marker at ``epoch`` in an empty commit (no epoch is pending).

        The marker lives in the Delta log with the data, so it only goes missing when the
        transaction expired (``delta.setTransactionRetentionDuration``); a missing table is
        a ``DataLossError``. Idempotent."""
        dt = self._opts.load()
        if dt is None:
            raise DataLossError(f"the Delta table {self._opts.uri!r} is gone after raysink "
                                "committed to it; restore it or start a new runtime",
                                **self._where(epoch))
        if self._has_marker(dt, epoch):
            return
        dt.create_write_transaction([], "append", dt.schema(),
                                    commit_properties=self._commit_properties(epoch))


# --------------------------------------------------------------------------- rows


def _check_keys(rows: pa.Table | pa.RecordBatch, key: Sequence[str],
                where: dict[str, Any]) -> None:
    missing = [k for k in key if k not in rows.schema.names]
    if missing:
        raise SchemaMismatchError(f"upsert key columns {missing!r} are not in the batch "
                                  f"(columns {rows.schema.names!r})", **where)
    nulls = [k for k in key if rows.column(k).null_count > 0]
    if nulls:
        raise SchemaMismatchError(f"upsert key columns {nulls!r} hold null values; "
                                  "every key value must be set", **where)


def _last_per_key(rows: pa.Table, key: Sequence[str]) -> pa.Table:
    """Keep the last row per key, in row order."""
    numbered = rows.append_column(_SEQ, pa.array(range(rows.num_rows), pa.int64()))
    last = numbered.group_by(list(key), use_threads=False).aggregate([(_SEQ, "max")])
    keep = pc.sort_indices(last.column(f"{_SEQ}_max"))
    return rows.take(pc.take(last.column(f"{_SEQ}_max"), keep))


# --------------------------------------------------------------------------- writer


@dataclass
class _EpochState:
    """One epoch of one writer: its schema (with ``add_columns``, the union of its
    batches'), the table's schema when the epoch began, a buffer per partition and
    schema."""

    schema: pa.Schema | None = None
    target: pa.Schema | None = None
    target_read: bool = False
    buffers: dict[tuple[tuple[str | None, ...], str], ParquetBuffer] = field(
        default_factory=dict)


class DeltaSinkWriter(SinkWriter):
    """Encodes an epoch's rows into Parquet in memory (per partition, rolling at
    ``max_file_rows``) and uploads them at ``pre_commit``. Schema, key and null checks run
    on every ``write``, so bad data fails the epoch before anything is staged."""

    def __init__(self, opts: _DeltaOptions, writer_id: int, where: dict[str, Any]) -> None:
        self._opts = opts
        self._writer_id = writer_id
        self._where = where
        self._store: FileStore | None = None
        self._epoch = _EpochState()
        self._staged: dict[tuple[int, int], list[str]] = {}
        self._table = _TableCache(opts)

    def open(self) -> None:
        if self._store is None:
            self._store = self._opts.store()

    def write(self, batch: pa.RecordBatch) -> None:
        batch = self._check_batch(batch)
        if batch.num_rows == 0:
            return
        for values, part in self._split(batch):
            slot = (values, _schema.encode(part.schema))
            buffer = self._epoch.buffers.get(slot)
            if buffer is None:
                buffer = ParquetBuffer(part.schema, self._opts.max_file_rows,
                                       self._opts.compression)
                self._epoch.buffers[slot] = buffer
            buffer.write(part)

    def _check_batch(self, batch: pa.RecordBatch) -> pa.RecordBatch:
        if self._opts.evolving:
            batch = self._evolve(batch)
        elif self._epoch.schema is None:
            self._check_against_table(batch.schema)
            self._epoch.schema = batch.schema.remove_metadata()
        elif not _schema.same(self._epoch.schema, batch.schema):
            raise SchemaMismatchError(f"batch schema {batch.schema} differs from the epoch's "
                                      f"{self._epoch.schema}", **self._where)
        missing = [c for c in self._opts.partition_by if c not in batch.schema.names]
        if missing:
            raise SchemaMismatchError(f"partition columns {missing!r} are not in the batch",
                                      **self._where)
        if self._opts.key:
            _check_keys(batch, self._opts.key, self._where)
        return batch

    def _evolve(self, batch: pa.RecordBatch) -> pa.RecordBatch:
        """``add_columns``: the batch must evolve the table's schema (read at the epoch's
        first batch); it is cast up to the table's types, and the epoch's schema becomes
        the union of its batches'."""
        epoch = self._epoch
        if not epoch.target_read:
            dt = self._table.current()
            epoch.target, epoch.target_read = (None if dt is None else _table_schema(dt)), True
        batch, epoch.schema = _schema.admit(batch, epoch.target, epoch.schema,
                                            _rules(self._opts.uri), where=self._where)
        return batch

    def _check_against_table(self, schema: pa.Schema) -> None:
        dt = self._table.current()
        if dt is None:
            return
        refused = _schema.refusal(_table_schema(dt), schema, _rules(self._opts.uri),
                                  where=self._where)
        if refused is not None:
            raise refused

    def _split(self, batch: pa.RecordBatch
               ) -> Iterator[tuple[tuple[str | None, ...], pa.RecordBatch]]:
        cols = list(self._opts.partition_by)
        if not cols or self._opts.mode == "upsert":
            yield (), batch
            return
        table = pa.Table.from_batches([batch])
        combos = table.select(cols).group_by(cols, use_threads=False).aggregate([])
        for combo in combos.to_pylist():
            mask = None
            for c in cols:
                column, value = table.column(c), combo[c]
                m = (pc.is_null(column) if value is None
                     else pc.equal(column, pa.scalar(value, column.type)))
                mask = m if mask is None else pc.and_(mask, m)
            part = table.filter(mask).drop_columns(cols).combine_chunks()
            values = tuple(_partition_value(combo[c]) for c in cols)
            for piece in part.to_batches():
                yield values, piece

    def pre_commit(self, epoch: int, attempt: int) -> Manifest:
        """Upload the epoch's files under ``raysink/<epoch>/`` and describe them."""
        self.open()
        assert self._store is not None
        unique = new_unique()
        files: list[dict[str, Any]] = []
        schema = self._epoch.schema
        for (values, _), buffer in self._epoch.buffers.items():
            partition = dict(zip(self._opts.partition_by, values, strict=True)) \
                if self._opts.mode == "append" else {}
            own = self._own_schema(buffer.schema)
            for encoded in buffer.finish():
                path = staged_file_path(STAGING_PREFIX, epoch, attempt, self._writer_id, unique,
                                        len(files))
                self._store.write(path, encoded.data)
                self._remember(epoch, attempt, path)
                files.append({"path": path, "size": encoded.data.size,
                              "partition_values": partition,
                              "modification_time": int(time.time() * 1000),
                              "stats": _file_stats(encoded.data, encoded.rows),
                              "rows": encoded.rows, **own})
        self._epoch = _EpochState()
        return {"writer": self._writer_id, "epoch": epoch, "attempt": attempt, "files": files,
                "rows": sum(f["rows"] for f in files), "bytes": sum(f["size"] for f in files),
                "schema": _schema.encode(schema) if schema is not None else None}

    def _own_schema(self, written: pa.Schema) -> dict[str, str]:
        """``{"schema": ...}`` for a file written in another schema than the epoch's (the
        writer's batches changed schema within it; partition columns aside), else ``{}``."""
        schema = self._epoch.schema
        if schema is None:
            return {}
        if self._opts.mode == "append" and self._opts.partition_by:
            schema = pa.schema([f for f in schema if f.name not in self._opts.partition_by])
        return {} if _schema.same(schema, written) else {"schema": _schema.encode(written)}

    def _remember(self, epoch: int, attempt: int, path: str) -> None:
        self._staged.setdefault((epoch, attempt), []).append(path)
        while len(self._staged) > _REMEMBERED_ATTEMPTS:
            del self._staged[min(self._staged)]

    def rollback(self, epoch: int, attempt: int) -> None:
        """Drop buffered rows and delete the files this writer staged for the attempt."""
        self._epoch = _EpochState()
        paths = self._staged.pop((epoch, attempt), [])
        if paths:
            self.open()
            assert self._store is not None
            for path in paths:
                self._store.delete(path)

    def close(self) -> None:
        self._epoch = _EpochState()
        self._store = None

