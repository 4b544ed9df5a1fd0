"""``IcebergSink``: the picklable description of an Iceberg table, and the coordinator's
calls.

What is Iceberg's own, beside the staged-files base (``raysink.sinks._table_format``):
the commit (one fast-append of the staged data files, each in its partition, with the
schema update when the epoch evolves it, in one table transaction), the marker (the
snapshot summary and a table property) and the table's creation, with its partition
spec, at the first commit.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from raysink import _schema
from raysink._faults import hit
from raysink.errors import ConfigError, DataLossError, SinkUnavailableError
from raysink.sinks._files import FileStore
from raysink.sinks._format import MARKER_FORMAT, check_marker
from raysink.sinks._maintenance import (
    Maintenance,
    MaintenanceReport,
    MaintenanceWindow,
    TableStats,
)
from raysink.sinks._table_format import StagedFilesSink
from raysink.sinks.base import CommitResult, Manifest, decision_id
from raysink.sinks.iceberg._data_files import epoch_data_files
from raysink.sinks.iceberg._partition import (
    PartitionBy,
    WriteSpec,
    parse_partition_by,
    table_spec,
)
from raysink.sinks.iceberg._table import (
    NO_RETRY,
    IcebergOptions,
    check_schema,
    default_catalog,
    pyiceberg_module,
    redact,
    referenced,
    rules,
    sqlite_file,
)
from raysink.sinks.iceberg._writer import IcebergSinkWriter

if TYPE_CHECKING:
    from raysink.sinks.iceberg._maintain import IcebergMaintenance

__all__ = ["DECISION_PROPERTY", "EPOCH_PROPERTY", "SINK_PROPERTY", "IcebergSink"]

logger = logging.getLogger("raysink.sinks.iceberg")

SINK_PROPERTY = "raysink.sink"
EPOCH_PROPERTY = "raysink.epoch"
DECISION_PROPERTY = "raysink.decision"
NAME_MAPPING = "schema.name-mapping.default"
FORMAT_PROPERTY = "raysink.format"
"""Snapshot summary keys of a raysink commit: its marker id, epoch, decision and marker
format (``raysink.sinks._format``; none: raysink 0.1.0's, format 1); the table property
``raysink.epoch.<marker id>`` holds the sink's high-water epoch."""


class IcebergSink(StagedFilesSink):
    """Exactly-once appends to an Iceberg table.

    ``identifier`` is ``"namespace.table"`` (nested namespaces with more dots).
    ``catalog`` holds pyiceberg catalog properties (default: SQLite under
    ``<cwd>/.raysink/iceberg``); ``catalog_name`` names it. ``table_properties`` apply
    when raysink creates the table. ``commit`` and ``abort`` are idempotent; ``validate``
    creates nothing.
    ``partition_by`` partitions a table raysink creates: a column name (identity) or
    ``(column, transform)`` (or ``(column, transform, field name)``), the transform one of
    ``identity``, ``year``, ``month``, ``day``, ``hour``, ``bucket[N]``, ``truncate[W]``. A
    table that exists keeps its own spec: raysink writes with its current spec, whatever
    ``partition_by`` says (a differing one is logged).
    ``schema_evolution="add_columns"`` adds new columns and widens int to long, float to
    double and decimal precision, in the epoch's own commit; anything else is a
    ``SchemaMismatchError`` naming the column.

    ``maintenance`` (``True`` by default, a ``raysink.Maintenance``, or ``False``): what
    ``maintain`` does between two commits (compaction, manifest merging, snapshot expiry,
    old metadata deleted; ``raysink.sinks.iceberg._maintain``).
    """

    kind = "iceberg"

    def __init__(
        self,
        identifier: str,
        *,
        catalog: Mapping[str, str] | None = None,
        catalog_name: str = "raysink",
        table_properties: Mapping[str, str] | None = None,
        max_file_rows: int = 1_000_000,
        compression: str = "zstd",
        commit_attempts: int = 5,
        schema_evolution: _schema.SchemaEvolution = "fail",
        partition_by: PartitionBy | None = None,
        maintenance: Maintenance | bool | None = None,
    ) -> None:
        self.schema_evolution = _schema.check_evolution_option("IcebergSink",
                                                               schema_evolution)
        parts = identifier.split(".")
        if len(parts) < 2 or not all(parts):
            raise ConfigError(f"IcebergSink identifier must be 'namespace.table', got "
                              f"{identifier!r}")
        if max_file_rows < 1 or commit_attempts < 1:
            raise ConfigError("IcebergSink max_file_rows and commit_attempts must be positive, "
                              f"got {max_file_rows!r} and {commit_attempts!r}")
        self._opts = IcebergOptions(
            namespace=tuple(parts[:-1]), table=parts[-1], catalog_name=catalog_name,
            catalog=dict(catalog) if catalog is not None else default_catalog(),
            table_properties=dict(table_properties or {}), max_file_rows=max_file_rows,
            compression=compression, commit_attempts=commit_attempts,
            schema_evolution=self.schema_evolution,
            partition_by=parse_partition_by(partition_by))
        self.maintenance = Maintenance.of(maintenance, "IcebergSink")

    @property
    def identifier(self) -> str:
        return self._opts.identifier

    @property
    def epoch_property(self) -> str:
        """The table property holding this sink's high-water epoch."""
        return f"{EPOCH_PROPERTY}.{self.marker_id}"

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "identifier": self._opts.identifier,
                "catalog_name": self._opts.catalog_name,
                "catalog": redact(self._opts.catalog),
                "schema_evolution": self.schema_evolution,
                "partition_by": WriteSpec(self._opts.partition_by).signature()}

    def evolution_rules(self) -> _schema.Rules:
        return rules(self._opts.identifier)

    # ------------------------------------------------------------------ validate

    def validate(self) -> None:
        """Check the catalog and table without creating anything (no catalog database,
        tables, namespace or directories)."""
        sqlite = sqlite_file(self._opts.catalog)
        if sqlite is not None and not sqlite.exists():
            self._check_creatable(sqlite)
            self._opts.default_location()
            return
        try:
            table = self._opts.load_table()
        except ConfigError:
            raise
        except Exception as exc:
            raise SinkUnavailableError(
                f"cannot open the Iceberg table {self._opts.identifier!r} in catalog "
                f"{self._opts.catalog_name!r}: {exc}", **self._where()) from exc
        if table is None:
            self._opts.default_location()
            return
        self._check_table(table)

    def _check_creatable(self, path: Path) -> None:
        probe = path.parent
        while not probe.exists():
            probe = probe.parent
        if not probe.is_dir():
            raise SinkUnavailableError(f"{str(probe)!r} is a file, so the catalog database "
                                       f"{str(path)!r} cannot be created", **self._where())

    def _check_table(self, table: Any) -> None:
        """The table's spec is one writers can split by (``ConfigError`` otherwise); a
        ``partition_by`` that differs from it is logged (the table's spec wins)."""
        spec = table_spec(table, self._opts.identifier)
        wanted = WriteSpec(self._opts.partition_by)
        if wanted.partitioned and wanted.signature() != spec.signature():
            logger.warning("Iceberg sink %s: the table %s exists with partition spec %s; "
                           "raysink writes with it, not partition_by=%s", self.marker_id,
                           self._opts.identifier, spec.signature(), wanted.signature())

    # ------------------------------------------------------------------ writer

    def create_writer(self, writer_id: int) -> IcebergSinkWriter:
        return IcebergSinkWriter(self._opts, writer_id, self._where())

    # ------------------------------------------------------------------ commit

    def commit(self, epoch: int, manifests: Sequence[Manifest]) -> CommitResult:
        """One fast-append snapshot of every staged file, marked with this sink and epoch.
        Idempotent (``ALREADY``); a lost compare-and-swap re-checks the marker before
        retrying. ``NO_TARGET``: no table and no schema to create one with, nothing
        written."""
        schema = self._epoch_schema(epoch, manifests)
        errors = pyiceberg_module().exceptions
        last: Exception | None = None
        for _ in range(self._opts.commit_attempts):
            table = self._opts.load_table()
            if table is None:
                if schema is None:
                    logger.info("Iceberg sink %s: epoch %d is empty and there is no table yet; "
                                "nothing to commit", self.marker_id, epoch)
                    return CommitResult.NO_TARGET
                table = self._create_table(schema)
            if self._is_committed(table, epoch):
                return CommitResult.ALREADY
            roots = self._opts.staging_roots(table)
            files = self._checked_files(epoch, manifests, roots)
            try:
                replaced = self._append(self._without_retry(table), epoch, files, schema,
                                        decision_id(epoch, manifests))
            except (errors.CommitFailedException, errors.CommitStateUnknownException) as exc:
                last = exc
                continue
            logger.info("Iceberg sink %s committed epoch %d (%d files)", self.marker_id, epoch,
                        len(files))
            self._drop_replaced(epoch, roots, replaced)
            return CommitResult.COMMITTED
        raise SinkUnavailableError(
            f"commits to {self._opts.identifier!r} kept losing to concurrent ones after "
            f"{self._opts.commit_attempts} attempts; it will be retried", **self._where(epoch)
        ) from last

    def _create_table(self, schema: pa.Schema) -> Any:
        """Create the catalog database, namespace and table, with ``partition_by``'s spec,
        in one catalog commit (first commit only)."""
        catalog = self._opts.open_catalog(create=True)
        assert catalog is not None
        errors = pyiceberg_module().exceptions
        catalog.create_namespace_if_not_exists(self._opts.namespace)
        try:
            tx = catalog.create_table_transaction(
                self._opts.identifier, schema=schema, location=self._opts.default_location(),
                properties={**self._opts.table_properties, **NO_RETRY})
            if self._opts.partition_by:
                self._add_spec(tx)
            table = tx.commit_transaction()
        except (errors.TableAlreadyExistsError, errors.CommitFailedException):
            return catalog.load_table(self._opts.identifier)
        logger.info("Iceberg sink %s created table %s", self.marker_id, self._opts.identifier)
        return table

    def _add_spec(self, tx: Any) -> None:
        """``partition_by`` as the new table's spec; a transform that does not apply to
        its column's type is a ``ConfigError``."""
        try:
            with tx.update_spec() as update:
                for field in self._opts.partition_by:
                    update.add_field(field.source, field.transform, field.name)
        except ValueError as exc:
            raise ConfigError(f"IcebergSink partition_by does not fit the table "
                              f"{self._opts.identifier!r}: {exc}", **self._where()) from exc

    def _drop_replaced(self, epoch: int, roots: Sequence[str], paths: Sequence[str]) -> None:
        """Delete staged files the commit added split by partition (best effort: one left
        behind is referenced by nothing)."""
        if not paths:
            return
        try:
            self._delete_staged(epoch, roots, paths)
        except Exception as exc:  # the commit holds; a stray file costs only space
            logger.warning("Iceberg sink %s: could not delete staged files %s of epoch %d "
                           "after splitting them by partition: %s", self.marker_id, paths,
                           epoch, exc)

    def _without_retry(self, table: Any) -> Any:
        """Turn pyiceberg's own commit retry off on the table (a property-only commit)."""
        if all(table.properties.get(k) == v for k, v in NO_RETRY.items()):
            return table
        with table.transaction() as tx:
            tx.set_properties(NO_RETRY)
        return self._opts.load_table()

    def _append(self, table: Any, epoch: int, files: Sequence[dict[str, Any]],
                schema: pa.Schema | None, decision: str | None = None) -> list[str]:
        """The epoch's commit: the schema update, the files in their partitions and the
        marker in one table transaction. Returns the staged files it replaced by their
        split (see ``_data_files``)."""
        replaced: list[str] = []
        evolved = None
        if schema is not None and self._opts.evolving:
            evolution = _schema.evolve(table.schema().as_arrow(), schema,
                                       self.evolution_rules(), where=self._where(epoch))
            evolved = evolution.schema if evolution.changed else None
        elif schema is not None:
            check_schema(table, self._opts.identifier, schema, self._where(epoch))
        props = {SINK_PROPERTY: self.marker_id, EPOCH_PROPERTY: str(epoch),
                 FORMAT_PROPERTY: str(MARKER_FORMAT)}
        if decision is not None:
            props[DECISION_PROPERTY] = decision
        hit("sink.mid_commit", runtime=self.runtime, sink=self.name, epoch=epoch)
        with table.transaction() as tx:
            if evolved is not None:  # the schema update, in the data's own commit
                with tx.update_schema() as update:
                    update.union_by_name(evolved)
            added = epoch_data_files(tx, table.io, files, self._opts.identifier,
                                     self._opts.compression)
            replaced = added.replaced
            if added.data_files and tx.table_metadata.name_mapping() is None:
                tx.set_properties({NAME_MAPPING: tx.table_metadata.schema().name_mapping
                                   .model_dump_json()})
            with tx.update_snapshot(snapshot_properties=props).fast_append() as append:
                for data_file in added.data_files:
                    append.append_data_file(data_file)
            tx.set_properties({self.epoch_property: str(epoch)})
        return replaced

    def holds_decision(self, epoch: int, manifests: Sequence[Manifest]) -> bool | None:
        """Whether the snapshot on the ancestry carrying this sink's marker at ``epoch``
        names the decision ``manifests``; ``None`` when there is none (expired) or it
        names none."""
        from pyiceberg.table.snapshots import ancestors_of

        table = self._opts.load_table()
        if table is None:
            return None
        for snapshot in ancestors_of(table.current_snapshot(), table.metadata):
            summary = snapshot.summary
            if summary is None or summary.get(SINK_PROPERTY) != self.marker_id \
                    or summary.get(EPOCH_PROPERTY) != str(epoch):
                continue
            found = summary.get(DECISION_PROPERTY)
            return None if found is None else bool(found == decision_id(epoch, manifests))
        return None

    def _is_committed(self, table: Any, epoch: int) -> bool:
        high = table.properties.get(self.epoch_property)
        if high is not None and int(high) >= epoch:
            return True
        return any(e == epoch for e in self._ancestry_epochs(table, stop_below=epoch))

    def _ancestry_epochs(self, table: Any, stop_below: int | None = None) -> list[int]:
        """This sink's epochs on the current snapshot's ancestry, newest first; with
        ``stop_below`` the walk ends at the first of ours below it (epochs commit in order)."""
        from pyiceberg.table.snapshots import ancestors_of

        found: list[int] = []
        for snapshot in ancestors_of(table.current_snapshot(), table.metadata):
            summary = snapshot.summary
            if summary is None or summary.get(SINK_PROPERTY) != self.marker_id:
                continue
            value = summary.get(EPOCH_PROPERTY)
            if value is None:
                continue
            if not found:  # the newest marker: this raysink must be able to read it
                self._check_format(summary.get(FORMAT_PROPERTY), snapshot.snapshot_id)
            found.append(int(value))
            if stop_below is not None and int(value) < stop_below:
                break
        return found

    def _check_format(self, value: str | None, snapshot: int) -> None:
        marker = None if value is None else {"format": int(value) if value.isdigit() else value}
        check_marker(marker or {}, runtime=self.runtime or None, sink=self.name or None,
                     where=f"snapshot {snapshot} of Iceberg table {self._opts.identifier!r}")

    def _staging_roots(self, table: Any | None) -> list[str]:
        return self._opts.staging_roots(table)

    def _root_store(self, root: str) -> FileStore:
        return self._opts.store(root)

    def _staging_place(self) -> str:
        return f"of {self._opts.identifier!r}"

    def _abort_table(self) -> Any | None:
        return self._opts.load_table()

    def _referenced(self, table: Any | None) -> set[str]:
        return referenced(table)

    # ------------------------------------------------------------------ markers

    def committed_epoch(self) -> int | None:
        """The highest epoch of this sink's marker (table property or snapshot ancestry);
        ``None`` when the table is missing (see ``target_exists``) or holds no marker."""
        table = self._opts.load_table()
        if table is None:
            return None
        epochs = self._ancestry_epochs(table)
        high = table.properties.get(self.epoch_property)
        if high is not None:
            epochs.append(int(high))
        return max(epochs) if epochs else None

    def target_exists(self) -> bool:
        """Whether the table exists. With ``committed_epoch() is None`` this tells a lost
        table (``DataLossError`` when the meta store says rows were committed) from one
        that never received data (created by the next ``commit``)."""
        return self._opts.load_table() is not None

    def recreate_marker(self, epoch: int) -> None:
        """Record ``epoch`` as this sink's marker with an empty snapshot (no epoch is
        pending); a missing table is a ``DataLossError``. Idempotent."""
        table = self._opts.load_table()
        if table is None:
            raise DataLossError(f"the Iceberg table {self._opts.identifier!r} is gone after "
                                "raysink committed to it; restore it or start a new runtime",
                                **self._where(epoch))
        if not self._is_committed(table, epoch):
            self._append(self._without_retry(table), epoch, [], None)


    # ------------------------------------------------------------------ maintenance

    def maintain(self, window: MaintenanceWindow) -> MaintenanceReport:
        """Compaction, manifest merging, snapshot expiry and old metadata deleted
        (``raysink.sinks.iceberg._maintain``); nothing with ``maintenance=False``."""
        errors = pyiceberg_module().exceptions
        try:
            return self._maintainer().run(window)
        except (errors.CommitStateUnknownException, OSError) as exc:
            raise SinkUnavailableError(
                f"maintenance of the Iceberg table {self._opts.identifier!r} was cut: {exc}; "
                "the next pass finishes it", **self._where()) from exc

    def table_stats(self) -> TableStats | None:
        return self._maintainer().stats()

    def _maintainer(self) -> IcebergMaintenance:
        from raysink.sinks.iceberg._maintain import IcebergMaintenance

        return IcebergMaintenance(self._opts, self.maintenance, marker_id=self.marker_id,
                   runtime=self.runtime, sink=self.name)
