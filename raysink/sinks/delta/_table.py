"""The Delta table as the sink and its writers see it: ``deltalake`` imported lazily,
the options (``DeltaOptions``), one process's cached copy of the table
(``TableCache``), Delta's types and evolution rules, and the row helpers of the commits
that read staged rows back (upserts, and epochs that change the schema)."""

from __future__ import annotations

import functools
import json
import logging
import os
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Literal

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs

from raysink import _schema
from raysink.errors import ConfigError, SchemaMismatchError
from raysink.protocol.requirements import check_extra
from raysink.sinks._files import FileStore

__all__ = ["HIDDEN_STAGING", "STAGING_ROOTS", "VISIBLE_STAGING", "DeltaOptions", "TableCache",
           "check_keys", "data_schema", "deltalake_module", "last_per_key", "rules",
           "stored_alike", "table_schema", "with_partition_values"]

logger = logging.getLogger(__name__)

HIDDEN_STAGING = "_raysink"
"""Where a maintained sink stages (relative to the table directory). Delta's ``VACUUM``
(Spark's and delta-rs's) skips directories whose names begin with ``_``, so a ``VACUUM``
run outside raysink, however short its retention, never deletes the files of an epoch
still pending; the files raysink's own compaction removes from the table, ``expire_files``
deletes (``_maintain``)."""
VISIBLE_STAGING = "raysink"
"""Where an unmaintained sink stages (``maintenance=False``), and where every sink staged
up to 0.2: the table's own ``VACUUM`` reclaims what a user's ``OPTIMIZE`` or ``MERGE``
removes. Such a table keeps Delta's 7-day tombstones."""
STAGING_ROOTS = (HIDDEN_STAGING, VISIBLE_STAGING)
"""Both staging roots: recovery, abort and cleanup look under each, so an epoch staged
under either (an earlier release's, a sink whose maintenance was switched) is found."""
_SEQ = "__raysink_seq"


def deltalake_module() -> ModuleType:
    try:
        import deltalake
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ConfigError("DeltaSink needs deltalake: pip install 'raysink[delta]'") from exc
    check_extra("delta")
    return deltalake


def is_local(path: str) -> bool:
    return "://" not in path or path.startswith("file://")


def local_path(path: str) -> str:
    return os.path.abspath(path.removeprefix("file://"))


# --------------------------------------------------------------------------- schema


def _delta_fields(schema: pa.Schema) -> dict[str, Any]:
    """Column name -> Delta type (JSON form) of an Arrow schema."""
    doc = json.loads(deltalake_module().Schema.from_arrow(schema).to_json())
    return {f["name"]: f["type"] for f in doc["fields"]}


@functools.lru_cache(maxsize=512)
def _delta_type(dtype: pa.DataType) -> str:
    """The Delta type (its JSON form) that stores Arrow ``dtype``."""
    return json.dumps(_delta_fields(pa.schema([pa.field("c", dtype)]))["c"], sort_keys=True)


def _delta_key(field: pa.Field) -> Hashable:
    return _delta_type(field.type)


def rules(uri: str) -> _schema.Rules:
    """Delta's rules: Delta types; no widening (delta-rs cannot write the typeWidening
    table feature)."""
    return _schema.Rules(target=f"the Delta table {uri!r}", key=_delta_key,
                         refuses_widening="delta-rs cannot change a Delta column's type")


def table_schema(dt: Any) -> pa.Schema:
    """The table's schema in Arrow."""
    return pa.schema(dt.schema().to_arrow())


def stored_alike(written: pa.Schema, schema: pa.Schema) -> bool:
    """Whether a file written in ``written`` holds each column as the table stores it."""
    return all(_delta_type(f.type) == _delta_type(schema.field(f.name).type)
               for f in written if f.name in schema.names)


# --------------------------------------------------------------------------- options


