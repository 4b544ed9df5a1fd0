"""Compaction and manifest merging of an Iceberg table, which pyiceberg cannot do itself
(it has no ``rewrite_data_files`` nor ``rewrite_manifests``).

Compaction plans per partition: the current snapshot's live data files are grouped by
``(spec id, partition tuple)``, so an unpartitioned table is one group and a partitioned
one a group per partition; a group's files below half the target are chosen by size tier
(``raysink.sinks._tiers``: a tier once it holds ``min_compact_files`` files, with every
smaller file; every small file when forced), packed into bins of at most
``target_file_bytes`` (their sizes summed), and each bin is read through
pyiceberg's own scan (projected onto the table's current schema, so files written before a
schema change read as a reader sees them) and written as one Parquet file with Iceberg's
field ids and statistics. Files of an older partition spec are left as they are (a file
is rewritten only into the spec it was written in, and pyiceberg writes added files into
the default spec's manifest); a snapshot with delete files is not compacted (rewriting a
data file without applying its deletes would bring deleted rows back).

The commit is one ``replace`` snapshot (``Rewrite``): the small files deleted and the new
ones added atomically, every data manifest merged by spec into manifests of about
``commit.manifest.target-size-bytes`` in the same snapshot. The merge alone (no file to
compact) is the same producer with nothing added or deleted. The snapshot names
``replace``, which streaming readers skip: it changes no row.

A compacted file is named ``raysink-compact-<pass>-<n>.parquet`` at the place the table's
location provider gives it, its path known before it is written (``Bin.path``), so the
pass's journal can name exactly the files a crash may leave behind.
"""

from __future__ import annotations

import contextlib
import uuid
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pyiceberg.expressions import AlwaysTrue
from pyiceberg.io.pyarrow import ArrowScan, write_file
from pyiceberg.manifest import ManifestContent, ManifestEntryStatus
from pyiceberg.table import FileScanTask, TableProperties, WriteTask
from pyiceberg.table.snapshots import Operation, Summary
from pyiceberg.table.update.snapshot import _ManifestMergeManager, _OverwriteFiles
from pyiceberg.utils.properties import property_as_int

from raysink.sinks._tiers import plan_partition

__all__ = ["Bin", "Rewrite", "live_data_files", "plan_bins", "rewrite", "write_bin"]

_PREFIX = "raysink-compact"


@dataclass(frozen=True)
class Bin:
    """Small files of one partition to be rewritten into one file at ``path``."""

    spec_id: int
    partition: Any
    files: tuple[Any, ...]
    path: str

    @property
    def bytes(self) -> int:
        return sum(int(f.file_size_in_bytes) for f in self.files)


@dataclass(frozen=True)
class _PartitionPlace:
    """What pyiceberg's location provider and ``write_file`` read of a partition key:
    the partition record as the source files hold it, and its path."""

    partition: Any
    spec: Any
    schema: Any

    def to_path(self) -> str:
        return str(self.spec.partition_to_path(self.partition, self.schema))


def live_data_files(table: Any, snapshot: Any) -> tuple[list[Any], bool]:
    """The live data files of ``snapshot`` and whether it has delete manifests."""
    files: list[Any] = []
    deletes = False
    for manifest in snapshot.manifests(table.io):
        if manifest.content != ManifestContent.DATA:
            deletes = True
            continue
        files.extend(e.data_file for e in manifest.fetch_manifest_entry(table.io,
                                                                        discard_deleted=True)
                     if e.status != ManifestEntryStatus.DELETED)
    return files, deletes


def plan_bins(table: Any, files: Sequence[Any], *, target: int, min_files: int,
              force: bool, pass_id: str) -> list[Bin]:
    """The bins to rewrite, partition by partition (default spec only), each of at least
    two small files of the tiers due and at most ``target`` bytes summed."""
    metadata = table.metadata
    spec_id = metadata.default_spec_id
    groups: dict[Any, list[Any]] = defaultdict(list)
    for f in sorted(files, key=lambda f: str(f.file_path)):
        if f.spec_id == spec_id:
            groups[f.partition].append(f)
    bins: list[Bin] = []
    provider = table.location_provider()
    spec, schema = metadata.spec(), metadata.schema()
    for partition, group in groups.items():
        for packed in plan_partition(group, _size, target=target, fan_in=min_files,
                                     force=force):
            name = f"{_PREFIX}-{pass_id}-{len(bins):05d}.parquet"
            place = None if spec.is_unpartitioned() else _PartitionPlace(partition, spec, schema)
            bins.append(Bin(spec_id=spec_id, partition=partition, files=tuple(packed),
                            path=provider.new_data_location(name, place)))
    return bins


