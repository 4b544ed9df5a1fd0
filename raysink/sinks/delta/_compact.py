"""Delta compaction by size tier, committed by raysink itself.

delta-rs's ``optimize.compact`` takes every file of a partition below its target size, so
each pass rewrote the growing compacted file again (607 MB rewritten to keep 14.6 MB over
10,000 epochs of 1,000 rows). Here the files are chosen by size tier
(``raysink.sinks._tiers``), read with pyarrow as the table's current schema, written as one
Parquet file per bin under ``_raysink/compact/`` (``VACUUM`` skips ``_`` directories; the
maintenance pass's ``expire_files`` deletes them once removed and expired) and committed in
one transaction: an ``add`` per bin and a ``remove`` per file it replaces, every action
``dataChange: false`` (no row changed: streaming readers skip the commit), no app
transaction (the sink's marker stays where the epoch commit put it).

Races: delta-rs checks no conflict for the removes of an ``append`` transaction (measured
with deltalake 1.6.6: an ``OPTIMIZE`` committed meanwhile, then this commit, doubled the
rows), so the commit is a compare-and-swap on the version the bins were planned on
(``max_commit_retries=0``). Lost, the pass reloads the table and commits once more if every
file it replaces is still live there; otherwise it gives up (the next pass plans again).

A crash leaves files no version references. Before writing, the pass records its outputs
and the version it commits after in a journal, ``_raysink/compact/<pass>.json``; the next
pass reads each journal left: if the version after the recorded one carries the pass's id,
the commit happened and the outputs stay; otherwise they are deleted.

Not compacted: tables with deletion vectors, column mapping or row tracking (their files
cannot be rewritten by reading their Parquet alone), and a partition whose values cannot be
matched back to the strings of the log.
"""

from __future__ import annotations

import json
import logging
import time
import urllib.parse
import uuid
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.parquet as pq

from raysink import _schema
from raysink._faults import hit
from raysink.sinks._files import FileStore
from raysink.sinks._parquet_buffer import EncodedFile, ParquetBuffer
from raysink.sinks._tiers import plan_partition
from raysink.sinks.delta._stats import file_stats
from raysink.sinks.delta._table import HIDDEN_STAGING, DeltaOptions, deltalake_module, table_schema

if TYPE_CHECKING:
    from raysink.sinks._maintenance import Maintenance
    from raysink.sinks.delta._maintain import _Pass

__all__ = ["COMPACT_DIR", "PASS_KEY", "compact"]

logger = logging.getLogger(__name__)

COMPACT_DIR = f"{HIDDEN_STAGING}/compact"
PASS_KEY = "raysink.compactPass"
"""Commit metadata naming the compaction pass a commit finished."""
MAINTENANCE_KEY = "raysink.maintenance"
_LOG = "_delta_log"
_REFUSED_FEATURES = ("deletionVectors", "columnMapping", "rowTracking")
_READ_ROWS = 131_072


@dataclass(frozen=True)
class _Live:
    """One live data file: its path as stored (decoded), size, partition strings."""

    path: str
    size: int
    partition: tuple[tuple[str, str | None], ...]


@dataclass(frozen=True)
class _Bin:
    files: tuple[_Live, ...]
    output: str


@dataclass(frozen=True)
class _Written:
    bin: _Bin
    size: int
    rows: int
    stats: str


def compact(opts: DeltaOptions, dt: Any, tally: _Pass) -> None:
    """The ``compact`` step of a maintenance pass."""
    store = opts.store()
    finish_journals(store, dt)
    refused = _refused(dt)
    if refused:
        logger.info("Delta sink %s: not compacted, the table uses %s", tally.sink, refused)
        return
    pass_id = uuid.uuid4().hex[:16]
    bins = _plan(dt, tally.policy, tally.window.force, pass_id, tally.sink)
    if not bins:
        return
    journal = f"{COMPACT_DIR}/{pass_id}.json"
    _write_journal(store, journal, pass_id, int(dt.version()), bins)
    written: list[_Written] = []
    for item in bins:
        if written and tally.out_of_time():
            break
        written.append(_write_bin(opts, store, dt, item))
    hit("maintenance.mid_compaction", runtime=tally.runtime, sink=tally.sink)
    if not _commit(store, journal, dt, written, pass_id, tally):
        for w in written:
            store.delete(w.bin.output)
        store.delete(journal)
        tally.complete = False
        return
    store.delete(journal)
    removed = [f for w in written for f in w.bin.files]
    tally.steps.append("compact")
    tally.compacted += len(removed)
    tally.written += len(written)
    tally.rewritten += sum(f.size for f in removed)
    logger.info("Delta sink %s: compacted %d files into %d", tally.sink, len(removed),
                len(written))


