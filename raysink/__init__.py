"""raysink: exactly-once sinks for Spark-on-Ray jobs."""
