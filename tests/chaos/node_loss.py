"""Node-loss chaos trials: a node removed without grace mid-epoch, on a cluster of its own.

The trial runs in a child process (``python -m tests.chaos.node_loss '<json>'``): the
test session is connected to its single-node Ray, and a process connects to one Ray at a
time. The child starts a ``tests.support.cluster.LocalCluster`` (the head and three
workers, two labelled for the coordinator), opens the trial's runtime there with three
writers per sink, its decisions in the PostgreSQL meta store, its coordinator on a
labelled worker, and writes epochs ``1..n``. In the fault epoch the node of the victim (a
writer on a worker that does not host the coordinator, or the coordinator) is removed:
while the victim is held at the trial's protocol point, or after a random delay. The
cluster is closed whatever happens; the parent then checks the targets row by row.

The child prints one line per event: ``CLUSTER UP`` (its cluster started), ``DONE
<epoch> <committed>``, ``ERROR <name> <message>`` (a driver call failed; it is retried
with a new feed), ``LOST <node> <seconds into the epoch>``, ``RECOVERED <seconds>`` (from
the removal to the next epoch committed) and ``ALL DONE``.

A child whose cluster could not start (no ``CLUSTER UP``: Ray's "The current node timed
out during startup" on a machine loaded by other work) ran nothing of the trial: it is
started again, up to ``_CLUSTER_TRIES`` times, and the trial's notes say so. Any failure
after its cluster was up fails the trial.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any, NoReturn

__all__ = ["run"]

_REPO = Path(__file__).resolve().parents[2]
LABELS = {"raysink": "coordinator"}
_CHILD_SECONDS = 420.0
_CLUSTER_TRIES = 3


def run(spec: Any, specs: dict[str, Any], metastore: str, directory: Path,
        result: Any) -> None:
    """Run the trial ``spec`` in a child process; fill ``result`` (fired, recovery,
    errors, notes). Raises when the child did not finish its epochs."""
    config = {"name": spec.name, "sinks": specs, "metastore": metastore,
              "epochs": spec.epochs, "rows": spec.rows, "pieces": spec.pieces,
              "fault_epoch": spec.fault_epoch, "victim": spec.victim, "point": spec.point,
              "delay": spec.delay, "flush_interval": spec.flush_interval}
    stderr = directory / "node_loss.stderr"
    for attempt in range(1, _CLUSTER_TRIES + 1):
        with open(stderr, "wb") as err:
            stdout, returncode = _child(config, err)
        lines = [line.strip() for line in stdout.splitlines() if line.strip()]
        if "CLUSTER UP" in lines or returncode == 0 or attempt == _CLUSTER_TRIES:
            break
        cause = _last_line(stderr.read_text(errors="replace"))
        result.notes.append(f"the trial's cluster did not start (try {attempt}: {cause}); "
                            "the child was started again")
    for line in lines:
        word, _, rest = line.partition(" ")
        if word == "ERROR":
            result.errors.append(rest.split(" ", 1)[0])
            result.notes.append(rest[:300])
        elif word == "LOST":
            result.fired = True
            result.notes.append(f"node {rest}")
        elif word == "RECOVERED":
            result.recovery_seconds = float(rest)
    if "ALL DONE" not in lines or returncode != 0:
        tail = stderr.read_text(errors="replace")[-2000:]
        raise AssertionError(f"the node-loss child did not finish (exit {returncode}): "
                             f"{lines[-8:]}\n{tail}")


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][:200] if lines else "no output"


def _child(config: dict[str, Any], err: IO[bytes]) -> tuple[str, int]:
    """Run the child in a process group of its own (its cluster's raylets are in it too).
    Past ``_CHILD_SECONDS`` it gets SIGTERM (it closes its runtime and cluster), and
    whatever of the group is left SIGKILL: no raylet outlives the trial."""
    proc = subprocess.Popen([sys.executable, "-m", "tests.chaos.node_loss",
                             json.dumps(config)], cwd=_REPO, stdout=subprocess.PIPE,
                            stderr=err, text=True, start_new_session=True)
    try:
        stdout, _ = proc.communicate(timeout=_CHILD_SECONDS)
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            stdout, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, _ = proc.communicate()
        stdout += "\nTIMEOUT\n"
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # only what this child started is left in it
    return stdout, proc.returncode


# ---------------------------------------------------------------------- the child


class _Child:
    def __init__(self, config: dict[str, Any], cluster: Any, rt: Any) -> None:
        self.config, self.cluster, self.rt = config, cluster, rt
        self.feed = 0
        self.lost_at: float | None = None

    def write(self, epoch: int, tries: int = 6) -> bool:
        """Write ``epoch`` until a driver call succeeds (a new feed each time)."""
        from raysink import RaySinkError
        from tests.chaos.targets import epoch_table

        for _ in range(tries):
            self.feed += 1
            table = epoch_table(epoch, self.config["rows"][epoch - 1], self.feed)
            step = max(1, -(-table.num_rows // self.config["pieces"][epoch - 1]))
            parts = [table.slice(i, step) for i in range(0, table.num_rows, step)] or [table]
            try:
                report = self.rt.write_arrow(parts, epoch=epoch)
            except RaySinkError as exc:
                _say(f"ERROR {type(exc).__name__} {str(exc).splitlines()[0][:200]}")
                time.sleep(getattr(exc, "retry_after", None) or 0.3)
                continue
            _say(f"DONE {epoch} {report.committed}")
            if report.committed and self.lost_at is not None:
                _say(f"RECOVERED {time.monotonic() - self.lost_at:.3f}")
                self.lost_at = None
            return bool(report.committed)
        raise SystemExit(f"epoch {epoch} not written in {tries} driver calls")

    def victim(self, epoch: int) -> tuple[str, dict[str, Any]]:
        """The victim's node and the fault context that holds ``epoch`` in it."""
        from raysink.driver.lifecycle import COORDINATOR

        actors = self.rt._actors
        coordinator = actors.node_of(COORDINATOR)
        if self.config["victim"] == "coordinator":
            when = {"epoch": epoch}
            if self.config["point"] == "sink.mid_commit":
                when["sink"] = "main"
            return str(coordinator), when
        index = next(k for k in range(actors.writer_count)
                     if actors.node_of(("main", k)) not in (coordinator, self.cluster.head))
        return str(actors.node_of(("main", index))), {"epoch": epoch, "writer": index,
                                                      "sink": "main"}

    def faulted(self, epoch: int) -> None:
        from raysink.testing import arm_fault, disarm_faults, fired

        name, point = self.config["name"], self.config["point"]
        node, when = self.victim(epoch)
        if point is not None:
            arm_fault(name, point, action="sleep", seconds=60.0, when=when)
        box: dict[str, Any] = {}
        started = time.monotonic()

        def write() -> None:
            try:
                box["committed"] = self.write(epoch)
            except BaseException as exc:  # SystemExit too: told below, in this thread
                box["error"] = exc

        thread = threading.Thread(target=write, daemon=True)
        thread.start()
        deadline = started + 60
        while point is not None and not fired(name, point) and thread.is_alive():
            if time.monotonic() > deadline:
                break
            time.sleep(0.01)
        if point is None or fired(name, point):
            time.sleep(float(self.config["delay"]))
            self.cluster.remove(node)
            self.lost_at = time.monotonic()
            _say(f"LOST {node[:8]} {self.lost_at - started:.3f}")
        disarm_faults(name)
        thread.join(300)
        if thread.is_alive():
            raise SystemExit(f"epoch {epoch} never finished after the node loss")
        if "error" in box:
            raise SystemExit(f"epoch {epoch} after the node loss: {box['error']!r}")


def _say(line: str) -> None:
    print(line, flush=True)


def _terminated(signum: int, frame: object) -> NoReturn:
    raise SystemExit(f"terminated (signal {signum})")  # the with blocks close everything


def main(config: dict[str, Any]) -> None:
    signal.signal(signal.SIGTERM, _terminated)
    from raysink import Placement, SinkRuntime
    from tests.chaos.targets import build_sinks
    from tests.support.cluster import LocalCluster

    with LocalCluster(3, labels=[LABELS, LABELS, {}]) as cluster:
        _say("CLUSTER UP")
        with SinkRuntime(config["name"], build_sinks(config["sinks"]), writers=3,
                         metastore=config["metastore"],
                         placement=Placement(coordinator=LABELS),
                         flush_interval=float(config["flush_interval"]), retry_cap=0.5,
                         max_attempts=3, progress=False) as rt:
            child = _Child(config, cluster, rt)
            for epoch in range(1, int(config["epochs"]) + 1):
                if epoch == config["fault_epoch"]:
                    child.faulted(epoch)
                else:
                    child.write(epoch)
    _say("ALL DONE")


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
