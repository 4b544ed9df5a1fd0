"""The version checksum file (``_delta_log/<version>.crc``) of the table's latest version.

Why: delta-rs writes no checksum files, and without one for the version it opens, Delta's
Spark reader (3.x) runs two Spark jobs before it can plan anything: one reads the
checkpoint to learn whether it is a V2 checkpoint (the protocol, which would tell, is not
known yet), and one reads the checkpoint and the commits after it for the two rows of
protocol and metadata. Measured on a 300-epoch table at load 20-35 on 2 cores, these two
jobs were 5.7-7.4 s of the first ``count()`` of a fresh Spark reader (``bench/
longrun_spark.py``); with the file both are read from it. Other readers ignore it.

What the file holds (the Delta protocol's "Version Checksum File"): the required fields
only, each exact for the version it names: the live files' count and bytes, one metadata
and one protocol action as the table stores them. The optional ones (``setTransactions``,
``domainMetadata``, ``allFiles``, histograms) are left out, which a reader takes as "not
known" and computes from the log: a wrong or partial ``setTransactions`` would hide
raysink's marker from a Spark writer.

When it is written: after each epoch commit and each maintenance pass, for the version
the sink's copy of the table is at then (a later commit of another writer only means that
version has no file; readers fall back to the jobs above). A table whose protocol names a
feature this module does not know gets no file: such a feature may put something in the
checksum (in-commit timestamps, deletion vector counts, domain metadata) that a reader
would then miss. Writing is best effort: the file is optional, so a failure is logged and
the commit stands.
"""

from __future__ import annotations

import json
import logging
import uuid
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs

from raysink.sinks._files import FileStore

__all__ = ["KNOWN_FEATURES", "checksum", "checksum_name", "write_checksum"]

logger = logging.getLogger(__name__)

KNOWN_FEATURES = frozenset({
    "appendOnly", "invariants", "checkConstraints", "generatedColumns", "changeDataFeed",
    "columnMapping", "identityColumns", "timestampNtz"})
"""Table features that add nothing to a version checksum."""
_UNSAFE_CONFIG = ("delta.enableInCommitTimestamps", "delta.enableDeletionVectors",
                  "delta.enableRowTracking")


def checksum_name(version: int) -> str:
    return f"_delta_log/{version:020d}.crc"


def checksum(dt: Any) -> dict[str, Any] | None:
    """The checksum of ``dt``'s loaded version, or ``None`` when the table has a feature
    (or a setting) that would put more in it than this module writes."""
    protocol = dt.protocol()
    features = {*(protocol.reader_features or ()), *(protocol.writer_features or ())}
    configuration = dict(dt.metadata().configuration or {})
    if features - KNOWN_FEATURES or any(
            configuration.get(key, "false").lower() == "true" for key in _UNSAFE_CONFIG):
        return None
    # one column through the C stream: a whole pa.table() of the actions costs 10-30 ms
    sizes = pa.chunked_array(dt.get_add_actions(flatten=False).column("size_bytes"))
    meta = dt.metadata()
    metadata: dict[str, Any] = {
        "id": meta.id,
        "format": {"provider": "parquet", "options": {}},
        "schemaString": dt.schema().to_json(),
        "partitionColumns": list(meta.partition_columns),
        "configuration": configuration,
    }
    for key, value in (("name", meta.name), ("description", meta.description),
                       ("createdTime", meta.created_time)):
        if value is not None:
            metadata[key] = value
    protocol_action: dict[str, Any] = {"minReaderVersion": protocol.min_reader_version,
                                       "minWriterVersion": protocol.min_writer_version}
    if protocol.reader_features is not None:
        protocol_action["readerFeatures"] = sorted(protocol.reader_features)
    if protocol.writer_features is not None:
        protocol_action["writerFeatures"] = sorted(protocol.writer_features)
    total = pc.sum(sizes).as_py() or 0
    return {"tableSizeBytes": int(total), "numFiles": len(sizes), "numMetadata": 1,
            "numProtocol": 1, "metadata": metadata, "protocol": protocol_action}


def write_checksum(store: FileStore, dt: Any, sink: str, previous: int | None = None
                   ) -> int | None:
    """Write the checksum of ``dt``'s version unless there is one, then delete the one of
    version ``previous`` (only the newest version's file is worth keeping: a fresh reader
    opens the newest; maintenance's log cleanup sweeps any other left). The version whose
    file is there now, or ``previous`` when none was written."""
    try:
        version = int(dt.version())
        name = checksum_name(version)
        if store.fs.get_file_info(store.full(name)).type == pafs.FileType.NotFound:
            content = checksum(dt)
            if content is None:
                return previous
            _put(store, name, json.dumps(content, separators=(",", ":")).encode())
        if previous is not None and previous < version:
            store.delete(checksum_name(previous))
        return version
    except Exception as exc:  # optional file: the commit it describes stands
        logger.warning("Delta sink %s: no checksum file written: %s: %s", sink,
                       type(exc).__name__, exc)
        return previous


def _put(store: FileStore, name: str, data: bytes) -> None:
    """Whole or not at all (a reader must never see half a file), without fsync: the file
    is optional, and one a machine crash loses only costs a reader the two jobs. Locally
    a temporary file renamed into place; an object store's put is atomic by itself."""
    target = store.full(name)
    if not store.local:
        with store.fs.open_output_stream(target) as out:
            out.write(data)
        return
    folder, base = target.rsplit("/", 1)
    tmp = f"{folder}/.{base}.{uuid.uuid4().hex[:8]}.tmp"
    with store.fs.open_output_stream(tmp) as out:
        out.write(data)
    store.fs.move(tmp, target)
