"""Seeded trial plans: ``random.Random(seed)`` decides everything about every trial.

Every trial feeds its data through one *way in* (``TrialSpec.via``):

=================  ==========================================================================
way in             how the trial's data reaches the runtime
=================  ==========================================================================
``arrow``          ``rt.write_arrow(tables, epoch=N)`` from the driver
``spark``          ``rt.write(df, epoch=N)``: a Spark DataFrame on one shared RayDP session
``foreach_batch``  ``rt.foreach_batch(df, batch_id)`` in a thread that carries a streaming
                   query's id, as a ``foreachBatch`` callback does (epoch = batch_id + 1)
``feeds``          ``rt.open_epoch(N)``: Ray tasks and a long-lived producer actor feed it,
                   ``ep.commit()``
``datasink``       ``ds.write_datasink(rt.datasink(epoch=N))`` of a Ray Dataset
``stream``         ``rt.stream()``: long-lived producer actors with a replayable source,
                   following the producer's contract; the runtime cuts the epochs
=================  ==========================================================================

The mix repeats in blocks of 20 trials (27 from the second block on, with one
``node_loss``, two ``broker_restart``, one ``broker_pause``, one ``hanging_txn``, one
``leader_kill`` and one ``maintenance_point``), shuffled per block; each block holds every
fault kind, producer kills on each producer way in, and writer and coordinator kills
during streams and Ray Data writes:

=====================  ====  ============================================================
kind                   /20   what happens (the ways in it is drawn with)
=====================  ====  ============================================================
``writer_point``         3   a writer SIGKILLs itself at a writer protocol point (stream,
                             datasink, one of arrow/spark/foreach_batch/feeds)
``coordinator_point``    3   the coordinator SIGKILLs itself at a coordinator/sink point
                             (stream, datasink, one of arrow/spark/foreach_batch/feeds)
``point_external``       2   a point stalls; the harness SIGKILLs or ``ray.kill``s a writer
                             or the coordinator meanwhile (the two of arrow, spark,
                             foreach_batch, feeds the points above left out)
``random_kill``          1   SIGKILL or ``ray.kill`` of a writer or the coordinator at a
                             random time (any way in)
``producer_kill``        3   a producer is SIGKILLed mid-epoch: a feed task's worker or the
                             feed producer actor (feeds), a write task's worker (datasink),
                             a stream producer actor (stream)
``driver_kill``          2   a subprocess driver is SIGKILLed mid-epoch; the runtime is
                             reopened here with the same name and meta store (arrow; one
                             of feeds, datasink, stream)
``executor_kill``        1   a RayDP executor process is SIGKILLed during a Spark epoch
                             (spark or foreach_batch; Spark is restarted after the trial)
``pg_restart``           2   PostgreSQL crash-restarts while a commit is in progress
``fs_readonly``          1   the Parquet/Delta tmpfs is remounted read-only
``fs_full``              1   the Parquet/Delta tmpfs is filled up
``stall_commit``         1   the sink's commits stall longer than the flush interval
``node_loss``           (1)  on a four-node cluster of its own (a child process), the node
                             of a writer or of the coordinator is removed without grace
                             mid-epoch (at a protocol point or after a delay); one per
                             block from the second block on (arrow; ``make chaos`` runs
                             them, the default sample never starts a cluster)
``broker_pause``        (1)  the Kafka broker's JVM is stopped (SIGSTOP) for 2-12 s mid-epoch
                             or mid-commit, then resumed (a Kafka target, any way in)
``hanging_txn``         (1)  a hanging transaction (one no coordinator will end) is left on
                             the progress partition holding this sink's epoch record of a
                             committed epoch, then the coordinator SIGKILLs itself with the
                             next epoch decided (t0021 of seed 29; Kafka, any way in)
``broker_restart``      (2)  the Kafka broker's JVM is SIGKILLed and started again on the
                             same port and directory: once mid-epoch (after a delay, or
                             while a writer is held writing), once mid-commit (the epoch
                             held decided at ``kafka.before_finish``,
                             ``coordinator.after_pending`` or ``sink.mid_commit``); two
                             per block from the second block on (a Kafka target, any way
                             in; the default sample never starts a broker)
``leader_kill``         (1)  on a three-broker cluster (replication factor 3,
                             ``min.insync.replicas=2``; one per chaos session, started at
                             its first such trial), the leader of the progress partition
                             or of a data partition (drawn) is SIGKILLed mid-epoch or
                             mid-commit (as ``broker_restart``), and started again after
                             0-3 s (a Kafka target, any way in)
``maintenance_point``   (1)  the sink keeps its table small by an aggressive
                             ``raysink.Maintenance`` policy, and the coordinator is killed
                             (``how="self"``) or its pass fails (``how="raise"``) at a
                             maintenance crash point: ``maintenance.mid_compaction``,
                             ``mid_expiry`` or ``mid_cleanup`` (taken in turn with the
                             sink, Delta or partitioned Iceberg: every point on both in
                             six such trials), in a pass forced by ``rt.maintain()`` from
                             a thread while the fault epoch is written (``forced``) or in
                             the pass the coordinator starts by itself after a commit
                             (``auto``); see ``tests.chaos.maintenance`` (any way in)
=====================  ====  ============================================================

Targets: a trial's ``main`` sink is Parquet, Delta, Iceberg or PostgreSQL (a kind's own
faults choose among those they apply to), taken in turn per fault kind; from the second
block on also Kafka (a topic of the session's broker, read back by a ``read_committed``
consumer), for every kind but ``stall_commit`` and ``node_loss``.

The default sample of the test run (``sample``) is the first block's trials minus the
costly ones: the ones that need a RayDP session (spark, foreach_batch, executor kills)
and driver kills (a second driver process). ``make chaos`` runs the plan's first
``TRIALS`` trials whole.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field
from typing import Any

from raysink._faults import MAINTENANCE_POINTS, POINTS

__all__ = ["BLOCK", "FAULT_KINDS", "LATER_BLOCKS", "WAYS_IN", "TrialSpec", "make_plan",
           "sample"]

WAYS_IN = ("arrow", "spark", "foreach_batch", "feeds", "datasink", "stream")
SPARK_WAYS = ("spark", "foreach_batch")
PRODUCER_WAYS = ("feeds", "datasink", "stream")
_ROTATING = ("arrow", "spark", "foreach_batch", "feeds")
"""The ways each block spreads over its other kill trials (four slots, one each)."""
_ANY = "any"
_ROTATE = "rotate"

BLOCK: tuple[tuple[str, str], ...] = (
    ("writer_point", "stream"), ("writer_point", "datasink"), ("writer_point", _ROTATE),
    ("coordinator_point", "stream"), ("coordinator_point", "datasink"),
    ("coordinator_point", _ROTATE),
    ("point_external", _ROTATE), ("point_external", _ROTATE),
    ("random_kill", _ANY),
    ("producer_kill", "feeds"), ("producer_kill", "datasink"), ("producer_kill", "stream"),
    ("driver_kill", "arrow"), ("driver_kill", "producers"),
    ("executor_kill", "spark-ways"),
    ("pg_restart", _ANY), ("pg_restart", _ANY),
    ("fs_readonly", _ANY), ("fs_full", _ANY), ("stall_commit", _ANY),
)
"""One block of the mix: (fault kind, way in or how it is drawn)."""
LATER_BLOCKS: tuple[tuple[str, str], ...] = (
    ("node_loss", "arrow"), ("broker_restart", _ANY), ("broker_restart", _ANY),
    ("broker_pause", _ANY), ("hanging_txn", _ANY), ("leader_kill", _ANY),
    ("maintenance_point", _ANY),
)
"""Added to every block from the second on (the default sample starts no cluster and no
Kafka broker); the ``broker_restart`` trials alternate mid-epoch and mid-commit. A kind
added here goes last: each addition draws its place in the block after the earlier ones,
so the trials before it stay where they were (seed 29's t0021 is still its
``broker_restart``)."""
FAULT_KINDS = (*dict.fromkeys(kind for kind, _ in BLOCK),
               *dict.fromkeys(kind for kind, _ in LATER_BLOCKS))
_DRAWN = {"producers": ("feeds", "datasink", "stream"), "spark-ways": SPARK_WAYS,
          _ANY: WAYS_IN}
_WEIGHTS = {"arrow": 3.0, "spark": 0.5, "foreach_batch": 0.5, "feeds": 1.5,
            "datasink": 1.5, "stream": 2.0}
"""How often a freely drawn way in comes up (Spark ways are slow to run)."""
_SAMPLE_LEAVES_OUT = ("driver_kill", "executor_kill")

WRITER_POINTS = tuple(p for p in POINTS if p.startswith("writer."))
COORDINATOR_POINTS = tuple(p for p in POINTS if not p.startswith("writer."))
_SINKS_FOR = {
    "pg_restart": ("postgres",),
    "fs_readonly": ("parquet", "delta"),
    "fs_full": ("parquet", "delta"),
    "broker_restart": ("kafka",),
    "broker_pause": ("kafka",),
    "hanging_txn": ("kafka",),
    "leader_kill": ("kafka",),
    "maintenance_point": ("delta", "iceberg"),
}
_ALL_SINKS = ("parquet", "delta", "iceberg", "postgres")
_LATER_SINKS = (*_ALL_SINKS, "kafka")
_NO_KAFKA = ("stall_commit", "node_loss")
"""Kinds that never write to Kafka: the stall wraps the sink in ``FailingSink``; the
node-loss child cluster is a test of the runtime's placement, not of a target."""
BROKER_MID_EPOCH = (None, "writer.during_write")
BROKER_MID_COMMIT = ("kafka.before_finish", "coordinator.after_pending", "sink.mid_commit")


