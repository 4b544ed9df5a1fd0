"""Delta table maintenance: compaction, checkpoints, expiry of removed files, log cleanup.

One pass, run by the coordinator in the sink's commit worker (no commit of this sink runs
meanwhile), in named steps, each checked against the window's deadline before it starts:

``compact``
    Per partition (the whole table when unpartitioned), the small files of the size tiers
    due (``raysink.sinks._tiers``: a tier once it holds ``min_compact_files`` files;
    every small file, forced) rewritten into files of at most ``target_file_bytes``, all in
    one commit (``raysink.sinks.delta._compact``). The commit carries no app transaction:
    the table's transaction state is the latest version of each app id in the whole log,
    so the marker stays where the epoch commit put it (``committed_epoch()`` reads it
    through any number of maintenance commits).
``checkpoint``
    ``create_checkpoint`` once ``checkpoint_every`` versions have passed since the last
    one, so opening the table reads one checkpoint and at most that many commits. A
    checkpoint holds every app transaction (unless ``delta.setTransactionRetentionDuration``
    is set, which raysink refuses to clean up after: see below).
``expire_files``
    The data files removed (by compaction, or an upsert's MERGE) in the log entries the
    next step deletes: no retained version references them. Files staged for an epoch the
    meta store has not committed are never in a remove action; a path under the staging
    prefix above ``committed_epoch`` is skipped all the same.
``cleanup_log``
    Log entries older than the newest checkpoint at or before the oldest retained version,
    and the checksum file of any version but the newest (``_checksum``: the sink writes one
    per commit and deletes the one before; this sweeps what a restart left).
    A version is retained while it is among the newest ``keep_snapshots`` or younger than
    ``keep_seconds`` (its commit file's time); every retained version stays readable by time
    travel, since the checkpoint it starts from is kept with every entry after it.

Why not delta-rs's own ``vacuum`` and ``cleanup_metadata``: both retain by age alone, in
whole hours (``retention_hours``) or by ``delta.logRetentionDuration`` (a table property, so
a commit), and ``cleanup_metadata`` keeps no checkpoint below the versions it keeps.

Crash points (``raysink._faults``): ``maintenance.mid_compaction`` after the compacted
files are written and before their commit (the next pass deletes them),
``maintenance.mid_expiry`` after the removed files are deleted and before the log entries
naming them, ``maintenance.mid_cleanup`` after the first log entry is deleted. Each step is
safe to re-run: deletions of missing files are no-ops, and log entries go oldest first, so
what is left is always a readable suffix.
"""

from __future__ import annotations

import json
import logging
import math
import re
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs

from raysink._faults import hit
from raysink.sinks._files import FileStore
from raysink.sinks._maintenance import (
    Maintenance,
    MaintenanceReport,
    MaintenanceWindow,
    TableStats,
)
from raysink.sinks.delta._compact import MAINTENANCE_KEY, compact
from raysink.sinks.delta._table import STAGING_ROOTS, DeltaOptions, deltalake_module

__all__ = ["MAINTENANCE_KEY", "LogEntry", "commit_hooks", "maintain", "new_table_configuration",
           "stats"]

logger = logging.getLogger(__name__)

_LOG = "_delta_log"
_VERSIONED = re.compile(r"^(\d{20})\.")
_TXN_RETENTION = "delta.setTransactionRetentionDuration"


TOMBSTONE_RETENTION = "delta.deletedFileRetentionDuration"


def new_table_configuration(policy: Maintenance) -> dict[str, str | None] | None:
    """The table properties of a table the sink creates: the tombstone retention of a
    maintained table (``Maintenance.tombstone_retention``), none when maintenance is off.

    ``expire_files`` deletes a removed file once no retained version references it, so a
    ``remove`` action older than that names a file that is gone; delta-rs keeps it in
    every checkpoint for the whole retention all the same (measured with deltalake 1.6.6:
    250,000 of them make a 9.6 MiB checkpoint that takes 3 s to write).
    """
    if not policy.enabled:
        return None
    seconds = max(1, math.ceil(policy.tombstone_retention))
    return {TOMBSTONE_RETENTION: f"interval {seconds} seconds"}


