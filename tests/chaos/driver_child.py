"""A driver process for driver-kill trials: ``python -m tests.chaos.driver_child '<json>'``.

It connects to the test session's Ray cluster (so its death leaves no orphan processes),
opens the trial's runtime and writes epochs ``1..n``, printing ``START <e>`` before and
``DONE <e> <committed>`` after each. Then it waits to be killed.
"""

from __future__ import annotations

import json
import sys
import time

import ray

from raysink import SinkRuntime
from tests.chaos.targets import build_sinks, epoch_table


def main(config: dict[str, object]) -> None:
    ray.init(address=str(config["address"]), namespace="raysink", log_to_driver=False)
    sinks = build_sinks(config["sinks"])  # type: ignore[arg-type]
    rows: list[int] = list(config["rows"])  # type: ignore[call-overload]
    pieces: list[int] = list(config["pieces"])  # type: ignore[call-overload]
    rt = SinkRuntime(str(config["name"]), sinks, writers=2, metastore=str(config["metastore"]),
                     flush_interval=float(config["flush_interval"]),  # type: ignore[arg-type]
                     retry_cap=0.5, max_attempts=3).start()
    for epoch in range(1, int(config["epochs"]) + 1):  # type: ignore[call-overload]
        table = epoch_table(epoch, rows[epoch - 1], int(config["feed"]))  # type: ignore[call-overload]
        step = max(1, -(-table.num_rows // pieces[epoch - 1]))
        parts = [table.slice(i, step) for i in range(0, table.num_rows, step)] or [table]
        print(f"START {epoch}", flush=True)
        report = rt.write_arrow(parts, epoch=epoch)
        print(f"DONE {epoch} {report.committed}", flush=True)
    print("ALL DONE", flush=True)
    time.sleep(600)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
