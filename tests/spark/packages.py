"""The Spark package sets of the spark layer's sessions, in one place: the modules name
them, and ``scripts/fetch_spark_packages.py`` (run by ``make setup``) resolves each set
into the cache beforehand, so no test pays a download or a resolver run."""

from __future__ import annotations

from raysink.spark.packages import DELTA, ICEBERG, KAFKA, SQLITE_JDBC

#: tests/spark/test_read_back.py: Delta's and Iceberg's connectors, the SQLite JDBC driver
#: for Iceberg's JDBC catalog over raysink's default (pyiceberg, SQLite) catalog.
READ_BACK = (DELTA, ICEBERG, SQLITE_JDBC)

#: tests/spark/test_kafka_pipeline.py (examples/kafka_pipeline.py): Spark's Kafka source,
#: in the killed driver's process and in the layer's session (the run after the kill).
KAFKA_PIPELINE = (KAFKA,)

#: the layer's in-process session (tests/spark/conftest.py): one set, so that one session
#: serves every module (each module's packages ride along in the others).
SHARED_PACKAGES = READ_BACK + KAFKA_PIPELINE

SETS = (SHARED_PACKAGES, KAFKA_PIPELINE)
