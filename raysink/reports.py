"""What the runtime reports: one ``EpochReport`` per ``write*`` call, ``RuntimeStatus``
with a ``SinkStatus`` per sink (``rt.status()``, built by the coordinator; ``raysink
status`` builds the same from the meta store alone), and an ``ActorProcess`` per actor
(``rt.processes()``, each built by the actor itself; ``raysink status --processes``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from raysink.protocol.results import WriterStatus
    from raysink.sinks._maintenance import MaintenanceTotals, TableStats

__all__ = ["ActorProcess", "ActorRole", "EpochReport", "RuntimeStatus", "SinkState",
           "SinkStatus"]

SinkState = Literal["starting", "running", "stalled", "paused", "dropped", "failed"]
ActorRole = Literal["coordinator", "standby", "writer"]


@dataclass(frozen=True, kw_only=True, slots=True)
class EpochReport:
    """What one ``write*`` call did.

    ``committed``: the epoch is visible in every sink (or, ``False``, decided and rolling
    forward). ``skipped``: none of this call's rows were written, because every sink held
    the epoch already (a replay of an epoch committed before, or one another driver of
    the runtime committed with other data); ``skipped_sinks`` names the sinks that held
    it. ``rows``: the rows written (counted once, whatever the sinks), 0 when skipped; with
    some sinks skipped, the rows written to the others."""

    epoch: int
    rows: int
    committed: bool
    skipped: bool
    skipped_sinks: tuple[str, ...]
    attempts: int
    seconds: float


@dataclass(frozen=True, kw_only=True, slots=True)
class SinkStatus:
    """One sink: ``stalled`` while its commits fail or a writer cannot reach its target
    (``last_error`` says why), ``failed`` while a commit cannot complete because the data
    it needs is lost (``DataLossError``; tried again at ``retry_cap`` only, in case it is
    restored); ``history`` holds its recent state changes. ``held_by``: what holds its
    commits back when the target can name it, such as a Kafka transaction left open
    (``{"kind": "kafka_open_transaction", "topic", "partition", "producer_id",
    "first_offset", "age_seconds", ...}``). ``maintenance``: its maintenance passes so far
    (summed reports, failures, the last pass's time; ``None`` for a sink without
    maintenance); ``table``: its table's files, bytes and snapshots after the last pass."""

    state: SinkState
    last_committed_epoch: int | None
    last_error: str | None
    history: list[dict[str, Any]] = field(default_factory=list)
    held_by: dict[str, Any] | None = None
    maintenance: MaintenanceTotals | None = None
    table: TableStats | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class RuntimeStatus:
    """The runtime: its last epoch every sink committed, the epochs decided but not yet
    visible everywhere, the epoch being written (``open_epoch``), and a fatal error that
    stopped the coordinator (``error``), if any."""

    name: str
    metastore: str
    last_committed_epoch: int | None
    pending_epochs: list[int]
    sinks: dict[str, SinkStatus]
    open_epoch: int | None = None
    error: str | None = None

    def committed_before(self, sink: str, epoch: int) -> bool:
        """Whether no decided epoch before ``epoch`` is missing from ``sink`` (a sink
        commits its epochs in order: one committed through ``p`` holds every ``p``
        before it)."""
        done = self.sinks[sink].last_committed_epoch
        return not any(p < epoch and (done is None or done < p) for p in self.pending_epochs)


@dataclass(frozen=True, kw_only=True, slots=True)
class ActorProcess:
    """One actor of the runtime and the process it runs in.

    ``role``: ``coordinator``; ``standby``, a coordinator started ahead of need on another
    node (when node labels pin the coordinator) that takes over when the coordinator is
    lost; or ``writer``, writer ``writer`` of sink ``sink``. ``name``: the actor's name in
    Ray's namespace ``raysink``. ``node_id``, ``node_ip`` and ``pid``: the Ray node and the
    process on it; all ``None`` when the actor did not answer in time (Ray is restarting
    it, or its node is lost). ``mailbox``: a writer's state (the epochs it holds, the
    messages and bytes waiting in its mailbox, those refused, a sink call running long)."""

    role: ActorRole
    name: str
    sink: str | None = None
    writer: int | None = None
    node_id: str | None = None
    node_ip: str | None = None
    pid: int | None = None
    mailbox: WriterStatus | None = None

    @property
    def answered(self) -> bool:
        return self.pid is not None

    @classmethod
    def here(cls, role: ActorRole, *, sink: str | None = None, writer: int | None = None,
             mailbox: WriterStatus | None = None) -> ActorProcess:
        """The process this is called in (an actor's own ``process()``)."""
        import os

        import ray

        context = ray.get_runtime_context()
        ip: str = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
        return cls(role=role, name=context.get_actor_name() or "", sink=sink, writer=writer,
                   node_id=context.get_node_id(), node_ip=ip, pid=os.getpid(),
                   mailbox=mailbox)
