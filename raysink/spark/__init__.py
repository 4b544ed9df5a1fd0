"""Spark on Ray (RayDP): the only raysink package that imports pyspark or raydp.

``init_spark()`` starts a RayDP session with what Java 17 needs; ``SparkPartitions``
hands a DataFrame's partitions to Ray as Arrow tables, one per partition, through
RayDP's recoverable path.
"""

from raysink.spark.handoff import SparkPartitions, normalise_schema
from raysink.spark.session import active_spark, init_spark, stop_spark

__all__ = ["SparkPartitions", "active_spark", "init_spark", "normalise_schema", "stop_spark"]