# --------------------------------------------------------------------------- plan


def _refused(dt: Any) -> str | None:
    protocol = dt.protocol()
    features = set(protocol.reader_features or ()) | set(protocol.writer_features or ())
    for feature in _REFUSED_FEATURES:
        if feature in features:
            return feature
    mode = (dt.metadata().configuration or {}).get("delta.columnMapping.mode") or "none"
    return None if mode == "none" else "columnMapping"


def _plan(dt: Any, policy: Maintenance, force: bool, pass_id: str, sink: str) -> list[_Bin]:
    groups: dict[tuple[tuple[str, str | None], ...], list[_Live]] = defaultdict(list)
    for f in live_files(dt, sink):
        groups[f.partition].append(f)
    bins: list[_Bin] = []
    for key in sorted(groups, key=repr):
        for packed in plan_partition(groups[key], lambda f: f.size,
                                     target=policy.target_file_bytes,
                                     fan_in=policy.min_compact_files, force=force):
            bins.append(_Bin(tuple(packed), f"{COMPACT_DIR}/{pass_id}-{len(bins):05d}.parquet"))
    return bins


def live_files(dt: Any, sink: str = "") -> list[_Live]:
    """The table's live data files, each with its partition's strings as the log holds
    them; the files of a partition not matched to them are left out (with a warning)."""
    adds = pa.table(dt.get_add_actions(flatten=False))
    names = list(dt.metadata().partition_columns)
    strings = _partition_strings(dt, names, adds.schema)
    paths = adds.column("path").to_pylist()
    sizes = adds.column("size_bytes").to_pylist()
    typed = adds.column("partition").to_pylist() if names else [{}] * len(paths)
    out: list[_Live] = []
    unmatched = 0
    for path, size, values in zip(paths, sizes, typed, strict=True):
        key = tuple((values or {}).get(n) for n in names)
        partition = strings.get(key)
        if partition is None:
            unmatched += 1
            continue
        out.append(_Live(urllib.parse.unquote(path), int(size), partition))
    if unmatched:
        logger.warning("Delta sink %s: %d files' partition values were not matched to the "
                       "log's; they are not compacted", sink, unmatched)
    return out


def _partition_strings(dt: Any, names: Sequence[str], adds: pa.Schema,
                       ) -> dict[tuple[Any, ...], tuple[tuple[str, str | None], ...]]:
    """Each partition's typed values (as ``get_add_actions`` gives them) to its strings."""
    if not names:
        return {(): ()}
    types = adds.field("partition").type
    out: dict[tuple[Any, ...], tuple[tuple[str, str | None], ...]] = {}
    for values in dt.partitions():
        try:
            key = tuple(None if values.get(n) is None
                        else pa.scalar(values[n]).cast(types.field(n).type).as_py()
                        for n in names)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, KeyError):
            continue
        out[key] = tuple((n, values.get(n)) for n in names)
    return out


# --------------------------------------------------------------------------- write


def _write_bin(opts: DeltaOptions, store: FileStore, dt: Any, item: _Bin) -> _Written:
    """Read the bin's files as the table's current schema (its partition columns left
    out, as Delta stores them) and write them as one Parquet file at ``item.output``."""
    parts = set(dt.metadata().partition_columns)
    schema = pa.schema([f for f in table_schema(dt) if f.name not in parts])
    buffer = ParquetBuffer(schema, max_rows=2**62, compression=opts.compression)
    for f in item.files:  # a row group at a time: the coordinator holds one, not a bin
        with store.fs.open_input_file(store.full(f.path)) as source:
            for batch in pq.ParquetFile(source).iter_batches(batch_size=_READ_ROWS):
                aligned = _schema.align([pa.Table.from_batches([batch])], schema)
                for piece in aligned.to_batches():
                    buffer.write(piece)
    encoded = buffer.finish() or [_empty_file(schema)]
    (one,) = encoded
    store.write(item.output, one.data)
    return _Written(item, one.data.size, one.rows, file_stats(one.data, one.rows))