@dataclass(kw_only=True)
class TrialSpec:
    """One trial, fully decided by the seed. For a stream, ``epochs`` bounds the epochs a
    fault may be armed at, and the data is ``extra["stream"]``'s (``rows`` unused)."""

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

    @property
    def costly(self) -> bool:
        """Needs a RayDP session or a second driver process (left out of the sample)."""
        return self.via in SPARK_WAYS or self.fault in _SAMPLE_LEAVES_OUT


def make_plan(seed: int, trials: int) -> list[TrialSpec]:
    """The first ``trials`` trials of the plan of ``seed`` (a prefix of any longer plan:
    trial ``i`` is the same whatever ``trials`` is)."""
    items = _items(seed, trials)
    turns = random.Random(f"{seed}:sinks")
    sink_turns = {k: turns.randrange(4) for k in FAULT_KINDS}
    specs: list[TrialSpec] = []
    restarts = maintained = 0
    for index, (kind, via) in enumerate(items[:trials]):
        later = index >= len(BLOCK) and kind not in _NO_KAFKA
        options = _SINKS_FOR.get(kind, _LATER_SINKS if later else _ALL_SINKS)
        sink = options[sink_turns[kind] % len(options)]
        sink_turns[kind] += 1
        variant = point = None
        if kind == "broker_restart":
            variant = "mid_commit" if restarts % 2 else "mid_epoch"
            restarts += 1
        elif kind == "maintenance_point":
            # the sink alternates; the point moves on every second trial: each point on
            # each sink in every six of them, whatever the seed
            point = MAINTENANCE_POINTS[(maintained // 2) % len(MAINTENANCE_POINTS)]
            maintained += 1
        specs.append(_trial(random.Random(f"{seed}:{index}"), seed, index, kind, sink, via,
                            variant=variant, point=point))
    return specs


def sample(seed: int) -> list[TrialSpec]:
    """The default test run's trials: the first block's, the costly ones left out."""
    return [spec for spec in make_plan(seed, len(BLOCK)) if not spec.costly]


def _items(seed: int, trials: int) -> list[tuple[str, str]]:
    """(kind, way in) of the first ``trials`` trials, block by block."""
    shuffler = random.Random(f"{seed}:kinds")
    items: list[tuple[str, str]] = []
    while len(items) < trials:
        block = _block(shuffler)
        if items:  # every block but the first (the default sample: one node, no broker)
            for kind, how in LATER_BLOCKS:
                block.insert(shuffler.randrange(len(block) + 1),
                             (kind, _draw(shuffler, how)))
        items.extend(block)
    return items


def _draw(rng: random.Random, how: str) -> str:
    """The way in ``how`` names, or one drawn from the ways it stands for."""
    if how not in _DRAWN:
        return how
    options = _DRAWN[how]
    return rng.choices(options, weights=[_WEIGHTS[w] for w in options])[0]


def _block(rng: random.Random) -> list[tuple[str, str]]:
    """One block, shuffled, each item's way in decided."""
    rotating = list(_ROTATING)
    rng.shuffle(rotating)
    ways = iter(rotating)
    block: list[tuple[str, str]] = []
    for kind, how in BLOCK:
        block.append((kind, next(ways) if how == _ROTATE else _draw(rng, how)))
    rng.shuffle(block)
    return block


def _trial(rng: random.Random, seed: int, index: int, kind: str, sink: str,
           via: str, *, variant: str | None = None, point: str | None = None) -> TrialSpec:
    epochs = rng.randint(3, 4)
    spec = TrialSpec(
        index=index, seed=seed,
        name=f"chaos-s{seed}-t{index:04d}-{kind.replace('_', '')}-{via.replace('_', '')}",
        sink=sink, fault=kind, epochs=epochs,
        rows=[rng.choice([0, 1, 50]) if rng.random() < 0.1 else rng.randint(20, 3000)
              for _ in range(epochs)],
        pieces=[rng.randint(1, 3) for _ in range(epochs)],
        fault_epoch=rng.randint(1, epochs), flush_interval=rng.choice([0.2, 0.5, 1.0]),
        two_sinks=rng.random() < 0.2, pg_metastore=sink == "postgres" and rng.random() < 0.3,
        via=via, variant=variant, point=point)
    if kind == "maintenance_point":  # a committed epoch before the fault: files to compact
        spec.fault_epoch = max(2, spec.fault_epoch)
    if spec.fault_epoch == epochs:  # one more epoch, to see the runtime go on after it
        spec.epochs += 1
        spec.rows.append(rng.randint(1, 500))
        spec.pieces.append(rng.randint(1, 3))
    _fault_details(rng, spec)
    _way_details(rng, spec)
    if via == "datasink":
        # an empty Ray Dataset carries nothing to any writer, so its epoch is recorded
        # committed without a commit: no point of a commit would be reached
        spec.rows[spec.fault_epoch - 1] = max(1, spec.rows[spec.fault_epoch - 1])
    return spec


def _way_details(rng: random.Random, spec: TrialSpec) -> None:
    """What the way in needs: producers' retries, the stream's producers and source."""
    if spec.via == "feeds":
        spec.extra["task_retries"] = rng.choice([0, 2])
    elif spec.via == "stream":
        spec.extra["stream"] = {
            "producers": rng.randint(2, 3), "batches": rng.randint(20, 40),
            "batch_rows": rng.randint(10, 150), "pause": round(rng.uniform(0.04, 0.1), 3),
            "interval": rng.choice([0.3, 0.5]), "poll": rng.choice([0.1, 0.2])}


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
    elif kind == "producer_kill":
        _producer_kill(rng, spec)
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
        _node_loss(rng, spec)
    elif kind == "broker_restart":
        _broker_restart(rng, spec)
    elif kind == "broker_pause":
        _broker_pause(rng, spec)
    elif kind == "hanging_txn":
        _hanging_txn(rng, spec)
    elif kind == "leader_kill":
        _leader_kill(rng, spec)
    elif kind == "maintenance_point":
        _maintenance_point(rng, spec)
    elif kind == "driver_kill":
        spec.point = rng.choice([None, None, "writer.after_pre_commit",
                                 "coordinator.after_pending", "sink.mid_commit"])
        spec.delay = round(rng.uniform(0.0, 0.5), 3)
    if spec.point is not None and spec.point.startswith("writer.") and spec.victim != "writer":
        spec.writer = 0
    if spec.via == "stream" and kind == "driver_kill":
        spec.point = None  # killed once the producers write: a stream's epochs are its own
    if spec.via == "stream" and (kind in ("random_kill", "driver_kill") or (
            kind in ("broker_restart", "leader_kill") and spec.point is None)):
        spec.delay = round(rng.uniform(0.3, 1.5), 3)  # into the stream, not into an epoch


def _producer_kill(rng: random.Random, spec: TrialSpec) -> None:
    """The victim: a feed task's worker or the feed producer actor, a Ray Data write
    task's worker, a stream producer; SIGKILLed ``delay`` seconds after it sent data."""
    spec.how = "sigkill"
    if spec.via == "feeds":
        spec.victim = rng.choice(["feed_task", "feed_actor"])
    elif spec.via == "datasink":
        spec.victim = "write_task"
    else:
        spec.victim, spec.writer = "stream_producer", rng.randrange(3)
        spec.delay = round(rng.uniform(0.3, 1.2), 3)
        return
    spec.delay = round(rng.uniform(0.0, 0.3), 3)
    spec.rows[spec.fault_epoch - 1] = max(60, spec.rows[spec.fault_epoch - 1])


def _broker_restart(rng: random.Random, spec: TrialSpec) -> None:
    """Mid-epoch: ``delay`` seconds into the fault epoch's write, or while writer
    ``writer`` is held writing it; mid-commit: while the decided epoch is held at a
    point of its commit."""
    points = BROKER_MID_COMMIT if spec.variant == "mid_commit" else BROKER_MID_EPOCH
    spec.point = rng.choice(points)
    spec.victim, spec.how = "broker", "sigkill"
    spec.writer = rng.randrange(2)
    spec.delay = round(rng.uniform(0.0, 0.3), 3)


def _broker_pause(rng: random.Random, spec: TrialSpec) -> None:
    """The broker's JVM stopped (SIGSTOP) for ``extra["pause"]`` seconds, then resumed:
    mid-epoch or while the decided epoch is held at a point of its commit."""
    spec.point = rng.choice([*BROKER_MID_EPOCH, *BROKER_MID_COMMIT])
    spec.victim, spec.how = "broker", "sigstop"
    spec.writer = rng.randrange(2)
    spec.delay = round(rng.uniform(0.0, 0.3), 3)
    spec.extra["pause"] = round(rng.uniform(2.0, 12.0), 1)


def _hanging_txn(rng: random.Random, spec: TrialSpec) -> None:
    """Chaos seed 29's t0021: a transaction no coordinator will end left open on the
    progress partition (this sink's epoch record of a committed epoch, as a broker fenced
    while writing its markers leaves it), then the coordinator SIGKILLed with the next
    epoch held decided (``coordinator.after_pending``) or mid-commit: the new one must
    not take the marker for lost."""
    spec.fault_epoch = max(2, spec.fault_epoch)  # after a committed epoch (3+ epochs)
    spec.point = rng.choice(["coordinator.after_pending", "sink.mid_commit"])
    spec.victim, spec.how = "coordinator", "self"
    if spec.via == "stream":
        spec.delay = round(rng.uniform(0.3, 1.5), 3)


def _leader_kill(rng: random.Random, spec: TrialSpec) -> None:
    """On the three-broker cluster: the leader of the progress partition or of data
    partition ``extra["partition"]`` (``victim``: ``progress`` or ``data``) SIGKILLed
    mid-epoch (``delay`` seconds in, or while a writer is held writing) or while the
    decided epoch is held at a point of its commit, and started again ``extra["down"]``
    seconds later. After a committed epoch, so that both topics exist."""
    spec.fault_epoch = max(2, spec.fault_epoch)
    spec.variant = rng.choice(["mid_epoch", "mid_commit"])
    points = BROKER_MID_COMMIT if spec.variant == "mid_commit" else BROKER_MID_EPOCH
    spec.point = rng.choice(points)
    spec.victim, spec.how = rng.choice(["progress", "data"]), "sigkill"
    spec.writer = rng.randrange(2)
    spec.delay = round(rng.uniform(0.0, 0.3), 3)
    spec.extra["partition"] = rng.randrange(3)
    spec.extra["down"] = round(rng.uniform(0.0, 3.0), 1)


def _maintenance_point(rng: random.Random, spec: TrialSpec) -> None:
    """The point (``spec.point``, set by turn) SIGKILLs the coordinator (``how="self"``,
    two in three) or raises (``raise``: the pass fails and is tried again); ``variant``
    says which pass reaches it: one forced by ``rt.maintain()`` while the fault epoch is
    written, or the coordinator's own pass after a commit (due after every epoch).
    ``extra["maintenance"]`` is the policy: compaction of any two small files, few
    snapshots kept and none for their age, checkpoints every version or two."""
    spec.victim = "coordinator"
    spec.how = rng.choice(["self", "self", "raise"])
    spec.variant = rng.choice(["forced", "auto"])
    keep = rng.randint(1, 2)
    if (spec.sink, spec.point) == ("iceberg", "maintenance.mid_cleanup"):
        # the point lies between an expiry's first and second file deletions; passes after
        # every epoch keeping two snapshots expire one manifest list each (the snapshot
        # before the last compaction, whose files the next one still holds): never two
        keep = 1
    spec.extra["maintenance"] = {
        "every_epochs": 1 if spec.variant == "auto" else 1000, "min_interval_s": 0.0,
        "min_compact_files": 2, "keep_snapshots": keep, "keep_seconds": 0.0,
        "checkpoint_every": rng.randint(1, 2)}
    for epoch in range(spec.fault_epoch - 1):  # rows before the fault: files to compact
        spec.rows[epoch] = max(20, spec.rows[epoch])


def _node_loss(rng: random.Random, spec: TrialSpec) -> None:
    spec.victim = rng.choice(["writer", "coordinator"])
    points = (["writer.during_write", "writer.after_pre_commit"]
              if spec.victim == "writer" else
              ["coordinator.after_open", "coordinator.after_pending", "sink.mid_commit"])
    spec.point = rng.choice([*points, None])
    spec.delay = round(rng.uniform(0.0, 0.5 if spec.point else 1.5), 3)
    spec.pg_metastore = True  # the coordinator may leave the driver's node
    spec.rows[spec.fault_epoch - 1] = max(300, spec.rows[spec.fault_epoch - 1])
    spec.pieces[spec.fault_epoch - 1] = 3  # every one of the three writers gets data
