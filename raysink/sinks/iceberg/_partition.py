"""Partitioned Iceberg tables: the spec a sink creates its table with (``partition_by``),
the spec writers write with (the table's current one, or the requested one before the
table exists), a batch split by partition, and partition values as a manifest carries
them (JSON) and as a data file holds them (pyiceberg's ``Record``).

A staged file's entry names the spec it was split by as its ``spec`` signature
(``[[source column, transform], ...]``) and its values as ``partition`` (one per field:
ints, strings, booleans, floats or null; a decimal as its string, bytes as base64). The
commit puts the file in the table's current spec when the signatures agree.
"""

from __future__ import annotations

import base64
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import numpy as np
import pyarrow as pa

from raysink.errors import ConfigError, SchemaMismatchError
from raysink.sinks.iceberg._transforms import TRANSFORM, apply_transform

__all__ = ["PartitionBy", "SpecField", "WriteSpec", "decode_values", "parse_partition_by",
           "table_spec", "write_spec"]

PartitionBy = Sequence[str | tuple[str, str] | tuple[str, str, str]]
"""``partition_by``: a column name (identity), ``(column, transform)`` or
``(column, transform, partition field name)``."""

Signature = list[list[str]]


@dataclass(frozen=True, slots=True)
class SpecField:
    """One partition field: its top-level source column, its transform (Iceberg's
    spelling: ``identity``, ``year``, ``month``, ``day``, ``hour``, ``bucket[N]``,
    ``truncate[W]``, ``void``) and its name (``None``: pyiceberg's default)."""

    source: str
    transform: str
    name: str | None = None


@dataclass(frozen=True, slots=True)
class WriteSpec:
    """The partition spec a writer splits an epoch's rows by (no fields: unpartitioned)."""

    fields: tuple[SpecField, ...] = ()

    @property
    def partitioned(self) -> bool:
        return bool(self.fields)

    def signature(self) -> Signature:
        return [[f.source, f.transform] for f in self.fields]

    def split(self, batch: pa.RecordBatch,
              where: dict[str, Any]) -> Iterator[tuple[tuple[Any, ...], pa.RecordBatch]]:
        """``batch`` split by partition: each piece with its partition values (JSON)."""
        if not self.fields:
            yield (), batch
            return
        missing = sorted({f.source for f in self.fields if f.transform != "void"}
                         - set(batch.schema.names))
        if missing:
            raise SchemaMismatchError(f"the Iceberg table is partitioned by columns {missing!r} "
                                      "that the batch lacks", **where)
        keys = {f"k{i}": (pa.nulls(len(batch), pa.int32()) if f.transform == "void"
                          else apply_transform(f.transform, batch.column(f.source)))
                for i, f in enumerate(self.fields)}
        grouped = pa.table({**keys, "row": pa.array(np.arange(len(batch), dtype=np.int64))}) \
            .group_by(list(keys), use_threads=False).aggregate([("row", "list")])
        if grouped.num_rows == 1:
            yield tuple(_json(grouped.column(k)[0].as_py()) for k in keys), batch
            return
        rows = grouped.column("row_list").combine_chunks()
        ordered = batch.take(rows.flatten())  # one gather; each partition a slice of it
        offsets = rows.offsets.to_pylist()
        for i in range(grouped.num_rows):
            values = tuple(_json(grouped.column(k)[i].as_py()) for k in keys)
            yield values, ordered.slice(offsets[i] - offsets[0], offsets[i + 1] - offsets[i])


def _json(value: Any) -> Any:
    if isinstance(value, bytes):
        return base64.b64encode(value).decode("ascii")
    return value


def parse_partition_by(entries: PartitionBy | None) -> tuple[SpecField, ...]:
    """``partition_by`` checked: each entry a column (identity), ``(column, transform)``
    or ``(column, transform, name)``, with a transform of Iceberg's."""
    fields: list[SpecField] = []
    for entry in entries or ():
        if isinstance(entry, str):
            entry = (entry, "identity")
        if (not isinstance(entry, tuple | list) or len(entry) not in (2, 3)
                or not all(isinstance(part, str) and part for part in entry)):
            raise ConfigError(f"IcebergSink partition_by entries are a column name, "
                              f"(column, transform) or (column, transform, name); got {entry!r}")
        source, transform = entry[0], entry[1].strip().lower().replace(" ", "")
        if TRANSFORM.fullmatch(transform) is None or transform == "void":
            raise ConfigError(f"unknown Iceberg partition transform {entry[1]!r} for column "
                              f"{source!r}: use identity, year, month, day, hour, bucket[N] "
                              "or truncate[W]")
        fields.append(SpecField(source, transform, entry[2] if len(entry) == 3 else None))
    names = [f.name or f"{f.source}/{f.transform}" for f in fields]
    if len(set(names)) != len(names):
        raise ConfigError(f"IcebergSink partition_by names a partition field twice: {entries!r}")
    return tuple(fields)


def table_spec(table: Any, identifier: str) -> WriteSpec:
    """The table's current partition spec as writers split by it. A source column nested
    in a struct, or a transform raysink cannot compute, is a ``ConfigError``."""
    return write_spec(table.spec(), table.schema(), identifier)


def write_spec(spec: Any, schema: Any, identifier: str) -> WriteSpec:
    """pyiceberg's ``spec`` (of ``schema``) as writers split by it (see ``table_spec``)."""
    fields = []
    for field in spec.fields:
        transform = str(field.transform)
        name = schema.find_column_name(field.source_id)
        if name is None:
            transform, name = "void", ""
        elif "." in name and name not in schema.as_arrow().names:
            raise ConfigError(f"the Iceberg table {identifier!r} is partitioned by the nested "
                              f"column {name!r}; IcebergSink partitions by top-level columns "
                              "only")
        if TRANSFORM.fullmatch(transform) is None:
            raise ConfigError(f"the Iceberg table {identifier!r} is partitioned by "
                              f"{transform}({name}), a transform IcebergSink cannot compute")
        fields.append(SpecField(name, transform, field.name))
    return WriteSpec(tuple(fields))


def decode_values(values: Sequence[Any], result_types: Sequence[Any]) -> list[Any]:
    """A manifest's partition values as a data file holds them, by each field's result
    type (pyiceberg types): decimals from their strings, bytes from base64, UUIDs as 16
    bytes."""
    from pyiceberg.types import BinaryType, DecimalType, FixedType, UUIDType

    out: list[Any] = []
    for value, kind in zip(values, result_types, strict=True):
        if value is None:
            out.append(None)
        elif isinstance(kind, DecimalType):
            out.append(Decimal(value).quantize(Decimal(1).scaleb(-kind.scale)))
        elif isinstance(kind, BinaryType | FixedType):
            out.append(base64.b64decode(value))
        elif isinstance(kind, UUIDType):
            out.append(uuid.UUID(bytes=base64.b64decode(value)).bytes)
        else:
            out.append(value)
    return out