def _empty_file(schema: pa.Schema) -> EncodedFile:
    sink = pa.BufferOutputStream()
    pq.write_table(schema.empty_table(), sink)
    return EncodedFile(sink.getvalue(), 0)


def _write_journal(store: FileStore, journal: str, pass_id: str, version: int,
                   bins: Sequence[_Bin]) -> None:
    doc = {"pass": pass_id, "version": version, "outputs": [b.output for b in bins]}
    store.write(journal, pa.py_buffer(json.dumps(doc).encode()))


# --------------------------------------------------------------------------- commit


def _commit(store: FileStore, journal: str, dt: Any, written: Sequence[_Written],
            pass_id: str, tally: _Pass) -> bool:
    """Commit the written bins after the version they were planned on; once more after
    a lost race if every file they replace is still live."""
    dl = deltalake_module()
    for attempt in range(2):
        try:
            _transaction(dt, written, pass_id, tally.policy)
            return True
        except dl.exceptions.CommitFailedError:
            dt.update_incremental()
            live = {f.path for f in live_files(dt, tally.sink)}
            replaced = [f.path for w in written for f in w.bin.files]
            if attempt or not all(p in live for p in replaced):
                logger.info("Delta sink %s: the table changed under a compaction; the next "
                            "pass plans it again", tally.sink)
                return False
            _write_journal(store, journal, pass_id, int(dt.version()),
                           [w.bin for w in written])
    return False  # pragma: no cover - the loop returns


def _transaction(dt: Any, written: Sequence[_Written], pass_id: str,
                 policy: Maintenance) -> None:
    from deltalake.transaction import AddAction, RemoveAction

    from raysink.sinks.delta._maintain import commit_hooks

    dl = deltalake_module()
    now = int(time.time() * 1000)
    actions: list[Any] = []
    for w in written:
        values = dict(w.bin.files[0].partition)
        actions.append(AddAction(w.bin.output, w.size, values, now, False, w.stats))
        actions.extend(RemoveAction(f.path, False, now, f.size, dict(f.partition))
                       for f in w.bin.files)
    properties = dl.CommitProperties(
        custom_metadata={MAINTENANCE_KEY: "compact", PASS_KEY: pass_id},
        max_commit_retries=0)
    dt.create_write_transaction(actions, "append", dt.schema(),
                                partition_by=list(dt.metadata().partition_columns),
                                commit_properties=properties,
                                post_commithook_properties=commit_hooks(policy))


# --------------------------------------------------------------------------- journals


def finish_journals(store: FileStore, dt: Any) -> int:
    """Settle the journals a crashed pass left: the outputs of a pass whose commit is in
    the log stay; any other's are deleted, but for one live in the table (the log entry
    that would say is cleaned up already). Returns the files deleted."""
    deleted = 0
    live: set[str] | None = None
    depth = COMPACT_DIR.count("/") + 1
    for rel in store.list_files(COMPACT_DIR):
        if not rel.endswith(".json") or rel.count("/") != depth:
            continue
        try:
            with store.fs.open_input_stream(store.full(rel)) as stream:
                doc = json.loads(stream.read())
        except (OSError, ValueError):
            doc = {}
        outputs = [str(o) for o in doc.get("outputs", [])
                   if str(o).startswith(f"{COMPACT_DIR}/")]
        verdict = _committed(store, str(doc.get("pass")), int(doc.get("version", -2)) + 1)
        if verdict is not True:
            if verdict is None:
                live = live if live is not None else {f.path for f in live_files(dt)}
                outputs = [o for o in outputs if o not in live]
            for output in outputs:
                store.delete(output)
                deleted += 1
        store.delete(rel)
    return deleted


def _committed(store: FileStore, pass_id: str, version: int) -> bool | None:
    """Whether log version ``version`` is the pass's commit (``None``: no such entry)."""
    try:
        with store.fs.open_input_stream(store.full(f"{_LOG}/{version:020d}.json")) as stream:
            lines = stream.read().decode().splitlines()
    except (FileNotFoundError, ValueError):
        return None
    for line in lines:
        action = json.loads(line) if line.strip() else {}
        if "commitInfo" in action:
            return bool(action["commitInfo"].get(PASS_KEY) == pass_id)
    return False
