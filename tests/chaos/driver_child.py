"""A driver process for driver-kill trials: ``python -m tests.chaos.driver_child '<json>'``.

It connects to the test session's Ray cluster (so its death leaves no orphan processes)
and opens the trial's runtime. For an epoch way in (``arrow``, ``feeds``, ``datasink``)
it writes epochs ``1..n``, printing ``START <e>`` before and ``DONE <e> <committed>``
after each; for a stream it starts the producers and prints ``STREAMING`` once they
write. Then it waits to be killed.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import ray

from raysink import SinkRuntime
from tests.chaos.targets import build_sinks, epoch_table


def _runtime(config: dict[str, Any]) -> SinkRuntime:
    return SinkRuntime(str(config["name"]), build_sinks(config["sinks"]), writers=2,
                       metastore=str(config["metastore"]),
                       flush_interval=float(config["flush_interval"]), retry_cap=0.5,
                       max_attempts=3, progress=False, **config["options"]).start()


def _epochs(rt: SinkRuntime, config: dict[str, Any]) -> None:
    from tests.chaos.ways import WayIn

    spec = SimpleNamespace(via=config["via"], extra=config["extra"], fault="driver_kill")
    way = WayIn(spec, None, Path(config["dir"]))
    rows, pieces = list(config["rows"]), list(config["pieces"])
    for epoch in range(1, int(config["epochs"]) + 1):
        table = epoch_table(epoch, rows[epoch - 1], int(config["feed"]))
        step = max(1, -(-table.num_rows // pieces[epoch - 1]))
        parts = [table.slice(i, step) for i in range(0, table.num_rows, step)] or [table]
        print(f"START {epoch}", flush=True)
        report = way.write(rt, epoch, parts)
        print(f"DONE {epoch} {report.committed}", flush=True)
    print("ALL DONE", flush=True)


def main(config: dict[str, Any]) -> None:
    ray.init(address=str(config["address"]), namespace="raysink", log_to_driver=False)
    rt = _runtime(config)
    if config["via"] == "stream":
        from tests.chaos.faults import run_in_thread
        from tests.chaos.streams import StreamRun

        stream = StreamRun(rt, Path(config["dir"]), config["extra"]["stream"])
        _, box = run_in_thread(stream.run)
        stream.first_data_epoch(120.0, box)
        print("STREAMING", flush=True)
    else:
        _epochs(rt, config)
    time.sleep(600)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
