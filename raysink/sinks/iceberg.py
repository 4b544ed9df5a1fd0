"""An Apache Iceberg table written through ``pyiceberg`` (append only).

Writers encode rows into Parquet in memory and upload the files at ``pre_commit`` to
``<table location>/data/raysink/<epoch:012d>/`` (named by epoch, attempt, writer and a
uuid). Before the first commit there is no table: writers then use the location the table
will get, ``<warehouse>/<namespace>.db/<table>``, and the first ``commit`` creates the
namespace, the catalog database and the table there. ``validate()`` creates nothing.

Manifest of one writer for one attempt::

    {"writer": 3, "epoch": 12, "attempt": 1,
     "files": [{"path": "file:///.../data/raysink/000000000012/e...-0000.parquet",
                "rows": 1000, "bytes": 5120}],
     "rows": 1000, "bytes": 5120, "schema": "<base64 Arrow IPC schema>" | null}

Commit: one fast-append snapshot of every staged file, whose summary carries
``raysink.sink = marker_id``, ``raysink.epoch = epoch`` and ``raysink.decision`` (which
decision it is: ``holds_decision``); the same table commit sets the
table property ``raysink.epoch.<marker_id>`` (a high-water mark that survives snapshot
expiry). ``commit`` is idempotent: it first looks for the marker (property, then the
snapshot ancestry); pyiceberg's own commit retry is switched off on the table
(``commit.retry.num-retries=0``: pyiceberg 0.12 re-applies a failed append on refreshed
metadata without any check and duplicates data), and after a ``CommitFailedException``
the marker is looked up again before a bounded retry. An empty epoch still makes a
snapshot (no files) so its marker is recorded.

Schema evolution (``schema_evolution="add_columns"``): writers check each batch against
the table's schema (``raysink._schema.evolve`` with Iceberg's rules: new columns are
added; int to long, float to double and a decimal's precision are widened; a narrower
type is cast up); the commit applies the schema update (``update_schema``) and the
fast-append in ONE table transaction, so a reader sees the old schema without the
epoch's rows or the new schema with all of them.

Default catalog: a ``SqlCatalog`` named ``raysink`` on SQLite at
``<cwd>/.raysink/iceberg/catalog.db`` with warehouse ``file://<cwd>/.raysink/iceberg/
warehouse``, ``cwd`` resolved when the sink is built on the driver.
"""

from __future__ import annotations

import functools
import logging
import os
import re
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import pyarrow as pa

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

__all__ = ["IcebergSink", "IcebergSinkWriter"]

logger = logging.getLogger(__name__)

SINK_PROPERTY = "raysink.sink"
EPOCH_PROPERTY = "raysink.epoch"
DECISION_PROPERTY = "raysink.decision"
NO_RETRY = {"commit.retry.num-retries": "0"}
_SECRET = re.compile(r"secret|password|token|credential|key", re.IGNORECASE)
_URI_PASSWORD = re.compile(r"(://[^:/@]+:)[^@]+@")
_REMEMBERED_ATTEMPTS = 8


def _pyiceberg() -> ModuleType:
    try:
        import pyiceberg.catalog
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ConfigError("IcebergSink needs pyiceberg: pip install 'raysink[iceberg]'") from exc
    return pyiceberg


def default_catalog(cwd: str | None = None) -> dict[str, str]:
    """The default catalog properties: SQLite under ``<cwd>/.raysink/iceberg``."""
    base = Path(cwd or os.getcwd()).resolve() / ".raysink" / "iceberg"
    return {"type": "sql", "uri": f"sqlite:///{base / 'catalog.db'}",
            "warehouse": f"file://{base / 'warehouse'}"}


def _redact(props: Mapping[str, str]) -> dict[str, str]:
    return {k: ("***" if _SECRET.search(k) else _URI_PASSWORD.sub(r"\1***@", str(v)))
            for k, v in props.items()}


def _sqlite_file(props: Mapping[str, str]) -> Path | None:
    uri = props.get("uri", "")
    if props.get("type", "sql") == "sql" and uri.startswith("sqlite:///"):
        return Path(uri.removeprefix("sqlite:///").split("?", 1)[0] or ":memory:")
    return None


def _missing_catalog_tables(exc: Exception) -> bool:
    """An SQL catalog opened without creating its tables, before the first commit."""
    return "no such table" in str(exc) or "does not exist" in str(exc)


