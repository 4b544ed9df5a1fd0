"""PostgreSQL sink: exactly-once inserts or upserts through ``psycopg`` 3.

``from raysink.sinks import PostgresSink`` (or ``raysink.sinks.postgres.PostgresSink``).
Two commit methods, both keyed by ``(runtime, sink, epoch, attempt, writer)``, each in
its own module:

``"prepared"`` (default, ``_prepared``)
    Each writer works inside one transaction per epoch attempt: appends COPY straight into
    the target, upserts go a chunk at a time through the writer's own UNLOGGED stage into
    ``INSERT … ON CONFLICT DO UPDATE``. ``pre_commit`` inserts the writer's progress row
    and runs ``PREPARE TRANSACTION``; the coordinator's ``commit`` runs ``COMMIT
    PREPARED`` per writer, then inserts the epoch row ``(…, writer=-1)``. Rows reach the
    target once. Needs ``max_prepared_transactions > 0`` on the server. Readers see one
    writer's part of an epoch before another's (between the ``COMMIT PREPARED`` calls).

``"staging"`` (``_staging``)
    Writers COPY into a LOGGED staging table; ``commit`` is ONE transaction moving the
    epoch's rows into the target with its progress row. Works on any server; readers see
    each epoch at once; rows are written twice.

The modules, in layers: each imports only those below it::

    _sink        PostgresSink: the description, its connection, the coordinator's calls
    _writer      PostgresWriter: one writer actor's rows, one transaction per attempt
    _validate    validate(): read-only checks of privileges, tables, server settings
    _prepared    method="prepared"      _staging    method="staging"
    _evolve      schema_evolution="add_columns": stage tables, the target altered at commit
    _target      Target: the bound sink's options, connections and errors; the target's
                 creation at commit
    _tables      raysink's tables beside the target, progress rows, claims, gids, and
                 PostgresManifest (what a writer's manifest holds)
    _types       psycopg (imported lazily), Arrow and PostgreSQL types, CSV for COPY

Measured with ``bench/sink_postgres.py`` (1 M rows of 4 columns, 2 writers, 2 cores):
appends in ``prepared`` run at 0.8-1.3x a plain single-process COPY, ``staging`` at
0.12-0.25x (the move is a second full write, serial in the coordinator). Upserts of 1 M
rows (half new keys, half existing) in ``prepared`` run at 1.6-2x a single-process
``INSERT … ON CONFLICT`` from a staged COPY (0.14-0.28 M rows/s on a shared 2-core
machine): the server's own CPU, 4-6 us per upserted row, is the bound. Empty-epoch
commits cost about 1-7 ms p50 in either method.

Upserts keep the last row per key within an epoch, by ``(seq, row index)``; later epochs
overwrite earlier ones. ``committed_epoch()`` is the highest epoch row ``writer=-1``, and
``None`` when the progress table is missing or holds nothing for this sink: the
coordinator compares it with its meta store and calls ``recreate_marker`` (no epoch
pending) or raises ``DataLossError`` (one pending). A target deleted after commits is a
``DataLossError``; one that never received data is created.
"""

from raysink.sinks.postgres._sink import PostgresSink
from raysink.sinks.postgres._types import arrow_to_postgres_type
from raysink.sinks.postgres._writer import PostgresWriter

__all__ = ["PostgresSink", "PostgresWriter", "arrow_to_postgres_type"]
