"""The one codec for Arrow schemas that travel in manifests and commit requests, and the
one way to say how two schemas differ.

A schema travels as text: base64 of its Arrow IPC form, with the schema-level metadata
dropped (pandas and Spark put large, irrelevant blobs there; field metadata, such as
Iceberg field ids, is kept). ``same`` compares what a table stores: names and types in
order, not metadata or nullability. ``differences`` lists, for a person, what keeps one
schema from being stored as another.
"""

from __future__ import annotations

import base64

import pyarrow as pa

__all__ = ["decode", "describe", "differences", "encode", "same"]


def encode(schema: pa.Schema) -> str:
    """Base64 of the Arrow IPC schema, without schema-level metadata (JSON-safe)."""
    return base64.b64encode(schema.remove_metadata().serialize().to_pybytes()).decode("ascii")


def decode(text: str) -> pa.Schema:
    """The schema ``encode`` wrote."""
    return pa.ipc.read_schema(pa.py_buffer(base64.b64decode(text)))


def same(a: pa.Schema, b: pa.Schema) -> bool:
    """Equal names and types in order, ignoring metadata and nullability."""
    return a.names == b.names and all(x.type == y.type for x, y in zip(a, b, strict=True))


def differences(expected: pa.Schema, actual: pa.Schema) -> list[str]:
    """What keeps ``actual`` from being stored as ``expected``; empty when nothing does.

    A non-nullable column where a nullable one is expected is compatible (widening)."""
    want = {f.name: f for f in expected}
    got = {f.name: f for f in actual}
    diffs: list[str] = []
    missing = [name for name in want if name not in got]
    extra = [name for name in got if name not in want]
    if missing:
        diffs.append(f"missing columns {missing}")
    if extra:
        diffs.append(f"unexpected columns {extra}")
    for name in (n for n in want if n in got):
        w, g = want[name], got[name]
        if not w.type.equals(g.type):
            diffs.append(f"column {name!r}: expected {w.type}, got {g.type}")
        elif g.nullable and not w.nullable:
            diffs.append(f"column {name!r}: expected non-nullable, got nullable")
    if not diffs and expected.names != actual.names:
        diffs.append(f"column order: expected {expected.names}, got {actual.names}")
    return diffs


def describe(expected: pa.Schema, actual: pa.Schema) -> str:
    """``differences`` in one line (``"nullability differs"`` when they are only that)."""
    return "; ".join(differences(expected, actual)) or "nullability differs"