@dataclass(frozen=True, kw_only=True, slots=True)
class _IcebergOptions:
    namespace: tuple[str, ...]
    table: str
    catalog_name: str
    catalog: dict[str, str]
    table_properties: dict[str, str]
    max_file_rows: int
    compression: str
    commit_attempts: int
    schema_evolution: _schema.SchemaEvolution = "fail"

    @property
    def evolving(self) -> bool:
        return self.schema_evolution == "add_columns"

    @property
    def identifier(self) -> str:
        return ".".join((*self.namespace, self.table))

    def open_catalog(self, *, create: bool) -> Any | None:
        """The catalog; ``None`` when ``create`` is false and its SQLite file is absent
        (opening it would create it)."""
        sqlite = _sqlite_file(self.catalog)
        if sqlite is not None and not create and not sqlite.is_file():
            return None
        if sqlite is not None and create:
            sqlite.parent.mkdir(parents=True, exist_ok=True)
        props = {**self.catalog, "init_catalog_tables": "true" if create else "false"}
        return _pyiceberg().catalog.load_catalog(self.catalog_name, **props)

    def load_table(self, *, create_catalog: bool = False) -> Any | None:
        """The table, or ``None`` when it (or its catalog) does not exist yet."""
        catalog = self.open_catalog(create=create_catalog)
        if catalog is None:
            return None
        errors = _pyiceberg().exceptions
        try:
            return catalog.load_table(self.identifier)
        except (errors.NoSuchTableError, errors.NoSuchNamespaceError):
            return None
        except Exception as exc:
            if _missing_catalog_tables(exc):
                return None
            raise

    def default_location(self) -> str:
        warehouse = self.catalog.get("warehouse")
        if not warehouse or "://" not in warehouse:
            raise ConfigError(
                f"the Iceberg table {self.identifier!r} does not exist and the catalog has no "
                f"warehouse URI to create it in (got {warehouse!r}); set catalog['warehouse'] "
                "or create the table first")
        return f"{warehouse.rstrip('/')}/{'.'.join(self.namespace)}.db/{self.table}"

    def staging_roots(self, table: Any | None) -> list[str]:
        """Where writers stage files: under the table's location, or the default one."""
        roots = [f"{table.location().rstrip('/')}/data/raysink"] if table is not None else []
        if table is None or self.catalog.get("warehouse"):
            try:
                default = f"{self.default_location()}/data/raysink"
            except ConfigError:
                if table is None:
                    raise
            else:
                if default not in roots:
                    roots.append(default)
        return roots

    def store(self, root: str) -> FileStore:
        """A ``FileStore`` for a staging root URI, with the catalog's IO properties."""
        from pyiceberg.io.pyarrow import PyArrowFileIO

        scheme, netloc, path = PyArrowFileIO.parse_location(root)
        fs = PyArrowFileIO(dict(self.catalog)).fs_by_scheme(scheme, netloc or None)
        return FileStore(fs, path if scheme == "file" else f"{netloc}{path}")


