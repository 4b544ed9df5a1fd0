"""A Structured Streaming driver the tests can SIGKILL: ``python -m tests.spark.streaming_driver
'<json>'``.

It starts its own local Ray (``address="local"``, never the test session's) and RayDP
session, opens the runtime on the given meta store, and runs one ``availableNow`` query
over a Parquet file source (one file per micro-batch) with ``foreachBatch`` into a
ParquetSink. Protocol lines on stdout start with ``@@``::

    @@READY                                   Spark and the runtime are up
    @@BATCH <batch_id> <epoch> <rows> <skipped>   foreach_batch returned
    @@DONE <last committed epoch>             the query drained the input; clean exit

``hold_after`` (a batch id) makes the callback sleep after writing that batch, before
Spark records it as done: the test kills the driver in that window, so Spark replays the
batch on the next start.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any


def _say(line: str) -> None:
    print(f"@@{line}", flush=True)


def main(config: dict[str, Any]) -> None:
    os.environ["PYSPARK_PYTHON"] = sys.executable
    import ray

    from raysink import SinkRuntime
    from raysink.sinks import ParquetSink
    from raysink.spark import init_spark, stop_spark

    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False,
             namespace="raysink")
    spark = init_spark("raysink-test-stream-driver", executors=1, executor_cores=1,
                       executor_memory="1g",
                       configs={"spark.ui.showConsoleProgress": "false",
                                "spark.ui.enabled": "false",
                                "spark.sql.shuffle.partitions": "2"})
    spark.sparkContext.setLogLevel("ERROR")
    rt = SinkRuntime(config["name"], ParquetSink(config["table"]), writers=2,
                     metastore=config["metastore"], retry_cap=0.5, progress=False).start()
    hold_after = config.get("hold_after")

    def on_batch(df: Any, batch_id: int) -> None:
        report = rt.foreach_batch(df, batch_id)
        _say(f"BATCH {batch_id} {report.epoch} {report.rows} {report.skipped}")
        if hold_after is not None and batch_id == hold_after:
            time.sleep(600)  # killed here: written, not yet recorded by Spark

    _say("READY")
    query = (spark.readStream.schema("id long, payload string")
             .option("maxFilesPerTrigger", 1).parquet(config["input"])
             .writeStream.foreachBatch(on_batch)
             .option("checkpointLocation", config["checkpoint"])
             .trigger(availableNow=True).start())
    query.awaitTermination()
    _say(f"DONE {rt.status().last_committed_epoch}")
    rt.close()
    stop_spark()
    ray.shutdown()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
