"""Run by ``spark-submit --packages`` (``raysink.spark.packages``), after Spark resolved
the packages: prints the ``spark.jars`` Spark set, as one JSON line, and starts nothing."""

from __future__ import annotations

import json

from pyspark.java_gateway import launch_gateway


def main() -> None:
    # the gateway spark-submit started for this script
    gateway = launch_gateway()  # type: ignore[no-untyped-call]
    jars = gateway.jvm.java.lang.System.getProperty("spark.jars")
    print("RAYSINK_RESOLVED_JARS " + json.dumps(jars), flush=True)
    gateway.close()


if __name__ == "__main__":
    main()
