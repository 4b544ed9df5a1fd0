"""A Delta Lake table written through ``deltalake`` (delta-rs).

Layout inside the table directory::

    <path>/
      _delta_log/...                                        the Delta log
      _raysink/<epoch:012d>/e<epoch>-a<attempt>-w<writer>-<uuid>-<n>.parquet   staged files

Writers encode their rows into Parquet in memory and upload the files at ``pre_commit``
under ``_raysink/<epoch>/``. Delta readers only read files the log references, so a staged
file is invisible until ``commit`` adds it; once committed it is an ordinary data file
where it lies. The staging root is hidden (a leading ``_``), so a ``VACUUM`` run outside
raysink, at any retention, never deletes the files of an epoch still pending; what
raysink's compaction removes from the table, its own ``expire_files`` deletes once no
retained version references it. With ``maintenance=False`` the sink stages under
``raysink/`` instead (as every sink did up to 0.2), so that the table's own ``VACUUM``
reclaims what a user's ``OPTIMIZE`` or ``MERGE`` removes; such a staged file is protected
only by the vacuum retention (7 days by default). Recovery looks under both roots.

Manifest of one writer for one attempt (append mode; upsert stages whole rows the same
way, with empty ``partition_values``)::

    {"writer": 3, "epoch": 12, "attempt": 1,
     "files": [{"path": "_raysink/000000000012/e...-0000.parquet", "size": 5120,
                "partition_values": {"day": "2024-01-01"}, "modification_time": 1700000000000,
                "stats": "{\\"numRecords\\": 1000, ...}", "rows": 1000}],
     "rows": 1000, "bytes": 5120,
     "schema": "<base64 Arrow IPC schema>" | null}

Commit: one Delta commit carrying ``Transaction(app_id=marker_id, version=epoch)``.
Append mode adds the staged files; upsert mode reads the staged rows, keeps the last row
per key (manifest order, then row order) and MERGEs them. ``commit`` checks
``transaction_version(marker_id) >= epoch`` first (delta-rs does not skip an app
transaction already committed), so it is idempotent; a concurrent commit of the same
epoch from another instance makes ours fail with ``CommitFailedError`` (app id conflict),
after which the marker is re-checked. The commit's metadata names the decision
(``raysink.sink``, ``raysink.epoch``, ``raysink.decision``), so ``holds_decision`` can tell a
decision's own earlier commit from another driver's.

Schema evolution (``schema_evolution="add_columns"``): writers check each batch against
the table's schema (``raysink._schema.evolve``: new columns are added, a type narrower
than the table's is cast up; a wider one is refused, since delta-rs cannot write the
type-widening table feature). An epoch whose files all fit the table's schema commits
its staged files as above. One that adds columns, or whose files hold a column in a type
the table stores otherwise, is committed as ONE Delta commit carrying the metadata action
(the new schema), the data and the transaction marker: its staged rows are read, cast to
the new schema and written again by ``write_deltalake(schema_mode="merge")`` (upserts:
``merge(merge_schema=True)``), and the staged files are deleted after. A crash before
that commit leaves the old schema and none of the epoch's rows; the re-run commits both.

A missing table: ``committed_epoch()`` is ``None`` and ``target_exists()`` is ``False``.
The coordinator, which knows from the meta store whether this sink ever committed rows,
raises ``DataLossError`` when it did; otherwise ``commit`` creates the table, an empty
epoch included (its writers saw the schema). Only an epoch that carried no schema at all
creates nothing: ``commit`` returns ``NO_TARGET`` and the meta store records it unmarked.

Modules: ``_sink`` (``DeltaSink``: validate, commit, marker, abort), ``_writer``
(``DeltaSinkWriter``), ``_table`` (options, the cached table, Delta's types, rows read
back), ``_stats`` (a staged file's statistics, from its footer); the staging they share
with Iceberg is ``raysink.sinks._table_format``.
"""

from raysink.sinks.delta._sink import DeltaSink
from raysink.sinks.delta._writer import DeltaSinkWriter

__all__ = ["DeltaSink", "DeltaSinkWriter"]
