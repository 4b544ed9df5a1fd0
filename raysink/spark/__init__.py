"""Spark on Ray (RayDP): the only raysink package that imports pyspark or raydp.

``init_spark()`` starts a RayDP session with what Java 17 needs; ``SparkPartitions``
hands a DataFrame's partitions to Ray as Arrow tables, one per partition, through
RayDP's recoverable path. Importing the package checks the releases of RayDP, pyspark and
pandas against raysink's ranges (``raysink.protocol.requirements``).

The names are imported on first use (module ``__getattr__``): writer actors unpickle
``raysink.spark.partitions`` items and need neither pyspark nor raydp for them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from raysink.protocol.requirements import check_extra

if TYPE_CHECKING:
    from raysink.spark.handoff import SparkPartitions, normalise_schema
    from raysink.spark.session import active_spark, init_spark, stop_spark

# RayDP, pyspark and pandas, each only when installed (a writer unpickling partitions needs
# none of them): a release outside raysink's range fails here, by name, before any use.
check_extra("spark")

__all__ = ["SparkPartitions", "active_spark", "init_spark", "normalise_schema", "stop_spark"]

_LAZY = {
    "SparkPartitions": "raysink.spark.handoff",
    "normalise_schema": "raysink.spark.handoff",
    "active_spark": "raysink.spark.session",
    "init_spark": "raysink.spark.session",
    "stop_spark": "raysink.spark.session",
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
