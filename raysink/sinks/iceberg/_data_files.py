"""The data files of an epoch's commit, each in its partition.

pyiceberg's ``add_files`` infers a file's partition from its column bounds, which cannot
tell a bucket (``ValueError``: not order preserving) nor a file whose partition column
is all null. The writers know each file's partition (``raysink.sinks.iceberg.
_partition``), so the commit builds the data files itself: statistics from the staged
file's Parquet footer (as ``add_files`` reads them), the partition values the writer
recorded, the table's current spec.

A file staged under another spec than the table's current one (the spec evolved, or
the table was created by someone else, between the writer's first batch and the commit)
is split again by the current spec here: a file that falls in one partition is added as
it is; one that spans several is rewritten next to it as one file per partition, under
names derived from its own (a retried commit writes the same files again), and the
original is deleted once the commit holds.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from raysink.sinks._files import STAGED_FILE
from raysink.sinks.iceberg._partition import WriteSpec, decode_values, write_spec

__all__ = ["EpochFiles", "epoch_data_files"]


@dataclass
class EpochFiles:
    """What a commit adds (pyiceberg ``DataFile``s) and the staged files it replaced by
    their split (deleted once the commit holds)."""

    data_files: list[Any] = field(default_factory=list)
    replaced: list[str] = field(default_factory=list)


def epoch_data_files(tx: Any, io: Any, files: Sequence[dict[str, Any]], identifier: str,
                     compression: str) -> EpochFiles:
    """The data files of ``files`` (manifest entries) in the transaction's current spec
    and schema."""
    from pyiceberg.io.pyarrow import compute_statistics_plan, parquet_path_to_id_mapping

    metadata = tx.table_metadata
    schema, spec = metadata.schema(), metadata.spec()
    current = write_spec(spec, schema, identifier)
    builder = _Builder(
        metadata=metadata, schema=schema, spec=spec, io=io,
        result_types=[f.field_type for f in spec.partition_type(schema).fields],
        plan=compute_statistics_plan(schema, metadata.properties),
        mapping=parquet_path_to_id_mapping(schema))
    out = EpochFiles()
    for entry in files:
        path = str(entry["path"])
        if (entry.get("spec") or []) == current.signature():
            with io.new_input(path).open() as stream:
                footer = pq.read_metadata(stream)
            out.data_files.append(builder.data_file(path, footer, int(entry["bytes"]),
                                                    entry.get("partition") or []))
            continue
        pieces = _resplit(io, path, current)
        if len(pieces) == 1:
            values, _ = pieces[0]
            with io.new_input(path).open() as stream:
                footer = pq.read_metadata(stream)
            out.data_files.append(builder.data_file(path, footer, int(entry["bytes"]),
                                                    list(values)))
            continue
        for n, (values, rows) in enumerate(pieces):
            target = _split_name(path, current, n)
            data = _encode(rows, compression)
            with io.new_output(target).create(overwrite=True) as stream:
                stream.write(data.to_pybytes())
            out.data_files.append(builder.data_file(
                target, pq.read_metadata(pa.BufferReader(data)), data.size, list(values)))
        out.replaced.append(path)
    return out


@dataclass
class _Builder:
    metadata: Any
    schema: Any
    spec: Any
    io: Any
    result_types: list[Any]
    plan: Any
    mapping: Any

    def data_file(self, path: str, footer: pq.FileMetaData, size: int,
                  values: Sequence[Any]) -> Any:
        from pyiceberg.io.pyarrow import (
            _check_pyarrow_schema_compatible,
            data_file_statistics_from_parquet_metadata,
        )
        from pyiceberg.manifest import DataFile, DataFileContent, FileFormat
        from pyiceberg.typedef import Record

        _check_pyarrow_schema_compatible(self.schema, footer.schema.to_arrow_schema(),
                                         format_version=self.metadata.format_version)
        stats = data_file_statistics_from_parquet_metadata(
            parquet_metadata=footer, stats_columns=self.plan,
            parquet_column_mapping=self.mapping)
        return DataFile.from_args(
            content=DataFileContent.DATA, file_path=path, file_format=FileFormat.PARQUET,
            partition=Record(*decode_values(values, self.result_types)),
            file_size_in_bytes=size, sort_order_id=None, spec_id=self.spec.spec_id,
            equality_ids=None, key_metadata=None, **stats.to_serialized_dict())


def _resplit(io: Any, path: str, spec: WriteSpec) -> list[tuple[tuple[Any, ...], pa.Table]]:
    """The rows of the staged file at ``path`` split by ``spec``."""
    with io.new_input(path).open() as stream:
        rows = pq.read_table(stream)
    if rows.num_rows == 0:
        return [((None,) * len(spec.fields), rows)]
    pieces: dict[tuple[Any, ...], list[pa.RecordBatch]] = {}
    for batch in rows.to_batches():
        for values, piece in spec.split(batch, {}):
            pieces.setdefault(values, []).append(piece)
    return [(values, pa.Table.from_batches(batches, schema=rows.schema))
            for values, batches in pieces.items()]


def _split_name(path: str, spec: WriteSpec, n: int) -> str:
    """The ``n``-th file of the split of staged file ``path`` by ``spec``: a staged
    file's name (its epoch, attempt and writer kept), unique to the pair."""
    head, _, base = path.rpartition("/")
    match = STAGED_FILE.fullmatch(base)
    assert match is not None  # the commit checked every manifest path
    digest = hashlib.sha256(f"{base}|{spec.signature()}".encode()).hexdigest()[:32]
    prefix = base[:base.index("-", base.index("-w") + 1)]
    return f"{head}/{prefix}-{digest}-{n:04d}.parquet"


def _encode(rows: pa.Table, compression: str) -> pa.Buffer:
    sink = pa.BufferOutputStream()
    pq.write_table(rows, sink, compression=compression)
    return sink.getvalue()
