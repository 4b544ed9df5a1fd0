"""A driver of the previous release, for the upgrade test: ``<old python> old_driver.py
'<json>'``, run by the interpreter of the environment the previous release's wheel is
installed in (``tests/upgrade/release.py``), from a directory outside the source tree.

It imports only ``raysink`` (whichever release its interpreter has: it prints which),
``ray`` and ``pyarrow``, and uses only what raysink 0.1.0 has, so the test process imports
it too for the sinks and rows both sides write (``build_sink``, ``epoch_table``).

The run, on a Ray of its own (``address="local"``, its temporary directory named in the
config, so the test can end every process of it)::

    epoch 1   written and committed into every sink
    epoch 2   decided (PENDING in the meta store for every sink), not committed: the
              commits of Parquet, Delta, Iceberg and PostgreSQL find their target "down"
              (``FailingSink``'s outage file, created after epoch 1), Kafka's holds at
              ``kafka.before_finish`` (armed to sleep); ``write_arrow`` gives up waiting
              after ``commit_timeout`` and returns
    epoch 3   written, not decided: the writers stage it (pre-commit) and hold at
              ``writer.after_pre_commit`` (armed to sleep) before asking for a decision

It prints ``RAYSINK <version> <file>``, ``COMMITTED 1``, ``DECIDED 2 <committed>`` and
``STAGED 3``, then waits to be SIGKILLed.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pyarrow as pa

ID_BASE = 1_000_000
_KAFKA_TIMEOUT = 90.0


def epoch_table(epoch: int, rows: int, feed: int) -> pa.Table:
    """Rows of ``epoch``: ids ``epoch * 1e6 + i``; ``feed`` tells which driver wrote them
    (0: the old release, 1: the new one)."""
    return pa.table({
        "id": pa.array([epoch * ID_BASE + i for i in range(rows)], pa.int64()),
        "epoch": pa.array([epoch] * rows, pa.int64()),
        "feed": pa.array([feed] * rows, pa.int32()),
        "payload": pa.array([f"p{epoch}-{i % 97}" for i in range(rows)], pa.string()),
    })


def build_sink(spec: Mapping[str, Any]) -> Any:
    """One sink from its JSON description (the form of ``tests.chaos.targets``)."""
    from raysink import sinks

    kind = spec["kind"]
    if kind == "parquet":
        return sinks.ParquetSink(spec["path"])
    if kind == "delta":
        return sinks.DeltaSink(spec["path"])
    if kind == "iceberg":
        return sinks.IcebergSink(spec["identifier"], catalog=spec["catalog"],
                                 catalog_name="chaos")
    if kind == "postgres":
        return sinks.PostgresSink(spec["dsn"], spec["table"])
    if kind == "kafka":
        return sinks.KafkaSink(spec["bootstrap"], spec["topic"], key="payload",
                               partitions=3, timeout=_KAFKA_TIMEOUT)
    raise ValueError(f"unknown sink kind {kind!r}")


def _held_sinks(specs: Mapping[str, Mapping[str, Any]], state: Path) -> dict[str, Any]:
    """The sinks, each but Kafka behind ``FailingSink``'s outage file (its kind, key and
    marker are the inner sink's: the new release reopens the runtime without it)."""
    from raysink.testing import FailingSink

    held: dict[str, Any] = {}
    for name, spec in specs.items():
        sink = build_sink(spec)
        if spec["kind"] != "kafka":  # Kafka's writers hold transactions: held by a point
            sink = FailingSink(sink, state_dir=state, outage_file=state / "outage")
        held[name] = sink
    return held


def _wait(condition: Any, what: str, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise SystemExit(f"old driver: {what} did not happen in {timeout:.0f} s")
        time.sleep(0.05)


def main(config: dict[str, Any]) -> None:
    import ray

    import raysink
    from raysink import SinkRuntime
    from raysink.testing import arm_fault, fired

    print(f"RAYSINK {raysink.__version__} {raysink.__file__}", flush=True)
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False,
             object_store_memory=200 * 1024 * 1024, _temp_dir=config["ray_dir"])
    name, rows, state = str(config["name"]), int(config["rows"]), Path(config["state"])
    rt = SinkRuntime(name, _held_sinks(config["sinks"], state), writers=2,
                     metastore=str(config["metastore"]), flush_interval=0.2,
                     commit_timeout=8.0, retry_cap=0.5, progress=False).start()
    report = rt.write_arrow(epoch_table(1, rows, 0), epoch=1)
    print(f"COMMITTED 1 {report.committed}", flush=True)

    (state / "outage").write_text("down")
    arm_fault(name, "kafka.before_finish", action="sleep", seconds=3600.0,
              when={"epoch": 2})
    report = rt.write_arrow(epoch_table(2, rows, 0), epoch=2)
    print(f"DECIDED 2 {report.committed}", flush=True)

    arm_fault(name, "writer.after_pre_commit", action="sleep", seconds=3600.0, times=100,
              when={"epoch": 3})
    threading.Thread(target=rt.write_arrow, args=(epoch_table(3, rows, 0),),
                     kwargs={"epoch": 3}, daemon=True).start()
    _wait(lambda: fired(name, "writer.after_pre_commit"), "epoch 3 staged")
    time.sleep(2.0)  # the other writers stage it too
    print("STAGED 3", flush=True)
    time.sleep(3600)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
