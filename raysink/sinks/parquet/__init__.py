"""A plain Parquet directory: the embedded default sink.

Layout of one sink directory (it belongs to one runtime's sink)::

    <path>/
      part-e000000000012-a0001-w0003-<uuid>.parquet      committed data: what readers see
      _raysink/
        staging/
          _writing/w0003-<session>/<uuid>.parquet         flushed, not yet pre-committed
          000000000012/0001/e000000000012-a0001-w0003-<uuid>.parquet    pre-committed
        commits/000000000012.json                          commit log entry: the marker
        commits/000000000013.claim -> <decision>           a commit under way (see commit)

``pyarrow.dataset`` and Spark skip names starting with ``_`` or ``.``, so ``_raysink`` and
temporary files (``.<name>.tmp``) are never read as data.

Writer side (``ParquetSinkWriter``): batches are buffered up to ``row_group_size`` rows and
written with ``pyarrow.parquet.ParquetWriter``; a file rolls once it reaches
``max_file_bytes``. ``flush`` closes the current file: a file is written under a temporary
name, fsynced and renamed, so a flushed file is complete or absent. ``pre_commit`` renames
the flushed files into ``staging/<epoch>/<attempt>/`` (deterministic names from
``staged_name``) and describes them in the manifest::

    {"writer": 3, "epoch": 12, "attempt": 1,
     "files": [{"path": "_raysink/staging/000000000012/0001/e...-<uuid>.parquet",
                "rows": 1000, "bytes": 5120}],
     "rows": 1000, "bytes": 5120,
     "schema": "<base64 of the Arrow IPC schema>" | null}

Paths are relative to the sink directory and must name a file directly inside
``_raysink/staging/<epoch>/<attempt>/``; anything else is refused with ``MetaStoreError``
and never followed.

Coordinator side (``ParquetSink``):

* ``commit(epoch, manifests)`` first claims the epoch for its decision
  (``commits/<epoch>.claim``, a symbolic link created exclusively, its directory fsynced:
  ``raysink.sinks._claims``), renames
  every staged file to ``part-<staged name>`` in the directory, fsyncs it, writes the
  commit log entry (temporary file, fsync, rename, fsync; it names the decision), drops
  the claim, then removes the epoch's staging. Idempotent: with the entry present (or a
  newer one: older entries are pruned) only the staging is swept; a file already moved is
  skipped; a staged file missing without its final file is a ``DataLossError``. A re-run
  after a crash at any step converges (it finds its own claim). A commit that finds
  another decision's claim (another driver of the runtime, with a meta store of its own,
  committing the same epoch) moves nothing, drops its own staged files and returns
  ``ALREADY``: two decisions of one epoch never both land. ``holds_decision`` tells them apart.
* ``abort(epoch, manifests)`` deletes the listed staged files (``None``: the whole
  ``staging/<epoch>``); idempotent; never touches committed files.
* The commit log keeps the newest ``COMMIT_LOG_KEEP`` entries (older ones are deleted
  after each commit): the newest is the marker, the others help a person see what the
  last epochs wrote. A stream of many small epochs keeps a bounded directory.
* ``committed_epoch()`` is the highest epoch with a commit log entry. It is ``None`` when
  the directory, ``_raysink/commits`` or every entry is missing. The coordinator compares it
  with the meta store: behind it with ``target_exists()`` true, the marker was lost and is
  re-created (``recreate_marker``); with the directory gone, the table was lost
  (``DataLossError``).

A plain directory has no atomic multi-file commit: files appear one rename at a time, so a
crash in the middle of ``commit`` shows part of an epoch until the roll-forward re-runs
it. Use ``DeltaSink`` or ``IcebergSink`` where readers need atomic visibility.

For the same reason a directory is never compacted (``docs/maintenance.md``): a file per
writer per epoch stays a file; long streams of small epochs belong in Delta or Iceberg.

Modules: ``_sink`` (``ParquetSink``: validate, commit, abort, the marker), ``_writer``
(``ParquetSinkWriter``), ``_layout`` (the directory's places; the manifests' paths
checked), ``_publish`` (staged files moved into place), ``_log`` (the commit log and the
claims).
"""

from raysink.sinks.parquet._sink import ParquetSink
from raysink.sinks.parquet._writer import ParquetSinkWriter

__all__ = ["ParquetSink", "ParquetSinkWriter"]