def commit_hooks(policy: Maintenance) -> Any:
    """delta-rs's post-commit hooks for the sink's commits and compactions: off while
    raysink maintains the table (its passes write the checkpoints and clean the log), since
    after every commit they look through the whole ``_delta_log``, every retained version of
    it (9-15 ms a commit at 1,200 entries against 5.7 ms without, deltalake 1.6.6); ``None``,
    delta-rs's defaults, when maintenance is off, so the table is still checkpointed."""
    if not policy.enabled:
        return None
    return deltalake_module().PostCommitHookProperties(create_checkpoint=False,
                                                       cleanup_expired_logs=False)


@dataclass(frozen=True, slots=True)
class LogEntry:
    """One file of ``_delta_log`` that belongs to a version."""

    name: str
    version: int
    size: int
    mtime: float

    @property
    def is_commit(self) -> bool:
        return self.name.endswith(".json") and self.name.count(".") == 1

    @property
    def is_checksum(self) -> bool:
        return self.name.endswith(".crc") and self.name.count(".") == 1

    @property
    def is_checkpoint(self) -> bool:
        return ".checkpoint." in self.name and self.name.endswith(".parquet")


@dataclass
class _Pass:
    """The running tally of one pass."""

    sink: str
    runtime: str
    window: MaintenanceWindow
    policy: Maintenance
    started: float = field(default_factory=time.monotonic)
    steps: list[str] = field(default_factory=list)
    compacted: int = 0
    written: int = 0
    rewritten: int = 0
    expired: int = 0
    deleted: int = 0
    complete: bool = True

    def out_of_time(self) -> bool:
        if time.monotonic() >= self.window.deadline:
            self.complete = False
        return not self.complete

    def report(self) -> MaintenanceReport:
        return MaintenanceReport(
            sink=self.sink, steps=tuple(self.steps), files_compacted=self.compacted,
            files_written=self.written, bytes_rewritten=self.rewritten,
            snapshots_expired=self.expired, files_deleted=self.deleted,
            seconds=time.monotonic() - self.started, complete=self.complete)


def maintain(opts: DeltaOptions, policy: Maintenance, window: MaintenanceWindow, *,
             sink: str, runtime: str) -> MaintenanceReport:
    """One pass over the table at ``opts.uri`` (nothing when there is no table yet)."""
    tally = _Pass(sink=sink, runtime=runtime, window=window, policy=policy)
    dt = opts.load()
    if dt is None:
        return tally.report()
    steps: list[Callable[[DeltaOptions, Any, _Pass], None]] = [
        compact, _checkpoint, _expire_and_clean]
    for number, step in enumerate(steps):  # the first always runs: every pass progresses
        if number and tally.out_of_time():
            break
        step(opts, dt, tally)
        dt.update_incremental()
    return tally.report()


# --------------------------------------------------------------------------- checkpoint


def _checkpoint(opts: DeltaOptions, dt: Any, tally: _Pass) -> None:
    if _refuses_cleanup(dt, tally):
        return
    entries = log_entries(opts)
    last = max((e.version for e in entries if e.is_checkpoint), default=-1)
    latest = int(dt.version())
    due = latest - last >= tally.policy.checkpoint_every or (tally.window.force
                                                             and latest > last)
    if due:
        dt.create_checkpoint()
        tally.steps.append("checkpoint")


def _refuses_cleanup(dt: Any, tally: _Pass) -> bool:
    """A table whose app transactions expire would lose raysink's marker in a checkpoint:
    no checkpoint or cleanup of raysink's then (delta-rs may still write its own)."""
    if _TXN_RETENTION not in (dt.metadata().configuration or {}):
        return False
    logger.warning("Delta sink %s: the table sets %s, which expires raysink's marker; "
                   "its log is not cleaned up (unset the property)", tally.sink, _TXN_RETENTION)
    return True


# --------------------------------------------------------------------------- expiry, cleanup


def log_entries(opts: DeltaOptions) -> list[LogEntry]:
    """The versioned files of ``_delta_log``, oldest first."""
    store = opts.store()
    selector = pafs.FileSelector(store.full(_LOG), recursive=False, allow_not_found=True)
    entries = []
    for info in store.fs.get_file_info(selector):
        match = _VERSIONED.match(info.base_name)
        if match is None or info.type != pafs.FileType.File:
            continue
        mtime = info.mtime.timestamp() if info.mtime is not None else 0.0
        entries.append(LogEntry(info.base_name, int(match.group(1)), int(info.size or 0), mtime))
    return sorted(entries, key=lambda e: (e.version, e.name))


