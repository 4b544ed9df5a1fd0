"""``examples/kafka_pipeline.py``'s pipeline as a driver the tests can SIGKILL:
``python -m tests.spark.kafka_pipeline_driver '<json>'`` (the JSON holds the example's
``Pipeline`` fields).

It starts its own local Ray (``address="local"``, never the test session's) and a RayDP
session with Spark's Kafka package (one executor), opens the example's runtime (a
DeltaSink and a KafkaSink) and runs the example's query with the ``availableNow`` trigger.
Protocol lines on stdout start with ``@@``::

    @@READY                                       Spark and the runtime are up
    @@BATCH <batch_id> <epoch> <rows> <skipped>   foreach_batch returned
    @@DONE <last committed epoch>                 the query read everything; clean exit
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any


def _say(line: str) -> None:
    print(f"@@{line}", flush=True)


def main(config: dict[str, Any]) -> None:
    os.environ["PYSPARK_PYTHON"] = sys.executable
    import ray

    from examples.kafka_pipeline import Pipeline, runtime, start_query
    from raysink.spark import init_spark, stop_spark
    from tests.spark.packages import KAFKA_PIPELINE

    pipeline = Pipeline(**config, until_idle=True)
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False,
             namespace="raysink")
    spark = init_spark("raysink-test-kafka-pipeline", executors=1, executor_cores=1,
                       executor_memory="1g", packages=KAFKA_PIPELINE,
                       configs={"spark.ui.showConsoleProgress": "false",
                                "spark.ui.enabled": "false"})
    spark.sparkContext.setLogLevel("ERROR")
    rt = runtime(pipeline).start()

    def on_batch(df: Any, batch_id: int) -> None:
        report = rt.foreach_batch(df, batch_id)
        _say(f"BATCH {batch_id} {report.epoch} {report.rows} {report.skipped}")

    _say("READY")
    start_query(spark, pipeline, on_batch).awaitTermination()
    _say(f"DONE {rt.status().last_committed_epoch}")
    rt.close()
    stop_spark()
    ray.shutdown()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
