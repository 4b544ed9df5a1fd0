"""The sinks raysink ships.

Each is imported on first use (module ``__getattr__``), so ``import raysink.sinks`` never
imports ``deltalake``, ``pyiceberg``, ``psycopg`` or ``confluent_kafka``; a sink whose
library is missing says which extra to install when it is used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from raysink.sinks.base import Manifest, Sink, SinkWriter

if TYPE_CHECKING:
    from raysink.sinks.parquet import ParquetSink

__all__ = ["DeltaSink", "IcebergSink", "KafkaSink", "Manifest", "ParquetSink", "PostgresSink",
           "Sink", "SinkWriter"]

_LAZY = {
    "ParquetSink": "raysink.sinks.parquet",
    "DeltaSink": "raysink.sinks.delta",
    "IcebergSink": "raysink.sinks.iceberg",
    "PostgresSink": "raysink.sinks.postgres",
    "KafkaSink": "raysink.sinks.kafka",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