def oldest_retained(entries: list[LogEntry], latest: int, policy: Maintenance,
                    now: float) -> int:
    """The oldest version retention keeps: among the newest ``keep_snapshots``, or
    younger than ``keep_seconds``."""
    by_count = latest - policy.keep_snapshots + 1
    young = [e.version for e in entries
             if e.is_commit and e.mtime >= now - policy.keep_seconds]
    return max(0, min([by_count, *young]))


def _expire_and_clean(opts: DeltaOptions, dt: Any, tally: _Pass) -> None:
    if _refuses_cleanup(dt, tally):
        return
    entries = log_entries(opts)
    keep_from = oldest_retained(entries, int(dt.version()), tally.policy, time.time())
    store = opts.store()
    # a file removed at version v is in no version from v on: none retained needs it
    removing = [e for e in entries if e.is_commit and e.version <= keep_from]
    removed = _removed_files(store, removing, tally.window.committed_epoch)
    deleted = sum(_delete(store, path) for path in removed)
    for parent in sorted({p.rsplit("/", 1)[0] for p in removed if "/" in p}):
        store.remove_empty_dir(parent)  # an epoch's staging directory, once emptied
    if deleted:
        tally.steps.append("expire_files")
        tally.deleted += deleted
    hit("maintenance.mid_expiry", runtime=tally.runtime, sink=tally.sink)
    start = max((e.version for e in entries if e.is_checkpoint and e.version <= keep_from),
                default=0)
    expiring = [e for e in entries if e.version < start and not e.is_checksum]
    for number, entry in enumerate(expiring):
        store.delete(f"{_LOG}/{entry.name}")
        if number == 0:
            hit("maintenance.mid_cleanup", runtime=tally.runtime, sink=tally.sink)
    latest = max((e.version for e in entries), default=0)
    for entry in entries:  # checksum files of versions no longer the newest (_checksum)
        if entry.is_checksum and entry.version < latest:
            store.delete(f"{_LOG}/{entry.name}")
    if expiring:
        tally.steps.append("cleanup_log")
        tally.expired += sum(1 for e in expiring if e.is_commit)
        tally.deleted += len(expiring)
    logger.info("Delta sink %s: removed %d log entries below version %d and %d data files",
                tally.sink, len(expiring), start, deleted)


def _delete(store: FileStore, path: str) -> bool:
    """Delete one file; ``False`` when it was gone already (a pass re-reads the removes
    of the versions it keeps until a checkpoint passes them)."""
    try:
        store.fs.delete_file(store.full(path))
    except FileNotFoundError:
        return False
    return True


def _removed_files(store: FileStore, commits: list[LogEntry],
                   committed: int | None) -> list[str]:
    """The data files the ``remove`` actions of ``commits`` name (never a file staged for
    an epoch above ``committed``)."""
    paths: list[str] = []
    for entry in commits:
        with store.fs.open_input_stream(store.full(f"{_LOG}/{entry.name}")) as stream:
            lines = stream.read().decode().splitlines()
        for line in lines:
            action = json.loads(line) if line.strip() else {}
            if "remove" in action:
                path = urllib.parse.unquote(action["remove"]["path"])
                if "://" not in path and not _pending_staged(path, committed):
                    paths.append(path)
    return paths


def _pending_staged(path: str, committed: int | None) -> bool:
    parts = path.split("/")
    if len(parts) < 3 or parts[0] not in STAGING_ROOTS or not parts[1].isdigit():
        return False
    return committed is None or int(parts[1]) > committed


# --------------------------------------------------------------------------- stats


def stats(opts: DeltaOptions, dt: Any) -> TableStats:
    """Live data files and bytes, versions still in the log, and the log's size."""
    sizes = pa.table(dt.get_add_actions(flatten=False)).column("size_bytes").to_pylist()
    entries = log_entries(opts)
    return TableStats(data_files=len(sizes), data_bytes=int(sum(sizes)),
                      snapshots=sum(1 for e in entries if e.is_commit),
                      metadata_files=len(entries),
                      metadata_bytes=sum(e.size for e in entries))