class IcebergSink(Sink):
    """Exactly-once appends to an Iceberg table.

    ``identifier`` is ``"namespace.table"`` (nested namespaces with more dots).
    ``catalog`` holds pyiceberg catalog properties (default: SQLite under
    ``<cwd>/.raysink/iceberg``); ``catalog_name`` names it. ``table_properties`` apply
    when raysink creates the table. ``commit`` and ``abort`` are idempotent; ``validate``
    creates nothing. Partitioned tables are not supported yet (``ConfigError``).
    ``schema_evolution="add_columns"`` adds new columns and widens int to long, float to
    double and decimal precision, in the epoch's own commit; anything else is a
    ``SchemaMismatchError`` naming the column.
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
        self._opts = _IcebergOptions(
            namespace=tuple(parts[:-1]), table=parts[-1], catalog_name=catalog_name,
            catalog=dict(catalog) if catalog is not None else default_catalog(),
            table_properties=dict(table_properties or {}), max_file_rows=max_file_rows,
            compression=compression, commit_attempts=commit_attempts,
            schema_evolution=self.schema_evolution)

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
                "catalog": _redact(self._opts.catalog),
                "schema_evolution": self.schema_evolution}

    def evolution_rules(self) -> _schema.Rules:
        return _rules(self._opts.identifier)

    def _where(self, epoch: int | None = None) -> dict[str, Any]:
        return {"runtime": self.runtime or None, "sink": self.name or None, "epoch": epoch}

    # ------------------------------------------------------------------ validate

    def validate(self) -> None:
        """Check the catalog and table without creating anything (no catalog database,
        tables, namespace or directories)."""
        sqlite = _sqlite_file(self._opts.catalog)
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
        if not table.spec().is_unpartitioned():
            raise ConfigError(f"the Iceberg table {self._opts.identifier!r} is partitioned "
                              f"({table.spec()}); IcebergSink writes unpartitioned tables only",
                              **self._where())

    # ------------------------------------------------------------------ writer

    def create_writer(self, writer_id: int) -> IcebergSinkWriter:
        return IcebergSinkWriter(self._opts, writer_id, self._where())

    # ------------------------------------------------------------------ commit

    def commit(self, epoch: int, manifests: Sequence[Manifest]) -> CommitResult:
        """One fast-append snapshot of every staged file, marked with this sink and epoch.
        Idempotent (``ALREADY``); a lost compare-and-swap re-checks the marker before
        retrying. ``NO_TARGET``: no table and no schema to create one with, nothing
        written."""
        schema = _epoch_schema(manifests, self._where(epoch), self._opts.evolving)
        errors = _pyiceberg().exceptions
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
            uris = self._checked_files(epoch, manifests, table)
            try:
                self._append(self._without_retry(table), epoch, uris, schema,
                             decision_id(epoch, manifests))
            except (errors.CommitFailedException, errors.CommitStateUnknownException) as exc:
                last = exc
                continue
            logger.info("Iceberg sink %s committed epoch %d (%d files)", self.marker_id, epoch,
                        len(uris))
            return CommitResult.COMMITTED
        raise SinkUnavailableError(
            f"commits to {self._opts.identifier!r} kept losing to concurrent ones after "
            f"{self._opts.commit_attempts} attempts; it will be retried", **self._where(epoch)
        ) from last

    def _create_table(self, schema: pa.Schema) -> Any:
        """Create the catalog database, namespace and table (first commit only)."""
        catalog = self._opts.open_catalog(create=True)
        assert catalog is not None
        errors = _pyiceberg().exceptions
        catalog.create_namespace_if_not_exists(self._opts.namespace)
        try:
            table = catalog.create_table(
                self._opts.identifier, schema=schema, location=self._opts.default_location(),
                properties={**self._opts.table_properties, **NO_RETRY})
        except errors.TableAlreadyExistsError:
            return catalog.load_table(self._opts.identifier)
        logger.info("Iceberg sink %s created table %s", self.marker_id, self._opts.identifier)
        return table

    def _without_retry(self, table: Any) -> Any:
        """Turn pyiceberg's own commit retry off on the table (a property-only commit)."""
        if all(table.properties.get(k) == v for k, v in NO_RETRY.items()):
            return table
        with table.transaction() as tx:
            tx.set_properties(NO_RETRY)
        return self._opts.load_table()

    def _append(self, table: Any, epoch: int, uris: list[str], schema: pa.Schema | None,
                decision: str | None = None) -> None:
        evolved = None
        if schema is not None and self._opts.evolving:
            evolution = _schema.evolve(table.schema().as_arrow(), schema,
                                       self.evolution_rules(), where=self._where(epoch))
            evolved = evolution.schema if evolution.changed else None
        elif schema is not None:
            _check_schema(table, self._opts.identifier, schema, self._where(epoch))
        props = {SINK_PROPERTY: self.marker_id, EPOCH_PROPERTY: str(epoch)}
        if decision is not None:
            props[DECISION_PROPERTY] = decision
        hit("sink.mid_commit", runtime=self.runtime, sink=self.name, epoch=epoch)
        with table.transaction() as tx:
            if evolved is not None:  # the schema update, in the data's own commit
                with tx.update_schema() as update:
                    update.union_by_name(evolved)
            if uris:
                tx.add_files(uris, snapshot_properties=props, check_duplicate_files=False)
            else:
                with tx.update_snapshot(snapshot_properties=props).fast_append():
                    pass
            tx.set_properties({self.epoch_property: str(epoch)})

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
            found.append(int(value))
            if stop_below is not None and int(value) < stop_below:
                break
        return found

    def _checked_files(self, epoch: int, manifests: Sequence[Manifest] | None,
                       table: Any | None) -> list[str]:
        uris = [str(f["path"]) for m in manifests or () for f in m.get("files") or []]
        dirs = [f"{epoch_dir(root, epoch)}/" for root in self._opts.staging_roots(table)]
        for uri in uris:
            head, _, base = uri.rpartition("/")
            match = STAGED_FILE.fullmatch(base)
            if (match is None or int(match.group(1)) != epoch
                    or f"{head}/" not in dirs):
                raise MetaStoreError(f"manifest path {uri!r} is not a file staged for epoch "
                                     f"{epoch} of {self._opts.identifier!r}; refused",
                                     **self._where(epoch))
        return uris

    # ------------------------------------------------------------------ abort, markers

    def abort(self, epoch: int, manifests: Sequence[Manifest] | None) -> None:
        """Delete the epoch's staged files that no snapshot of the table references (the
        listed ones, or with ``None`` every file under ``data/raysink/<epoch>/``).
        Idempotent; creates nothing."""
        table = self._opts.load_table()
        if manifests is None:
            uris = self._staged_uris(epoch, table)
        else:
            uris = self._checked_files(epoch, manifests, table)
        if not uris:
            return
        keep = _referenced(table)
        for root in self._opts.staging_roots(table):
            store = self._opts.store(root)
            for uri in uris:
                if uri.startswith(f"{root}/") and uri not in keep:
                    store.delete(uri[len(root) + 1:])
            store.remove_empty_dir(epoch_dir("", epoch).lstrip("/"))

    def _staged_uris(self, epoch: int, table: Any | None) -> list[str]:
        uris: list[str] = []
        for root in self._opts.staging_roots(table):
            for rel in self._opts.store(root).list_files(epoch_dir("", epoch).lstrip("/")):
                if STAGED_FILE.fullmatch(rel.rpartition("/")[2]):
                    uris.append(f"{root}/{rel}")
        return uris

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


