"""Seeded trial plans: ``random.Random(seed)`` decides everything about every trial.

About 15% of the writer/coordinator kill and stall trials feed their epochs through Spark
(``rt.write(df)`` on one shared RayDP session); the others through ``write_arrow``.

The mix repeats in blocks of 20 trials, shuffled per block (21 from the second block on,
with one ``node_loss``), so each block covers every fault kind and a 12-trial sample
covers most of the single-node ones; the first 20 trials of a seed are the same as before
``node_loss`` existed:

=====================  ====  ============================================================
kind                   /20   what happens
=====================  ====  ============================================================
``driver_kill``          3   a subprocess driver is SIGKILLed mid-epoch; the runtime is
                             reopened here with the same name and meta store
``writer_point``         3   a writer SIGKILLs itself at a writer protocol point
``coordinator_point``    3   the coordinator SIGKILLs itself at a coordinator/sink point
``point_external``       3   a point stalls; the harness SIGKILLs or ``ray.kill``s a writer
                             or the coordinator meanwhile
``random_kill``          2   SIGKILL or ``ray.kill`` of a writer or the coordinator at a
                             random time during an epoch
``executor_kill``        1   a RayDP executor process is SIGKILLed during a Spark epoch
                             (the shared Spark session is restarted after the trial)
``pg_restart``           2   PostgreSQL crash-restarts while a commit is in progress
``fs_readonly``          1   the Parquet/Delta tmpfs is remounted read-only
``fs_full``              1   the Parquet/Delta tmpfs is filled up
``stall_commit``         1   the sink's commits stall longer than the flush interval
``node_loss``           (1)  on a four-node cluster of its own (a child process), the node
                             of a writer or of the coordinator is removed without grace
                             mid-epoch (at a protocol point or after a delay); one per
                             block from the second block on, so the default 12-trial
                             sample never starts a cluster (``make chaos`` runs them)
=====================  ====  ============================================================
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field
from typing import Any

from raysink._faults import POINTS

__all__ = ["FAULT_KINDS", "TrialSpec", "make_plan"]

_BLOCK = (["driver_kill"] * 3 + ["writer_point"] * 3 + ["coordinator_point"] * 3
          + ["point_external"] * 3 + ["random_kill"] * 2 + ["executor_kill"]
          + ["pg_restart"] * 2
          + ["fs_readonly", "fs_full", "stall_commit"])
FAULT_KINDS = (*dict.fromkeys(_BLOCK), "node_loss")
_FULL_RUN_ONLY = "node_loss"  # one per block, from the second block on

WRITER_POINTS = tuple(p for p in POINTS if p.startswith("writer."))
COORDINATOR_POINTS = tuple(p for p in POINTS if not p.startswith("writer."))
_SINKS_FOR = {
    "pg_restart": ("postgres",),
    "fs_readonly": ("parquet", "delta"),
    "fs_full": ("parquet", "delta"),
}
_ALL_SINKS = ("parquet", "delta", "iceberg", "postgres")
SPARK_SHARE = 0.15
"""Share of the in-process kill and stall trials that write through Spark (``rt.write``)."""
_SPARK_KINDS = ("writer_point", "coordinator_point", "point_external", "random_kill",
                "stall_commit")


@dataclass(kw_only=True)
class TrialSpec:
    """One trial, fully decided by the seed."""

    index: int
    seed: int
    name: str
    sink: str
    fault: str
    epochs: int
    rows: list[int]
    pieces: list[int]
    fault_epoch: int
    flush_interval: float
    two_sinks: bool = False
    point: str | None = None
    victim: str | None = None
    how: str | None = None
    writer: int = 0
    delay: float = 0.0
    variant: str | None = None
    pg_metastore: bool = False
    via: str = "arrow"
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def make_plan(seed: int, trials: int) -> list[TrialSpec]:
    """The first ``trials`` trials of the plan of ``seed`` (a prefix of any longer plan:
    trial ``i`` is the same whatever ``trials`` is)."""
    shuffler = random.Random(f"{seed}:kinds")
    kinds: list[str] = []
    while len(kinds) < trials:
        block = list(_BLOCK)
        shuffler.shuffle(block)
        if kinds:  # every block but the first (the default sample stays on one node)
            block.insert(shuffler.randrange(len(block) + 1), _FULL_RUN_ONLY)
        kinds.extend(block)
    turns = random.Random(f"{seed}:sinks")
    sink_turns = {k: turns.randrange(4) for k in FAULT_KINDS}
    specs: list[TrialSpec] = []
    for index, kind in enumerate(kinds[:trials]):
        options = _SINKS_FOR.get(kind, _ALL_SINKS)
        sink = options[sink_turns[kind] % len(options)]
        sink_turns[kind] += 1
        specs.append(_trial(random.Random(f"{seed}:{index}"), seed, index, kind, sink))
    return specs


def _trial(rng: random.Random, seed: int, index: int, kind: str, sink: str) -> TrialSpec:
    epochs = rng.randint(3, 4)
    spec = TrialSpec(
        index=index, seed=seed, name=f"chaos-s{seed}-t{index:04d}-{kind.replace('_', '')}",
        sink=sink, fault=kind, epochs=epochs,
        rows=[rng.choice([0, 1, 50]) if rng.random() < 0.1 else rng.randint(20, 3000)
              for _ in range(epochs)],
        pieces=[rng.randint(1, 3) for _ in range(epochs)],
        fault_epoch=rng.randint(1, epochs), flush_interval=rng.choice([0.2, 0.5, 1.0]),
        two_sinks=rng.random() < 0.2, pg_metastore=sink == "postgres" and rng.random() < 0.3)
    if kind == "executor_kill" or (
            kind in _SPARK_KINDS and random.Random(f"{seed}:{index}:via").random() < SPARK_SHARE):
        spec.via = "spark"  # epochs go through rt.write(df) on the shared RayDP session
    if spec.fault_epoch == epochs:  # one more epoch, to see the runtime go on after it
        spec.epochs += 1
        spec.rows.append(rng.randint(1, 500))
        spec.pieces.append(rng.randint(1, 3))
    _fault_details(rng, spec)
    return spec


def _fault_details(rng: random.Random, spec: TrialSpec) -> None:
    kind = spec.fault
    if kind == "writer_point":
        spec.point, spec.victim, spec.how = rng.choice(WRITER_POINTS), "writer", "self"
    elif kind == "coordinator_point":
        spec.point, spec.victim, spec.how = rng.choice(COORDINATOR_POINTS), "coordinator", "self"
        if spec.point == "coordinator.mid_commit":
            spec.two_sinks = True  # the point lies between two sinks' commits
    elif kind == "point_external":
        spec.point = rng.choice(POINTS)
        spec.victim = rng.choice(["writer", "coordinator"])
        spec.how = rng.choice(["sigkill", "ray.kill"])
        spec.writer = rng.randrange(2)
        if spec.point == "coordinator.mid_commit":
            spec.two_sinks = True
    elif kind == "random_kill":
        spec.victim = rng.choice(["writer", "coordinator"])
        spec.how = rng.choice(["sigkill", "ray.kill"])
        spec.writer = rng.randrange(2)
        spec.delay = round(rng.uniform(0.0, 0.25), 3)
    elif kind == "executor_kill":
        spec.victim, spec.how, spec.writer = "executor", "sigkill", rng.randrange(2)
        spec.delay = round(rng.uniform(0.0, 1.5), 3)
    elif kind == "pg_restart":
        spec.point = rng.choice(["sink.mid_commit", "coordinator.after_pending", None])
        spec.delay = round(rng.uniform(0.0, 0.2), 3)
    elif kind in ("fs_readonly", "fs_full"):
        spec.variant = rng.choice(["before_epoch", "after_pending"])
    elif kind == "stall_commit":
        spec.extra = {"stall_seconds": round(spec.flush_interval * rng.uniform(2.0, 4.0), 2),
                      "stall_times": rng.randint(1, 3),
                      "commit_timeout": rng.choice([0.5, 30.0])}
    elif kind == "node_loss":
        spec.victim = rng.choice(["writer", "coordinator"])
        points = (["writer.during_write", "writer.after_pre_commit"]
                  if spec.victim == "writer" else
                  ["coordinator.after_open", "coordinator.after_pending", "sink.mid_commit"])
        spec.point = rng.choice([*points, None])
        spec.delay = round(rng.uniform(0.0, 0.5 if spec.point else 1.5), 3)
        spec.pg_metastore = True  # the coordinator may leave the driver's node
        spec.rows[spec.fault_epoch - 1] = max(300, spec.rows[spec.fault_epoch - 1])
        spec.pieces[spec.fault_epoch - 1] = 3  # every one of the three writers gets data
    elif kind == "driver_kill":
        spec.point = rng.choice([None, None, "writer.after_pre_commit",
                                 "coordinator.after_pending", "sink.mid_commit"])
        spec.delay = round(rng.uniform(0.0, 0.5), 3)
    if spec.point is not None and spec.point.startswith("writer.") and spec.victim != "writer":
        spec.writer = 0
