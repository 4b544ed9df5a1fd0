"""``DeltaSink``: the picklable description of a Delta table, and the coordinator's calls.

What is Delta's own, beside the staged-files base (``raysink.sinks._table_format``): the
commit (add actions, or a MERGE of the staged rows for upserts, or the rows written again
with the new schema), the marker (an app transaction in the commit) and the decision named
in the commit's metadata (``holds_decision``).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import pyarrow as pa

from raysink import _schema
from raysink._faults import hit
from raysink.errors import ConfigError, DataLossError, SinkUnavailableError
from raysink.sinks._files import FilesManifest, FileStore, files_manifests
from raysink.sinks._format import MARKER_FORMAT, check_marker
from raysink.sinks._maintenance import (
    Maintenance,
    MaintenanceReport,
    MaintenanceWindow,
    TableStats,
)
from raysink.sinks._table_format import StagedFilesSink, file_schemas
from raysink.sinks.base import CommitResult, Manifest, decision_id
from raysink.sinks.delta import _maintain
from raysink.sinks.delta._checksum import write_checksum
from raysink.sinks.delta._table import (
    HIDDEN_STAGING,
    STAGING_ROOTS,
    VISIBLE_STAGING,
    DeltaOptions,
    TableCache,
    check_keys,
    data_schema,
    deltalake_module,
    is_local,
    last_per_key,
    local_path,
    rules,
    stored_alike,
    table_schema,
    with_partition_values,
)
from raysink.sinks.delta._writer import DeltaSinkWriter

__all__ = ["DeltaSink"]

logger = logging.getLogger("raysink.sinks.delta")

DECISION_KEYS = ("raysink.sink", "raysink.epoch", "raysink.decision")
"""Commit metadata of a raysink commit: its marker id, epoch and decision (``holds_decision``)."""
FORMAT_KEY = "raysink.format"
"""Commit metadata: the marker's format (``raysink.sinks._format``; none: raysink 0.1.0's,
format 1), with the marker id and epoch, in every raysink commit."""
HISTORY_SEARCHED = 100


@dataclass(frozen=True, slots=True)
class _SchemaPlan:
    """What a commit does to the table's schema: ``schema`` after it, ``changed`` (an
    existing table gains columns), ``rewrite`` (the staged rows are written again); and
    the ``decision`` it commits (``decision_id``, kept in the commit's metadata)."""

    schema: pa.Schema | None
    changed: bool = False
    rewrite: bool = False
    decision: str | None = None



class DeltaSink(StagedFilesSink):
    """Exactly-once appends or upserts into a Delta table.

    ``path`` is a local directory or an object-store URI (``s3://``, ``az://``, ``gs://``;
    ``storage_options`` as for ``deltalake``). ``mode="upsert"`` needs ``key``: within and
    across epochs the last row per key wins. ``schema_evolution="add_columns"`` lets a
    batch add nullable columns, committed with the epoch's rows in one Delta commit; a
    type narrower than the table's is cast up; any other difference is a
    ``SchemaMismatchError`` naming the column.
    ``commit`` and ``abort`` are idempotent; ``validate`` creates nothing.

    ``maintenance``: the coordinator keeps the table small between commits (compaction
    per partition, checkpoints, expiry of removed files and old log entries;
    ``raysink.sinks.delta._maintain``) by ``raysink.Maintenance()``'s defaults; pass a
    ``Maintenance(...)`` to tune it or ``False`` to switch it off for this sink.
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
        maintenance: Maintenance | bool | None = None,
    ) -> None:
        if mode not in ("append", "upsert"):
            raise ConfigError(f"DeltaSink mode must be 'append' or 'upsert', got {mode!r}")
        self.schema_evolution = _schema.check_evolution_option("DeltaSink", schema_evolution)
        if key is not None and mode != "upsert":
            raise ConfigError(f"DeltaSink key={list(key)!r} only applies to mode='upsert'")
        if max_file_rows < 1:
            raise ConfigError(f"DeltaSink max_file_rows must be positive, got {max_file_rows!r}")
        uri = local_path(path) if is_local(path) else path.rstrip("/")
        self.maintenance = Maintenance.of(maintenance, "DeltaSink")
        self._opts = DeltaOptions(
            uri=uri, partition_by=tuple(partition_by or ()), mode=mode,
            key=tuple(key) if key is not None else None,
            storage_options=dict(storage_options) if storage_options else None,
            schema_evolution=schema_evolution, max_file_rows=max_file_rows,
            compression=compression,
            staging=HIDDEN_STAGING if self.maintenance.enabled else VISIBLE_STAGING)
        self._cache = TableCache(self._opts)
        self._checksum_at: int | None = None

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

    def evolution_rules(self) -> _schema.Rules:
        return rules(self._opts.uri)

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
        if any(name not in (*STAGING_ROOTS, "_delta_log") for name in names):
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
        files = self._checked_files(epoch, manifests, STAGING_ROOTS)
        # as the marker check just read it (the coordinator reads the marker before each
        # commit): a commit of a version made since fails, and the marker is read again
        dt = self._cache.latest()
        if dt is not None and self._has_marker(dt, epoch):
            self._cleanup_committed(epoch, files, rewritten=None)
            return CommitResult.ALREADY
        schema = self._epoch_schema(epoch, manifests)
        commit_failed = deltalake_module().exceptions.CommitFailedError
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
            self._write_checksum()
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
            fits = all(stored_alike(s, schema) for s in file_schemas(manifests))
            return _SchemaPlan(schema=schema, rewrite=not fits)
        evolution = _schema.evolve(table_schema(dt), schema, self.evolution_rules(),
                                   where=self._where(epoch))
        final = evolution.schema
        fits = all(stored_alike(s, final) for s in file_schemas(manifests))
        return _SchemaPlan(schema=final, changed=evolution.changed,
                           rewrite=evolution.changed or not fits)

    def _commit_properties(self, epoch: int, plan: _SchemaPlan | None = None) -> Any:
        """The marker (an app transaction) and, for a decision, which one it is."""
        dl = deltalake_module()
        metadata = {DECISION_KEYS[0]: self.marker_id, DECISION_KEYS[1]: str(epoch),
                    FORMAT_KEY: str(MARKER_FORMAT)}
        if plan is not None and plan.decision is not None:
            metadata[DECISION_KEYS[2]] = plan.decision
        return dl.CommitProperties(
            custom_metadata=metadata,
            app_transactions=[dl.Transaction(app_id=self.marker_id, version=epoch)])

    def _hooks(self) -> Any:
        return _maintain.commit_hooks(self.maintenance)

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
                    self._opts.uri, deltalake_module().Schema.from_arrow(plan.schema), actions,
                    mode="error", partition_by=list(self._opts.partition_by) or None,
                    configuration=_maintain.new_table_configuration(self.maintenance),
                    storage_options=self._opts.storage_options,
                    commit_properties=self._commit_properties(epoch, plan),
                    post_commithook_properties=self._hooks())
            except deltalake_module().exceptions.DeltaError as exc:
                # another committer created the table first: never append blindly
                if self._opts.load() is None:
                    raise
                raise deltalake_module().exceptions.CommitFailedError(str(exc)) from exc
            return
        dt.create_write_transaction(actions, "append", dt.schema(),
                                    commit_properties=self._commit_properties(epoch, plan),
                                    post_commithook_properties=self._hooks())

    def _commit_upsert(self, dt: Any | None, epoch: int, manifests: Sequence[Manifest],
                       plan: _SchemaPlan) -> None:
        if dt is None:
            assert plan.schema is not None
            dt = deltalake_module().DeltaTable.create(
                self._opts.uri, plan.schema, mode="ignore",
                partition_by=list(self._opts.partition_by) or None,
                configuration=_maintain.new_table_configuration(self.maintenance),
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
                                        commit_properties=self._commit_properties(epoch, plan),
                                        post_commithook_properties=self._hooks())
            return
        assert self._opts.key is not None
        predicate = " AND ".join(f"t.`{k}` = s.`{k}`" for k in self._opts.key)
        (dt.merge(source, predicate, source_alias="s", target_alias="t",
                  merge_schema=plan.changed,
                  commit_properties=self._commit_properties(epoch, plan),
                  post_commithook_properties=self._hooks())
         .when_matched_update_all().when_not_matched_insert_all().execute())

    def _latest_rows(self, epoch: int, manifests: Sequence[Manifest],
                     schema: pa.Schema | None) -> pa.Table | None:
        """The epoch's staged rows (cast up to ``schema``'s types), last row per key
        (manifest order, then row order)."""
        store = self._opts.store()
        tables = [store.read_table(f["path"]) for m in files_manifests(manifests)
                  for f in m.get("files") or []]
        if not tables:
            return None
        if schema is not None:
            tables = [_schema.conform(t, schema) for t in tables]
        rows = pa.concat_tables(tables, promote_options="permissive")
        if schema is not None:
            rows = rows.cast(data_schema(rows.schema, schema))
        assert self._opts.key is not None
        check_keys(rows, self._opts.key, self._where(epoch))
        return last_per_key(rows, self._opts.key)

    def _commit_rewritten(self, dt: Any | None, epoch: int, files: list[dict[str, Any]],
                          plan: _SchemaPlan) -> None:
        """Append mode, an epoch that changes the schema (or whose files hold a column in
        another type than the table's): its rows read, cast up to the new schema and
        written again in ONE commit with the metadata action and the marker."""
        assert plan.schema is not None
        store = self._opts.store()
        parts = [with_partition_values(store.read_table(f["path"]),
                                        f.get("partition_values") or {}, plan.schema)
                 for f in files]
        rows = (pa.concat_tables(parts, promote_options="permissive") if parts
                else plan.schema.empty_table())
        rows = rows.cast(data_schema(rows.schema, plan.schema))
        hit("sink.mid_commit", runtime=self.runtime, sink=self.name, epoch=epoch)
        self._write_merged(dt, rows, epoch, plan)

    def _write_merged(self, dt: Any | None, rows: pa.Table, epoch: int,
                      plan: _SchemaPlan) -> None:
        """One ``write_deltalake`` commit: ``rows``, the schema they add, the marker."""
        deltalake_module().write_deltalake(
            dt if dt is not None else self._opts.uri, rows, mode="append", schema_mode="merge",
            partition_by=list(self._opts.partition_by) or None,
            storage_options=None if dt is not None else self._opts.storage_options,
            commit_properties=self._commit_properties(epoch, plan),
            post_commithook_properties=self._hooks())

    def _check_fits(self, dt: Any, schema: pa.Schema, epoch: int) -> None:
        """``fail``: the epoch's schema must be the table's (Delta types, by name)."""
        refused = _schema.refusal(table_schema(dt), schema, self.evolution_rules(),
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

    def _cleanup_committed(self, epoch: int, files: list[dict[str, Any]],
                           rewritten: bool | None) -> None:
        """Upsert mode, or an epoch whose rows were written again (``rewritten``; ``None``:
        not known, a re-run): the staged files were read into the commit, so they go (a
        re-run of an evolving append keeps those the table references)."""
        if self._opts.mode != "upsert" and rewritten is not True:
            if rewritten is None and self._opts.evolving and files:
                listed: FilesManifest = {"writer": -1, "rows": 0, "files": files}
                self.abort(epoch, [listed])
            return
        paths = [str(f["path"]) for f in files]
        # only the roots the epoch staged under: an upsert commits this every epoch
        roots = [r for r in STAGING_ROOTS if any(p.startswith(f"{r}/") for p in paths)]
        self._delete_staged(epoch, roots, paths)

    # ------------------------------------------------------------------ maintenance

    def maintain(self, window: MaintenanceWindow) -> MaintenanceReport:
        """One pass: compaction, checkpoint, expiry of removed files, log cleanup (run by
        the coordinator between this sink's commits; ``_maintain``)."""
        report = _maintain.maintain(self._opts, self.maintenance, window, sink=self.name,
                                    runtime=self.runtime)
        self._write_checksum()
        return report

    def _write_checksum(self) -> None:
        """The newest version's checksum file, so that a fresh Spark reader reads the
        protocol and metadata from it instead of running two jobs (``_checksum``)."""
        dt = self._cache.current()
        if dt is not None:
            self._checksum_at = write_checksum(self._opts.store(), dt, self.name,
                                               self._checksum_at)

    def table_stats(self) -> TableStats | None:
        dt = self._cache.current()
        return None if dt is None else _maintain.stats(self._opts, dt)

    # ------------------------------------------------------------------ abort, markers

    def _staging_roots(self, table: Any | None) -> list[str]:
        return list(STAGING_ROOTS)

    def _root_store(self, root: str) -> FileStore:
        return self._opts.store(root)

    def _staging_place(self) -> str:
        return f"under {self._opts.uri!r}/{' or '.join(STAGING_ROOTS)}"

    def _referenced(self, table: Any | None) -> set[str]:
        """The files the table references (append mode: an upsert's staged files never
        are, their rows are merged)."""
        if self._opts.mode != "append":
            return set()
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
        if version is not None:
            self._check_format(dt)
        return None if version is None else int(version)

    def _check_format(self, dt: Any) -> None:
        """The newest commit's marker format, when the commit is this sink's (a newer
        raysink's is refused: ``check_marker``)."""
        newest = next(iter(dt.history(limit=1)), None) or {}
        if newest.get(DECISION_KEYS[0]) != self.marker_id:
            return
        value = newest.get(FORMAT_KEY)
        marker = {} if value is None else {"format": int(value) if str(value).isdigit()
                                           else value}
        check_marker(marker, runtime=self.runtime or None, sink=self.name or None,
                     where=f"version {newest.get('version')} of Delta table {self._opts.uri!r}")

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
                                    commit_properties=self._commit_properties(epoch),
                                    post_commithook_properties=self._hooks())