def _referenced(table: Any | None) -> set[str]:
    """The data files the table's current snapshot references. A snapshot with no
    manifest at all (a table created by an empty epoch) references none: pyiceberg's
    ``inspect.files()`` cannot list it (it concatenates zero tables)."""
    if table is None:
        return set()
    snapshot = table.current_snapshot()
    if snapshot is None or not snapshot.manifests(table.io):
        return set()
    return set(table.inspect.files().column("file_path").to_pylist())


@functools.lru_cache(maxsize=512)
def _iceberg_type(dtype: pa.DataType) -> Hashable:
    """The Iceberg type storing Arrow ``dtype`` (its name), or the Arrow type itself when
    pyiceberg has none for it."""
    from pyiceberg.io.pyarrow import _pyarrow_to_schema_without_ids

    try:
        schema = _pyarrow_to_schema_without_ids(pa.schema([pa.field("c", dtype)]))
    except (TypeError, ValueError):
        plain: Hashable = _schema.canonical(dtype)
        return plain
    return str(schema.fields[0].field_type)


def _iceberg_key(field: pa.Field) -> Hashable:
    key: Hashable = _iceberg_type(field.type)
    return key


def _iceberg_widens(old: pa.DataType, new: pa.DataType) -> bool:
    """Iceberg's type promotions: int to long, float to double, a decimal's precision."""
    pair = (_iceberg_type(old), _iceberg_type(new))
    if pair in (("int", "long"), ("float", "double")):
        return True
    return bool(pa.types.is_decimal(old) and pa.types.is_decimal(new)
                and old.scale == new.scale and new.precision > old.precision)


def _rules(identifier: str) -> _schema.Rules:
    return _schema.Rules(target=f"the Iceberg table {identifier!r}", key=_iceberg_key,
                         widen=_iceberg_widens,
                         refuses_widening="Iceberg widens only int to long, float to "
                                          "double and a decimal's precision")


def _file_schemas(manifests: Sequence[Manifest]) -> list[pa.Schema]:
    """The schemas of files written in another schema than their writer's manifest."""
    return [_schema.decode(text) for m in manifests for f in m.get("files") or []
            if isinstance(text := f.get("schema"), str)]


def _epoch_schema(manifests: Sequence[Manifest], where: dict[str, Any],
                  evolving: bool = False) -> pa.Schema | None:
    schemas = [_schema.decode(text) for m in manifests if (text := m.get("schema"))]
    if evolving and schemas:
        try:
            return _schema.union(schemas + _file_schemas(manifests))
        except SchemaMismatchError as exc:
            raise SchemaMismatchError(exc.message, column=exc.column, **where) from None
    for other in schemas[1:]:
        if not _schema.same(schemas[0], other):
            raise SchemaMismatchError(f"writers staged different schemas: {schemas[0]} and "
                                      f"{other}", **where)
    return schemas[0] if schemas else None


def _check_schema(table: Any, identifier: str, schema: pa.Schema,
                  where: dict[str, Any]) -> None:
    """``fail``: the batch has the table's columns, each of the type the table holds
    (Iceberg's types, then pyiceberg's own check of what it can write)."""
    from pyiceberg.io.pyarrow import _check_pyarrow_schema_compatible

    refused = _schema.refusal(table.schema().as_arrow(), schema, _rules(identifier),
                              where=where)
    if refused is not None:
        raise refused
    try:
        _check_pyarrow_schema_compatible(table.schema(), schema,
                                         format_version=table.metadata.format_version)
    except ValueError as exc:
        raise SchemaMismatchError(f"the batch schema does not fit the Iceberg table "
                                  f"{identifier!r}: {exc}", **where) from exc