def _size(f: Any) -> int:
    return int(f.file_size_in_bytes)


def write_bin(table: Any, item: Bin) -> Any:
    """Read the bin's files as the table's current schema and write them as one Parquet
    file at ``item.path``; its ``DataFile``."""
    metadata = table.metadata
    schema = metadata.schema()
    scan = ArrowScan(metadata, table.io, schema, AlwaysTrue())
    batches = [b for b in scan.to_record_batches([FileScanTask(f) for f in item.files])
               if b.num_rows]
    place: Any = None
    if not metadata.spec().is_unpartitioned():
        place = _PartitionPlace(item.partition, metadata.spec(), schema)
    task = _NamedTask(write_uuid=uuid.uuid4(), task_id=0, schema=schema,
                      record_batches=batches, partition_key=place,
                      name=item.path.rsplit("/", 1)[1])
    (written,) = list(write_file(table.io, metadata, iter([task])))
    if written.file_path != item.path:  # pragma: no cover - a location provider changed
        raise RuntimeError(f"pyiceberg wrote {written.file_path!r}, the journal names "
                           f"{item.path!r}")
    return written


@dataclass(frozen=True)
class _NamedTask(WriteTask):
    """A ``WriteTask`` whose file name is the bin's (journaled before it is written)."""

    name: str = ""

    def generate_data_file_filename(self, extension: str) -> str:
        return self.name


class Rewrite(_OverwriteFiles):
    """An overwrite that changes no row: its summary says ``replace``, and it merges
    every data manifest by spec (pyiceberg's merge manager, any two manifests)."""

    def _summary(self, snapshot_properties: Any = None) -> Any:
        summary = super()._summary(snapshot_properties or {})
        return Summary(Operation.REPLACE, **summary.additional_properties)

    def _process_manifests(self, manifests: list[Any]) -> list[Any]:
        target = property_as_int(self._transaction.table_metadata.properties,
                                 TableProperties.MANIFEST_TARGET_SIZE_BYTES,
                                 TableProperties.MANIFEST_TARGET_SIZE_BYTES_DEFAULT)
        target = target or TableProperties.MANIFEST_TARGET_SIZE_BYTES_DEFAULT
        data = [m for m in manifests if m.content == ManifestContent.DATA]
        deletes = [m for m in manifests if m.content != ManifestContent.DATA]
        merger = _ManifestMergeManager(target_size_bytes=target, min_count_to_merge=2,
                                       merge_enabled=True, snapshot_producer=self)
        merged = list(merger.merge_manifests(data)) + deletes
        self.listed = {m.manifest_path for m in merged}
        return merged

    def merged_away(self) -> list[str]:
        """Manifests this producer wrote and then merged into others (its added and
        delete manifests, its rewrites of manifests that lost files): no snapshot lists
        them."""
        listed: set[str] = getattr(self, "listed", set())
        return [p for p in self._written_manifests if p not in listed]


def rewrite(table: Any, removed: Sequence[Any], added: Sequence[Any],
            properties: dict[str, str]) -> Any:
    """Commit one ``replace`` snapshot on ``table`` (compare-and-swap on its current
    snapshot): ``removed`` data files out, ``added`` in, manifests merged. Returns the
    table after the commit; a lost race raises pyiceberg's ``CommitFailedException``."""
    tx = table.transaction()
    producer = Rewrite(operation=Operation.OVERWRITE, transaction=tx, io=table.io,
                       snapshot_properties=properties)
    for f in removed:
        producer.delete_data_file(f)
    for f in added:
        producer.append_data_file(f)
    producer.commit()
    committed = tx.commit_transaction()
    for path in producer.merged_away():
        with contextlib.suppress(FileNotFoundError):
            table.io.delete(path)
    return committed
