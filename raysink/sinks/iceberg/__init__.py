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

Partitioning (``docs/iceberg.md``): a table raysink creates gets ``partition_by``'s spec;
an existing table is written with its current spec. Writers split each batch by the spec
(``_transforms``: Iceberg's transforms on Arrow columns) into one file or more per
partition; a file's entry adds ``"spec": [[column, transform], ...]`` and
``"partition": [values]`` (``_partition``), and the commit builds each data file with
them (``_data_files``), splitting again a file staged under a spec that changed since.

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

Maintenance (``maintenance=``: on by default, ``raysink.Maintenance`` to tune it, ``False``
to switch it off): between two commits the coordinator runs ``maintain``, which compacts
small files per partition into target-sized ones and merges manifests (one ``replace``
snapshot, which pyiceberg cannot make), expires snapshots the policy does not keep and
deletes exactly the files only they referenced, and bounds the ``metadata.json`` files
(``write.metadata.delete-after-commit.enabled``, ``previous-versions-max=10``). The marker
reads back the same through it, and a crashed pass is finished by the next one
(``_maintain``'s docstring has the rules and the bound).

Modules: ``_sink`` (``IcebergSink``: validate, commit, marker), ``_writer``
(``IcebergSinkWriter``), ``_table`` (the catalog, options, Iceberg's types),
``_partition`` (specs, a batch split by partition, partition values),
``_transforms`` (the transforms in Arrow), ``_data_files`` (an epoch's data files in
their partitions), ``_maintain`` (the maintenance pass, ``table_stats``) and ``_rewrite``
(compaction and manifest merging); the staging they share with Delta is
``raysink.sinks._table_format``.
"""

from raysink.sinks.iceberg._sink import EPOCH_PROPERTY, SINK_PROPERTY, IcebergSink
from raysink.sinks.iceberg._table import default_catalog
from raysink.sinks.iceberg._writer import IcebergSinkWriter

__all__ = ["EPOCH_PROPERTY", "SINK_PROPERTY", "IcebergSink", "IcebergSinkWriter",
           "default_catalog"]
