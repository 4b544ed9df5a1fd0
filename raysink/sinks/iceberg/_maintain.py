"""Iceberg table maintenance over a long stream (``IcebergSink.maintain``, ``table_stats``).

Each epoch adds a snapshot, a manifest and small data files, and pyiceberg writes every
snapshot into each new ``metadata.json``: left alone, commits slow down with every epoch.
A pass runs these steps in order, each one a commit of its own (or none), and stops at a
step boundary once the window's deadline has passed:

``recover``           finish what a crashed pass left (its journal, below)
``delete_metadata``   (first pass) set ``write.metadata.delete-after-commit.enabled`` and
                      ``write.metadata.previous-versions-max`` on the table unless it has
                      them, so pyiceberg deletes a ``metadata.json`` once it leaves the
                      log; later passes delete the older ones left from before
``compact``           small data files rewritten per partition into target-sized ones,
                      with every manifest merged, in one ``replace`` snapshot
                      (``raysink.sinks.iceberg._rewrite``)
``merge_manifests``   the manifests merged alone, once the current snapshot has many
``expire_snapshots``  snapshots older than the policy keeps removed, then exactly the files
                      they referenced that no retained snapshot references (manifest lists,
                      manifests, data files). Nothing else is ever swept: a file staged for
                      an epoch not committed yet is in no snapshot, so it is never a
                      candidate.

What is always kept: the current snapshot, branch and tag heads, and for each raysink
marker id the newest snapshot on the current ancestry carrying it (and every snapshot of
this sink's marker above the window's committed epoch: landed, not yet recorded):
``committed_epoch`` and ``holds_decision`` walk the ancestry for them. A maintenance
snapshot carries the marker of the newest snapshot of this sink (``raysink.sink``,
``raysink.epoch``, ``raysink.decision``) and says which step made it
(``raysink.maintenance``), so the walk reads the same epoch and decision through it.

Metadata on disk is bounded: at most ``METADATA_VERSIONS + 1`` ``metadata.json`` files, each
holding the retained snapshots (the newest ``keep_snapshots``, those younger than
``keep_seconds``, and at most ``every_epochs`` more committed since the last pass), one
manifest list per retained snapshot and the manifests they name.

Crashes. A step that writes files before its commit, or deletes files after it, first
writes a journal (``<table>/metadata/raysink-maintenance/<uuid>.json``, owned by the
sink's marker id) naming exactly those files; the next pass of the same sink finishes it:
a compaction whose snapshot is not in the table gets its written files deleted (they are
named ``raysink-compact-<pass>-<n>.parquet``), an expiry that committed gets its files
deleted. Fault points: ``maintenance.mid_compaction`` (compacted files written, not
committed), ``maintenance.mid_expiry`` (expiry committed, no file deleted yet),
``maintenance.mid_cleanup`` (one file of the expiry deleted, the others not).

A commit that loses the compare-and-swap to a concurrent one (another writer of the
table) is retried once on the refreshed table when the files it rewrites are all still
live, else given up cleanly (its files deleted, the pass ``complete=False``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import re
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs
from pyiceberg import exceptions as pyiceberg_exceptions
from pyiceberg.exceptions import CommitFailedException
from pyiceberg.manifest import ManifestContent
from pyiceberg.table import TableProperties
from pyiceberg.table.refs import MAIN_BRANCH
from pyiceberg.table.snapshots import ancestors_of
from pyiceberg.table.update import AssertRefSnapshotId, RemoveSnapshotsUpdate
from pyiceberg.utils.concurrent import ExecutorFactory

from raysink._faults import hit
from raysink.sinks._files import FileStore
from raysink.sinks._maintenance import (
    Maintenance,
    MaintenanceReport,
    MaintenanceWindow,
    TableStats,
)
from raysink.sinks.iceberg._rewrite import Bin, live_data_files, plan_bins, rewrite, write_bin
from raysink.sinks.iceberg._sink import DECISION_PROPERTY, EPOCH_PROPERTY, SINK_PROPERTY
from raysink.sinks.iceberg._table import IcebergOptions

__all__ = ["JOURNAL_DIR", "MAINTENANCE_PROPERTY", "METADATA_VERSIONS", "PASS_PROPERTY",
           "IcebergMaintenance"]

logger = logging.getLogger("raysink.sinks.iceberg")

MAINTENANCE_PROPERTY = "raysink.maintenance"
"""Snapshot summary key of a maintenance snapshot: the step that made it."""
PASS_PROPERTY = "raysink.maintenance.pass"
"""Snapshot summary key: the pass (its journal's compaction) that made it."""
METADATA_VERSIONS = 10
"""``write.metadata.previous-versions-max`` raysink sets on its tables."""
METADATA_PROPERTIES = {"write.metadata.delete-after-commit.enabled": "true",
                       "write.metadata.previous-versions-max": str(METADATA_VERSIONS)}
JOURNAL_DIR = "raysink-maintenance"
MERGE_AT = 8
"""Data manifests on the current snapshot before merging them alone is worth a snapshot."""
_METADATA_FILE = re.compile(r"(\d+)-[0-9a-fA-F-]+\.metadata\.json")
_EPOCH_DIR = re.compile(r"/data/raysink/\d{12}$")
_MARKER_KEYS = (SINK_PROPERTY, EPOCH_PROPERTY, DECISION_PROPERTY)
_COMMIT_LOST: tuple[type[Exception], ...] = (
    CommitFailedException,
    getattr(pyiceberg_exceptions, "ValidationException", CommitFailedException))
"""What certainly did not commit: a lost compare-and-swap, or (pyiceberg 0.12) a file to
delete that the refreshed table no longer has."""


@dataclass
class _Tally:
    steps: list[str] = field(default_factory=list)
    files_compacted: int = 0
    files_written: int = 0
    bytes_rewritten: int = 0
    snapshots_expired: int = 0
    files_deleted: int = 0
    complete: bool = True

    def did(self, step: str) -> None:
        if step not in self.steps:
            self.steps.append(step)


class IcebergMaintenance:
    """One sink's maintenance of its table (built for each call; holds no client)."""

    def __init__(self, opts: IcebergOptions, policy: Maintenance, *, marker_id: str,
                 runtime: str, sink: str) -> None:
        self._opts = opts
        self._policy = policy
        self._marker = marker_id
        self._runtime = runtime
        self._sink = sink

    # ------------------------------------------------------------------ the pass

    def run(self, window: MaintenanceWindow) -> MaintenanceReport:
        started = time.monotonic()
        tally = _Tally()
        table = self._opts.load_table()
        if table is not None and self._policy.enabled:
            steps = (self._recover, self._bound_metadata, self._compact,
                     self._merge_manifests, self._expire, self._delete_metadata)
            for step in steps:
                if time.monotonic() >= window.deadline:
                    tally.complete = False
                    break
                table = step(table, window, tally)
        return MaintenanceReport(
            sink=self._sink, steps=tuple(tally.steps), files_compacted=tally.files_compacted,
            files_written=tally.files_written, bytes_rewritten=tally.bytes_rewritten,
            snapshots_expired=tally.snapshots_expired, files_deleted=tally.files_deleted,
            seconds=time.monotonic() - started, complete=tally.complete)

    def stats(self) -> TableStats | None:
        """Data files and bytes from the current snapshot's summary; snapshots from the
        metadata; metadata files and bytes by listing ``<table>/metadata``."""
        table = self._opts.load_table()
        if table is None:
            return None
        snapshot = table.current_snapshot()
        summary = snapshot.summary if snapshot is not None and snapshot.summary else {}
        store = self._metadata_store(table)
        infos = store.fs.get_file_info(pafs.FileSelector(store.base, recursive=True,
                                                         allow_not_found=True))
        files = [i for i in infos if i.type == pafs.FileType.File]
        return TableStats(data_files=int(summary.get("total-data-files") or 0),
                          data_bytes=int(summary.get("total-files-size") or 0),
                          snapshots=len(table.metadata.snapshots),
                          metadata_files=len(files),
                          metadata_bytes=sum(int(i.size or 0) for i in files))

    # ------------------------------------------------------------------ recover

    def _recover(self, table: Any, window: MaintenanceWindow, tally: _Tally) -> Any:
        """Finish this sink's journals a crashed pass left."""
        store = self._journal_store(table)
        for name in store.list_files(""):
            record = self._read_journal(store, name)
            if record is None or record.get("owner") != self._marker:
                continue
            if record.get("kind") == "compact":
                self._finish_compaction(table, record, tally)
            elif record.get("kind") == "expire":
                self._finish_expiry(table, record, tally)
            store.delete(name)
            tally.did("recover")
        return table

    def _finish_compaction(self, table: Any, record: dict[str, Any], tally: _Tally) -> None:
        """A compaction interrupted before (or at) its commit: if its snapshot is not in
        the table, the files it wrote are nobody's."""
        pass_id = str(record["pass"])
        if any((s.summary or {}).get(PASS_PROPERTY) == pass_id
               for s in table.metadata.snapshots):
            return
        outputs = [str(p) for p in record.get("outputs", [])]
        keep = _reachable(table, table.metadata.snapshots, live_only=True)
        self._delete(table, [p for p in outputs if p not in keep], tally, fault=False)

    def _finish_expiry(self, table: Any, record: dict[str, Any], tally: _Tally) -> None:
        """An expiry interrupted after its journal: if it committed (its snapshots are
        gone), delete its files, still skipping any the table reaches."""
        expired = {int(i) for i in record.get("snapshots", [])}
        if any(s.snapshot_id in expired for s in table.metadata.snapshots):
            return
        keep = _reachable(table, table.metadata.snapshots, live_only=True)
        self._delete(table, [p for p in record.get("files", []) if p not in keep], tally,
                     fault=False)

    # ------------------------------------------------------------------ metadata files

    def _bound_metadata(self, table: Any, window: MaintenanceWindow, tally: _Tally) -> Any:
        """Have pyiceberg delete old ``metadata.json`` files at each commit (the table's
        own settings, when it has them, win)."""
        missing = {k: v for k, v in METADATA_PROPERTIES.items() if k not in table.properties}
        if not missing:
            return table
        try:
            with table.transaction() as tx:
                tx.set_properties(missing)
        except _COMMIT_LOST:
            tally.complete = False
            return self._reload(table)
        tally.did("delete_metadata")
        return self._reload(table)

    def _delete_metadata(self, table: Any, window: MaintenanceWindow, tally: _Tally) -> Any:
        """Delete ``metadata.json`` files older than the oldest in the table's metadata
        log (left from before the table deleted them itself). A newer file not in the log
        may be a concurrent commit's, about to be swapped in: never touched."""
        names = {e.metadata_file.rsplit("/", 1)[-1] for e in table.metadata.metadata_log}
        names.add(str(table.metadata_location).rsplit("/", 1)[-1])
        versions = [int(m.group(1)) for n in names if (m := _METADATA_FILE.fullmatch(n))]
        if not versions:
            return table
        oldest = min(versions)
        store = self._metadata_store(table)
        old = [rel for rel in store.list_files("")
               if "/" not in rel and (m := _METADATA_FILE.fullmatch(rel))
               and int(m.group(1)) < oldest and rel not in names]
        for rel in old:
            store.delete(rel)
        if old:
            tally.files_deleted += len(old)
            tally.did("delete_metadata")
        return table

    # ------------------------------------------------------------------ compaction

    def _compact(self, table: Any, window: MaintenanceWindow, tally: _Tally) -> Any:
        snapshot = table.current_snapshot()
        if snapshot is None:
            return table
        files, deletes = live_data_files(table, snapshot)
        if deletes:
            logger.info("Iceberg sink %s: %s has delete files; not compacted", self._marker,
                        self._opts.identifier)
            return table
        pass_id = uuid.uuid4().hex[:16]
        policy = self._policy
        bins = plan_bins(table, files, target=policy.target_file_bytes,
                         min_files=policy.min_compact_files, force=window.force,
                         pass_id=pass_id)
        if not bins:
            return table
        store = self._journal_store(table)
        journal = self._write_journal(store, {"kind": "compact", "pass": pass_id,
                                              "outputs": [b.path for b in bins]})
        done, written = self._write_bins(table, bins, window, tally)
        hit("maintenance.mid_compaction", runtime=self._runtime, sink=self._sink)
        removed = [f for b in done for f in b.files]
        committed = self._commit_rewrite(table, removed, written, pass_id)
        if committed is None:
            self._delete(table, [b.path for b in bins], None, fault=False)
            store.delete(journal)
            tally.complete = False
            return self._reload(table)
        store.delete(journal)
        tally.files_compacted += len(removed)
        tally.files_written += len(written)
        tally.bytes_rewritten += sum(b.bytes for b in done)
        tally.did("compact")
        logger.info("Iceberg sink %s compacted %d files into %d in %s", self._marker,
                    len(removed), len(written), self._opts.identifier)
        return committed

    def _write_bins(self, table: Any, bins: Sequence[Bin], window: MaintenanceWindow,
                    tally: _Tally) -> tuple[list[Bin], list[Any]]:
        """Write bins until the deadline (at least one)."""
        done: list[Bin] = []
        written: list[Any] = []
        for item in bins:
            if done and time.monotonic() >= window.deadline:
                tally.complete = False
                break
            written.append(write_bin(table, item))
            done.append(item)
        return done, written

    def _commit_rewrite(self, table: Any, removed: Sequence[Any], added: Sequence[Any],
                        pass_id: str) -> Any | None:
        """Commit the replace snapshot; after a lost race, once more on the refreshed
        table if every removed file is still live there. ``None``: given up, certainly
        not committed. An unknown outcome propagates with the journal left for the next
        pass to settle."""
        step = "compact" if removed else "merge_manifests"
        for attempt in range(2):
            props = {**self._marker_props(table), MAINTENANCE_PROPERTY: step,
                     PASS_PROPERTY: pass_id}
            try:
                return rewrite(table, removed, added, props)
            except _COMMIT_LOST:
                table = self._reload(table)
                if attempt or not self._still_live(table, removed):
                    logger.info("Iceberg sink %s: %s lost to a concurrent commit on %s; "
                                "the next pass plans again", self._marker, step,
                                self._opts.identifier)
                    return None
        return None  # pragma: no cover - the loop returns

    def _still_live(self, table: Any, files: Sequence[Any]) -> bool:
        snapshot = table.current_snapshot()
        if snapshot is None:
            return False
        live, deletes = live_data_files(table, snapshot)
        paths = {f.file_path for f in live}
        return not deletes and all(f.file_path in paths for f in files)

    def _merge_manifests(self, table: Any, window: MaintenanceWindow, tally: _Tally) -> Any:
        """Merge the current snapshot's data manifests alone (a compaction merged them
        already) once there are many and merging makes them fewer."""
        snapshot = table.current_snapshot()
        if snapshot is None or "compact" in tally.steps:
            return table
        data = [m for m in snapshot.manifests(table.io) if m.content == ManifestContent.DATA]
        target = int(table.properties.get(TableProperties.MANIFEST_TARGET_SIZE_BYTES,
                                          TableProperties.MANIFEST_TARGET_SIZE_BYTES_DEFAULT))
        fewest = math.ceil(sum(int(m.manifest_length) for m in data) / target)
        if len(data) < (2 if window.force else MERGE_AT) or len(data) <= fewest:
            return table
        committed = self._commit_rewrite(table, [], [], uuid.uuid4().hex[:16])
        if committed is None:
            tally.complete = False
            return self._reload(table)
        tally.did("merge_manifests")
        return committed

    # ------------------------------------------------------------------ expiry

    def _expire(self, table: Any, window: MaintenanceWindow, tally: _Tally) -> Any:
        metadata = table.metadata
        current = table.current_snapshot()
        if current is None:
            return table
        keep = self._retained(table, window)
        expired = [s for s in metadata.snapshots if s.snapshot_id not in keep]
        if not expired:
            return table
        retained = [s for s in metadata.snapshots if s.snapshot_id in keep]
        doomed = sorted(_reachable(table, expired, live_only=False)
                        - _reachable(table, retained, live_only=True))
        ids = [s.snapshot_id for s in expired]
        store = self._journal_store(table)
        journal = self._write_journal(store, {"kind": "expire", "snapshots": ids,
                                              "files": doomed})
        tx = table.transaction()
        tx._apply((RemoveSnapshotsUpdate.model_validate({"snapshot-ids": ids}),),
                  (AssertRefSnapshotId.model_validate({"snapshot-id": current.snapshot_id,
                                                       "ref": MAIN_BRANCH}),))
        try:
            table = tx.commit_transaction()
        except _COMMIT_LOST:
            store.delete(journal)
            tally.complete = False
            logger.info("Iceberg sink %s: expiry lost to a concurrent commit on %s; the next "
                        "pass plans again", self._marker, self._opts.identifier)
            return self._reload(table)
        tally.snapshots_expired += len(ids)
        tally.did("expire_snapshots")
        hit("maintenance.mid_expiry", runtime=self._runtime, sink=self._sink)
        self._delete(table, doomed, tally, fault=True)
        store.delete(journal)
        return table

    def _retained(self, table: Any, window: MaintenanceWindow) -> set[int]:
        """The snapshots the policy keeps, and those raysink's recovery reads."""
        metadata = table.metadata
        policy = self._policy
        newest = sorted(metadata.snapshots, key=lambda s: (s.timestamp_ms, s.sequence_number),
                        reverse=True)
        young = time.time() * 1000 - policy.keep_seconds * 1000
        keep = {s.snapshot_id for s in newest[:policy.keep_snapshots]}
        keep |= {s.snapshot_id for s in newest if s.timestamp_ms >= young}
        keep |= {ref.snapshot_id for ref in metadata.refs.values()}
        seen: set[str] = set()
        for s in ancestors_of(table.current_snapshot(), metadata):
            summary: Mapping[str, Any] = s.summary or {}
            marker = summary.get(SINK_PROPERTY)
            if marker is None:
                continue
            if marker not in seen:
                seen.add(marker)
                keep.add(s.snapshot_id)
            epoch = summary.get(EPOCH_PROPERTY)
            if (marker == self._marker and window.committed_epoch is not None
                    and epoch is not None and int(epoch) > window.committed_epoch):
                keep.add(s.snapshot_id)
        return keep

    # ------------------------------------------------------------------ helpers

    def _marker_props(self, table: Any) -> dict[str, str]:
        """This sink's marker as its newest snapshot on the ancestry carries it."""
        for s in ancestors_of(table.current_snapshot(), table.metadata):
            summary: Mapping[str, Any] = s.summary or {}
            if summary.get(SINK_PROPERTY) == self._marker:
                return {k: str(summary[k]) for k in _MARKER_KEYS if summary.get(k) is not None}
        return {}

    def _delete(self, table: Any, paths: Iterable[str], tally: _Tally | None, *,
                fault: bool) -> None:
        """Delete files (missing ones are fine), then the staging directories of their
        (committed) epochs left empty."""
        parents: set[str] = set()
        for n, path in enumerate(paths):
            if n == 1 and fault:
                hit("maintenance.mid_cleanup", runtime=self._runtime, sink=self._sink)
            with contextlib.suppress(FileNotFoundError):
                table.io.delete(path)
            parent = path.rsplit("/", 1)[0]
            if _EPOCH_DIR.search(parent):
                parents.add(parent)
            if tally is not None:
                tally.files_deleted += 1
        for parent in parents:
            self._opts.store(parent).remove_empty_dir("")

    def _reload(self, table: Any) -> Any:
        return self._opts.load_table() or table

    def _metadata_store(self, table: Any) -> FileStore:
        return self._opts.store(f"{table.location().rstrip('/')}/metadata")

    def _journal_store(self, table: Any) -> FileStore:
        return self._opts.store(f"{table.location().rstrip('/')}/metadata/{JOURNAL_DIR}")

    def _write_journal(self, store: FileStore, record: dict[str, Any]) -> str:
        name = f"{uuid.uuid4().hex}.json"
        body = json.dumps({**record, "owner": self._marker}).encode()
        store.write(name, pa.py_buffer(body))
        return name

    @staticmethod
    def _read_journal(store: FileStore, name: str) -> dict[str, Any] | None:
        if not name.endswith(".json") or "/" in name:
            return None
        try:
            with store.fs.open_input_stream(store.full(name)) as f:
                record = json.loads(f.read())
        except (OSError, ValueError):
            return None
        return record if isinstance(record, dict) else None


def _reachable(table: Any, snapshots: Iterable[Any], *, live_only: bool) -> set[str]:
    """Every file the snapshots reference: manifest lists, manifests, and data files
    (live ones only, or every entry of their manifests)."""
    paths: set[str] = set()
    manifests: dict[str, Any] = {}
    for s in snapshots:
        paths.add(s.manifest_list)
        for m in s.manifests(table.io):
            manifests.setdefault(m.manifest_path, m)
    paths.update(manifests)

    def entries(manifest: Any) -> list[str]:
        return [e.data_file.file_path
                for e in manifest.fetch_manifest_entry(table.io, discard_deleted=live_only)]

    for found in ExecutorFactory.get_or_create().map(entries, manifests.values()):
        paths.update(found)
    return paths
