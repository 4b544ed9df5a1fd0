"""The Iceberg table as the sink and its writers see it: ``pyiceberg`` imported
lazily, the catalog (the default one, its secrets redacted), the options
(``IcebergOptions``: the catalog, the table, where writers stage), the data files the
table references, Iceberg's types and evolution rules."""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pyarrow as pa

from raysink import _schema
from raysink.errors import ConfigError, SchemaMismatchError
from raysink.protocol.requirements import check_extra
from raysink.sinks._files import FileStore
from raysink.sinks.iceberg._partition import SpecField

__all__ = ["NO_RETRY", "IcebergOptions", "check_schema", "default_catalog", "pyiceberg_module",
           "redact", "referenced", "rules", "sqlite_file"]

NO_RETRY = {"commit.retry.num-retries": "0"}
"""Table properties switching pyiceberg's own commit retry off (see ``IcebergSink``)."""
_SECRET = re.compile(r"secret|password|token|credential|key", re.IGNORECASE)
_URI_PASSWORD = re.compile(r"(://[^:/@]+:)[^@]+@")


def pyiceberg_module() -> ModuleType:
    try:
        import pyiceberg.catalog
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ConfigError("IcebergSink needs pyiceberg: pip install 'raysink[iceberg]'") from exc
    check_extra("iceberg")
    return pyiceberg


def default_catalog(cwd: str | None = None) -> dict[str, str]:
    """The default catalog properties: SQLite under ``<cwd>/.raysink/iceberg``."""
    base = Path(cwd or os.getcwd()).resolve() / ".raysink" / "iceberg"
    return {"type": "sql", "uri": f"sqlite:///{base / 'catalog.db'}",
            "warehouse": f"file://{base / 'warehouse'}"}


def redact(props: Mapping[str, str]) -> dict[str, str]:
    return {k: ("***" if _SECRET.search(k) else _URI_PASSWORD.sub(r"\1***@", str(v)))
            for k, v in props.items()}


def sqlite_file(props: Mapping[str, str]) -> Path | None:
    uri = props.get("uri", "")
    if props.get("type", "sql") == "sql" and uri.startswith("sqlite:///"):
        return Path(uri.removeprefix("sqlite:///").split("?", 1)[0] or ":memory:")
    return None


def _missing_catalog_tables(exc: Exception) -> bool:
    """An SQL catalog opened without creating its tables, before the first commit."""
    return "no such table" in str(exc) or "does not exist" in str(exc)


@dataclass(frozen=True, kw_only=True, slots=True)
class IcebergOptions:
    namespace: tuple[str, ...]
    table: str
    catalog_name: str
    catalog: dict[str, str]
    table_properties: dict[str, str]
    max_file_rows: int
    compression: str
    commit_attempts: int
    schema_evolution: _schema.SchemaEvolution = "fail"
    partition_by: tuple[SpecField, ...] = ()

    @property
    def evolving(self) -> bool:
        return self.schema_evolution == "add_columns"

    @property
    def identifier(self) -> str:
        return ".".join((*self.namespace, self.table))

    def open_catalog(self, *, create: bool) -> Any | None:
        """The catalog; ``None`` when ``create`` is false and its SQLite file is absent
        (opening it would create it)."""
        sqlite = sqlite_file(self.catalog)
        if sqlite is not None and not create and not sqlite.is_file():
            return None
        if sqlite is not None and create:
            sqlite.parent.mkdir(parents=True, exist_ok=True)
        props = {**self.catalog, "init_catalog_tables": "true" if create else "false"}
        return pyiceberg_module().catalog.load_catalog(self.catalog_name, **props)

    def load_table(self, *, create_catalog: bool = False) -> Any | None:
        """The table, or ``None`` when it (or its catalog) does not exist yet."""
        catalog = self.open_catalog(create=create_catalog)
        if catalog is None:
            return None
        errors = pyiceberg_module().exceptions
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



def referenced(table: Any | None) -> set[str]:
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


def rules(identifier: str) -> _schema.Rules:
    return _schema.Rules(target=f"the Iceberg table {identifier!r}", key=_iceberg_key,
                         widen=_iceberg_widens,
                         refuses_widening="Iceberg widens only int to long, float to "
                                          "double and a decimal's precision")



def check_schema(table: Any, identifier: str, schema: pa.Schema,
                  where: dict[str, Any]) -> None:
    """``fail``: the batch has the table's columns, each of the type the table holds
    (Iceberg's types, then pyiceberg's own check of what it can write)."""
    from pyiceberg.io.pyarrow import _check_pyarrow_schema_compatible

    refused = _schema.refusal(table.schema().as_arrow(), schema, rules(identifier),
                              where=where)
    if refused is not None:
        raise refused
    try:
        _check_pyarrow_schema_compatible(table.schema(), schema,
                                         format_version=table.metadata.format_version)
    except ValueError as exc:
        raise SchemaMismatchError(f"the batch schema does not fit the Iceberg table "
                                  f"{identifier!r}: {exc}", **where) from exc

