"""Table maintenance over a long stream: the shapes a sink and the coordinator share.

A stream commits an epoch every few seconds for months. Each epoch adds small files (and,
for Iceberg, a snapshot and manifests; for Delta, a log entry), so a table left alone gets
slower to commit to and to read with every epoch. A sink that can keep its table small
implements ``Sink.maintain`` (compaction, snapshot expiry, log cleanup, checkpoints) and
``Sink.table_stats``; the coordinator runs ``maintain`` in the sink's own commit worker,
between two of its commits, so maintenance never races an epoch commit of that sink, and
stops a pass at a step boundary once ``MaintenanceWindow.deadline`` has passed, so a commit
waits for at most one step (``Maintenance.step_seconds`` is the bound a sink keeps its steps
within).

What maintenance must never touch: the sink's progress marker (the epoch the meta store
says is committed must still read back from the target afterwards), and anything staged
for an epoch that is not committed yet (a pending epoch's files are not in the table; a
sweep of unreferenced files would take them).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from raysink.errors import ConfigError

_MIB = 1024 * 1024
MIN_TOMBSTONE_SECONDS = 600.0
"""The shortest tombstone retention ``Maintenance(tombstone_seconds=None)`` stands for."""


@dataclass(frozen=True)
class Maintenance:
    """How a sink keeps its table small (the ``maintenance=`` option of the Delta and
    Iceberg sinks; ``maintenance=False`` switches it off for that sink).

    Retention keeps a snapshot (an Iceberg snapshot, a Delta version) while it is among
    the newest ``keep_snapshots`` *or* younger than ``keep_seconds``; older ones expire,
    and with them the files only they referenced. The newest snapshot, and the one holding
    the sink's marker, are always kept.
    """

    enabled: bool = True
    every_epochs: int = 10
    """A pass runs after at most this many committed epochs of the sink..."""
    min_interval_s: float = 10.0
    """...and no more often than this (``rt.maintain()`` runs one now regardless)."""
    target_file_bytes: int = 128 * _MIB
    """Compaction rewrites small files into files of at most this size."""
    min_compact_files: int = 16
    """The files of a partition (or the table, unpartitioned) smaller than
    ``target_file_bytes / 2`` fall in size tiers this many times apart; a tier is compacted
    once it holds this many files, with every smaller file of the partition
    (``raysink.sinks._tiers``)."""
    keep_snapshots: int = 100
    keep_seconds: float = 60.0
    """Also kept: every snapshot younger than this. At an epoch a second the default keeps
    at most about 100 snapshots (about 1 KiB each in every Iceberg ``metadata.json``), where
    600 s had kept a 550 KB ``metadata.json`` rewritten by every commit."""
    checkpoint_every: int = 100
    """Delta: write a checkpoint every this many versions, so opening the table reads one
    checkpoint and at most this many commits."""
    tombstone_seconds: float | None = None
    """Delta: a table the sink creates gets ``delta.deletedFileRetentionDuration`` of this
    long (``None``: ``keep_seconds``, at least ``MIN_TOMBSTONE_SECONDS``), so a checkpoint
    carries a ``remove`` action only for files removed within it. Delta's own default is
    7 days: at an epoch a second, about 1.2 M actions that every checkpoint rewrites and
    every fresh reader loads (Spark replays them in its jobs). A ``VACUUM`` run outside
    raysink takes the property as its default retention: a version older than this may
    lose files to it, as Delta documents. It cannot reach an epoch still pending, whose
    files are staged under ``_raysink/``, which ``VACUUM`` skips. A table that exists
    already keeps its own setting."""
    step_seconds: float = 5.0
    """The longest one maintenance step should hold the sink's commits."""

    def __post_init__(self) -> None:
        for name in ("every_epochs", "target_file_bytes", "min_compact_files",
                     "keep_snapshots", "checkpoint_every"):
            if getattr(self, name) < 1:
                raise ConfigError(f"Maintenance({name}=...) must be at least 1, "
                                  f"got {getattr(self, name)!r}")
        for name in ("min_interval_s", "keep_seconds", "step_seconds", "tombstone_seconds"):
            if (getattr(self, name) or 0) < 0:
                raise ConfigError(f"Maintenance({name}=...) must not be negative, "
                                  f"got {getattr(self, name)!r}")

    @classmethod
    def of(cls, option: Maintenance | bool | None, sink: str) -> Maintenance:
        """The policy a sink's ``maintenance=`` option stands for."""
        if option is None or option is True:
            return cls()
        if option is False:
            return cls(enabled=False)
        if isinstance(option, Maintenance):
            return option
        raise ConfigError(f"{sink} maintenance= takes True, False or raysink.Maintenance(...), "
                          f"got {option!r}")

    @property
    def tombstone_retention(self) -> float:
        """``tombstone_seconds``, or what ``None`` stands for."""
        if self.tombstone_seconds is not None:
            return self.tombstone_seconds
        return max(self.keep_seconds, MIN_TOMBSTONE_SECONDS)

    def replace(self, **changes: object) -> Maintenance:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