@dataclass(frozen=True, kw_only=True, slots=True)
class DeltaOptions:
    uri: str
    partition_by: tuple[str, ...]
    mode: Literal["append", "upsert"]
    key: tuple[str, ...] | None
    storage_options: dict[str, str] | None
    schema_evolution: _schema.SchemaEvolution
    max_file_rows: int
    compression: str
    staging: str = HIDDEN_STAGING
    """The staging root new epochs' files go to (``HIDDEN_STAGING``, ``VISIBLE_STAGING``)."""

    @property
    def evolving(self) -> bool:
        return self.schema_evolution == "add_columns"

    @property
    def local(self) -> bool:
        return is_local(self.uri)

    def store(self, under: str = "") -> FileStore:
        """The table directory (or its subdirectory ``under``) as a ``FileStore``
        (relative paths)."""
        if self.local:
            return FileStore(pafs.LocalFileSystem(), f"{self.uri}/{under}" if under else self.uri)
        from deltalake.fs import DeltaStorageHandler

        handler = DeltaStorageHandler(self.uri, self.storage_options)
        return FileStore(pafs.PyFileSystem(handler), under)

    def load(self) -> Any | None:
        """The table, or ``None`` when there is none at ``uri``."""
        dl = deltalake_module()
        if self.local and not os.path.isdir(os.path.join(self.uri, "_delta_log")):
            return None
        try:
            return dl.DeltaTable(self.uri, storage_options=self.storage_options)
        except dl.exceptions.TableNotFoundError:
            return None


class TableCache:
    """One process's copy of the table, kept between calls and brought up to date.

    A full load replays the log from the last checkpoint and lists every file of the
    table, so its time and memory grow with the table: the coordinator checks the marker
    and commits, and every writer checks its first batch against the table's schema, at
    every epoch. ``update_incremental`` reads only the commits made since. Only a local
    table is cached: there a deleted or re-created table shows in its ``_delta_log``
    directory (gone, or another inode) before the copy is trusted. A table in an object
    store is loaded whole each time: nothing cheap tells that one was deleted.
    """

    def __init__(self, opts: DeltaOptions) -> None:
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

    def latest(self) -> Any | None:
        """The table as the last ``current()`` left it, without reading the log again
        (``current()`` when nothing is cached, or the table is not local). Each
        ``update_incremental`` lists the whole ``_delta_log``, which holds every retained
        version (about 1,200 entries at 14 epochs a second and ``keep_seconds=60``: 5 ms a
        listing); a caller that needs the table as of a moment ago, and whose commit
        fails on a newer version anyway, takes this one."""
        if self._table is None or not self._opts.local:
            return self.current()
        return self._table

    def __getstate__(self) -> dict[str, Any]:
        return {"_opts": self._opts, "_table": None, "_log_inode": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)


# --------------------------------------------------------------------------- rows


def data_schema(data: pa.Schema, schema: pa.Schema) -> pa.Schema:
    """The rows' schema with each column as nullable as the table's (new ones nullable)."""
    return pa.schema([f.with_nullable(schema.field(f.name).nullable)
                      if f.name in schema.names else f.with_nullable(True) for f in data])


def with_partition_values(table: pa.Table, values: dict[str, str | None],
                          schema: pa.Schema) -> pa.Table:
    """A staged file's rows with their partition columns back (Delta keeps those in the
    add action, as strings), cast up to ``schema``'s types."""
    for name, value in values.items():
        dtype = schema.field(name).type
        column = (pa.nulls(table.num_rows, dtype) if value is None
                  else pa.array([value] * table.num_rows, pa.string()).cast(dtype))
        table = table.append_column(pa.field(name, dtype), column)
    return _schema.conform(table, schema)


def check_keys(rows: pa.Table | pa.RecordBatch, key: Sequence[str],
               where: dict[str, Any]) -> None:
    missing = [k for k in key if k not in rows.schema.names]
    if missing:
        raise SchemaMismatchError(f"upsert key columns {missing!r} are not in the batch "
                                  f"(columns {rows.schema.names!r})", **where)
    nulls = [k for k in key if rows.column(k).null_count > 0]
    if nulls:
        raise SchemaMismatchError(f"upsert key columns {nulls!r} hold null values; "
                                  "every key value must be set", **where)


def last_per_key(rows: pa.Table, key: Sequence[str]) -> pa.Table:
    """Keep the last row per key, in row order."""
    numbered = rows.append_column(_SEQ, pa.array(range(rows.num_rows), pa.int64()))
    last = numbered.group_by(list(key), use_threads=False).aggregate([(_SEQ, "max")])
    keep = pc.sort_indices(last.column(f"{_SEQ}_max"))
    return rows.take(pc.take(last.column(f"{_SEQ}_max"), keep))