# --------------------------------------------------------------------------- writer


@dataclass
class _EpochState:
    """One epoch of one writer: its schema (with ``add_columns`` the union of its
    batches'), the table's schema when it began, where it stages, a buffer per schema."""

    schema: pa.Schema | None = None
    target: pa.Schema | None = None
    root: str | None = None
    buffers: dict[str, ParquetBuffer] = field(default_factory=dict)


class IcebergSinkWriter(SinkWriter):
    """Encodes an epoch's rows into in-memory Parquet files and uploads them at
    ``pre_commit``; the schema is checked against the table on the epoch's first batch."""

    def __init__(self, opts: _IcebergOptions, writer_id: int, where: dict[str, Any]) -> None:
        self._opts = opts
        self._writer_id = writer_id
        self._where = where
        self._epoch = _EpochState()
        self._staged: dict[tuple[int, int], list[str]] = {}

    def write(self, batch: pa.RecordBatch) -> None:
        if self._epoch.root is None:
            self._start_epoch(batch.schema)
        if self._opts.evolving:
            batch = self._evolve(batch)
        elif not _schema.same(self._epoch.schema, batch.schema):
            raise SchemaMismatchError(f"batch schema {batch.schema} differs from the epoch's "
                                      f"{self._epoch.schema}", **self._where)
        if batch.num_rows == 0:
            return
        slot = _schema.encode(batch.schema)
        buffer = self._epoch.buffers.get(slot)
        if buffer is None:
            buffer = ParquetBuffer(batch.schema, self._opts.max_file_rows,
                                   self._opts.compression)
            self._epoch.buffers[slot] = buffer
        buffer.write(batch)

    def _start_epoch(self, schema: pa.Schema) -> None:
        table = self._opts.load_table()
        if table is not None and self._opts.evolving:
            self._epoch.target = table.schema().as_arrow()
        elif table is not None:
            _check_schema(table, self._opts.identifier, schema, self._where)
        self._epoch.root = self._opts.staging_roots(table)[0]
        if not self._opts.evolving:
            self._epoch.schema = schema.remove_metadata()

    def _evolve(self, batch: pa.RecordBatch) -> pa.RecordBatch:
        """``add_columns``: the batch must evolve the table's schema; it is cast up to the
        table's wider types; the epoch's schema becomes the union of its batches'."""
        epoch = self._epoch
        batch, epoch.schema = _schema.admit(batch, epoch.target, epoch.schema,
                                            _rules(self._opts.identifier), where=self._where)
        return batch

    def pre_commit(self, epoch: int, attempt: int) -> Manifest:
        """Upload the epoch's files under ``<root>/<epoch>/`` and describe them."""
        files: list[dict[str, Any]] = []
        schema = self._epoch.schema
        if self._epoch.root is not None:
            root, unique = self._epoch.root, new_unique()
            store = self._opts.store(root)
            for buffer in self._epoch.buffers.values():
                own = {} if schema is None or _schema.same(schema, buffer.schema) \
                    else {"schema": _schema.encode(buffer.schema)}
                for encoded in buffer.finish():
                    rel = staged_file_path("", epoch, attempt, self._writer_id, unique,
                                           len(files)).lstrip("/")
                    store.write(rel, encoded.data)
                    self._remember(epoch, attempt, f"{root}/{rel}")
                    files.append({"path": f"{root}/{rel}", "rows": encoded.rows,
                                  "bytes": encoded.data.size, **own})
        self._epoch = _EpochState()
        return {"writer": self._writer_id, "epoch": epoch, "attempt": attempt, "files": files,
                "rows": sum(f["rows"] for f in files), "bytes": sum(f["bytes"] for f in files),
                "schema": _schema.encode(schema) if schema is not None else None}

    def _remember(self, epoch: int, attempt: int, uri: str) -> None:
        self._staged.setdefault((epoch, attempt), []).append(uri)
        while len(self._staged) > _REMEMBERED_ATTEMPTS:
            del self._staged[min(self._staged)]

    def rollback(self, epoch: int, attempt: int) -> None:
        """Drop buffered rows and delete the files this writer staged for the attempt."""
        self._epoch = _EpochState()
        for uri in self._staged.pop((epoch, attempt), []):
            root, _, rel = uri.partition("/data/raysink/")
            self._opts.store(f"{root}/data/raysink").delete(rel)

    def close(self) -> None:
        self._epoch = _EpochState()