OFF = Maintenance(enabled=False)


@dataclass(frozen=True)
class MaintenanceWindow:
    """What the coordinator tells one pass."""

    deadline: float
    """``time.monotonic()`` after which the pass stops at the next step boundary (and
    returns ``complete=False``; the next pass goes on from there)."""
    committed_epoch: int | None
    """The epoch the meta store says this sink committed last: its marker must read back
    the same after the pass."""
    force: bool = False
    """``rt.maintain()``: run every step that has anything to do, thresholds aside."""


@dataclass(frozen=True)
class MaintenanceReport:
    """What one pass did (summed into ``status()``, the metrics and the dashboard)."""

    sink: str
    steps: tuple[str, ...] = ()
    """The steps that changed something, in order (``compact``, ``expire_snapshots``,
    ``delete_metadata``, ``merge_manifests``, ``checkpoint``, ``cleanup_log``, ...)."""
    files_compacted: int = 0
    """Data files rewritten into larger ones (removed from the table)."""
    files_written: int = 0
    bytes_rewritten: int = 0
    snapshots_expired: int = 0
    files_deleted: int = 0
    """Files removed from storage (data files no retained snapshot needs, old metadata,
    expired log entries)."""
    seconds: float = 0.0
    complete: bool = True


@dataclass(frozen=True)
class TableStats:
    """The size of a sink's table now (cheap to read: from the latest metadata)."""

    data_files: int
    data_bytes: int
    snapshots: int
    """Retained Iceberg snapshots, or Delta versions still in the log."""
    metadata_files: int
    metadata_bytes: int


@dataclass(frozen=True)
class MaintenanceTotals:
    """A sink's maintenance since its coordinator started (``SinkStatus.maintenance``):
    the reports of its passes summed, the failed passes, and when the last one ended."""

    passes: int = 0
    failures: int = 0
    files_compacted: int = 0
    files_written: int = 0
    bytes_rewritten: int = 0
    snapshots_expired: int = 0
    files_deleted: int = 0
    seconds: float = 0.0
    last_pass_at: float | None = None
    """Wall-clock time (``time.time()``) the last successful pass ended."""
    last_error: str | None = None
    """Why the last pass failed, until one succeeds (it is retried with backoff)."""

    def add(self, report: MaintenanceReport, at: float) -> MaintenanceTotals:
        return dataclasses.replace(
            self, passes=self.passes + 1,
            files_compacted=self.files_compacted + report.files_compacted,
            files_written=self.files_written + report.files_written,
            bytes_rewritten=self.bytes_rewritten + report.bytes_rewritten,
            snapshots_expired=self.snapshots_expired + report.snapshots_expired,
            files_deleted=self.files_deleted + report.files_deleted,
            seconds=self.seconds + report.seconds, last_pass_at=at, last_error=None)

    def failed(self, error: str) -> MaintenanceTotals:
        return dataclasses.replace(self, failures=self.failures + 1, last_error=error)
