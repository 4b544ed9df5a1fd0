"""The contract between a sink and the runtime.

A sink has two halves (Beam's ``Sink``/``Writer``, Bytewax's partitioned sinks):

``Sink``
    Built on the driver, picklable, holds no live connection. It travels to the writer
    actors (``create_writer``) and to the coordinator actor (``commit``/``abort``).

``SinkWriter``
    Created by ``Sink.create_writer`` inside one ``SinkWriterActor``; owns connections and
    buffers.

Lifecycle, and where each call runs::

    driver       sink.bind(runtime, name)        name the sink inside one runtime
    driver       sink.validate()                 side-effect free: reachable, permitted,
                                                 schema compatible; creates nothing
    writer actor w = sink.create_writer(k)       once per actor (re)start
                 w.open()                        connect; idempotent; re-run after a restart
                 w.write(batch)*                 buffer or stage rows of the current epoch
                 w.flush()                       push buffers to durable staging (timer, barrier)
                 w.pre_commit(epoch, attempt)    -> Manifest: durable, staged, invisible
                 w.rollback(epoch, attempt)      drop what this attempt staged
                 w.close()                       at the draining close (``rt.close()``), once
    writer actor w.finish(epoch, attempt, commit)  holds_transactions sinks only: end what
                                                 the writer holds open, asked by commit/abort
    coordinator  sink.target_exists()            is the target there (markers vs deletions)
                 sink.committed_epoch()          highest epoch whose marker is in the target
                 sink.partly_committed()         an epoch above the marker partly visible
                                                 (writers that commit their own parts)
                 sink.commit(epoch, manifests)   make the epoch visible with its marker;
                                                 idempotent, safe to re-run after a crash;
                                                 -> CommitResult
                 sink.holds_decision(epoch, manifests)
                                                 whether the epoch the marker holds is this
                                                 decision (after a skip by the marker)
                 sink.abort(epoch, manifests)    remove staged data; ``None`` sweeps by epoch;
                                                 idempotent; never removes committed data
                 sink.recreate_marker(epoch)     a deleted marker, nothing pending
                 sink.close()                    when the coordinator closes

Errors: ``SchemaMismatchError`` from ``write`` or ``pre_commit`` is bad data: it poisons the
epoch, nothing of it is written, and it is not retried (the caller must change the data).
Any other error fails the attempt, which the runtime rolls back and feeds again (up to
``max_attempts``); ``SinkUnavailableError`` also marks the sink ``stalled`` until the
writer reaches its target again. An error from ``commit`` is retried, forever, with
backoff: the epoch is decided and only rolls forward.

``close`` is a courtesy, not a guarantee: a writer actor that crashes or is killed never
calls it, so nothing may depend on it but the release of resources.

Schema evolution. Every sink takes ``schema_evolution="fail"`` (the default: a batch
whose schema differs from the target's is a ``SchemaMismatchError``) or ``"add_columns"``
(``raysink._schema``: new columns are added as nullable, a lossless widening is applied
where ``evolution_rules()`` allow it, a narrower type is cast up; anything else is still a
``SchemaMismatchError`` naming the column). The change is part of the epoch: each writer
checks its batches against the target's schema and reports the schema it wrote (its
manifest's ``schema``: the union of its batches'; a file of another schema carries its
own), the coordinator decides the epoch only if the writers' schemas have a union that
evolves the schemas of the epochs decided before it (by the same rules), and ``commit``
applies the change in the same commit as the data. A writer never changes the target's
schema itself.

One decision per epoch. Two drivers of one runtime with meta stores of their own (so
neither's lease sees the other) can decide the same epoch with different data. ``commit``
lets exactly one decision of an epoch land: the target's marker is set atomically with
the data (Delta's app transaction, Iceberg's compare-and-swap, PostgreSQL's progress row
in the data's transaction), or, where making the data visible takes several steps (a
Parquet directory's renames, PostgreSQL's ``COMMIT PREPARED`` per writer), the decision
first claims the epoch in the target (``decision_id``) and only the claimant moves data.
A commit that finds another decision holding its epoch returns ``ALREADY`` and makes
nothing of its own visible; ``holds_decision`` then says whose data the epoch is, so the report of
the decision that did not land says so.

Staged data is named by ``(epoch, attempt, writer)`` so that an old attempt never mixes
with a new one. A manifest is small and JSON-serialisable (paths, row counts, schema); the
meta store keeps it as JSON, never pickle. A writer that received nothing in an attempt
is not asked to pre-commit: ``commit`` gets only the manifests of writers that did.
"""

from __future__ import annotations

import copy
import enum
import hashlib
import json
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypedDict, TypeVar

from raysink._schema import Rules, SchemaEvolution
from raysink.sinks._maintenance import (
    OFF,
    Maintenance,
    MaintenanceReport,
    MaintenanceWindow,
    TableStats,
)

if TYPE_CHECKING:
    import pyarrow as pa

__all__ = ["CommitResult", "Held", "Manifest", "Sink", "SinkWriter", "decision_id",
           "staged_name"]


class _ManifestRequired(TypedDict):
    writer: int
    rows: int


class Manifest(_ManifestRequired, total=False):
    """What one writer staged for one epoch attempt: small and JSON-serialisable (the meta
    store keeps it as JSON). ``writer`` and ``rows`` always; the rest as the sink needs.
    A sink's own keys live in its own ``TypedDict`` extending this one (``FilesManifest``
    of the file-based sinks, ``PostgresManifest``, ``KafkaManifest``)."""

    epoch: int
    attempt: int
    bytes: int
    schema: str | None  # the schema the writer wrote (raysink._schema.encode), if any
    format: int  # the manifest format (raysink.sinks._format): none is 1, raysink 0.1.0's


class CommitResult(enum.Enum):
    """What ``Sink.commit`` did."""

    COMMITTED = "committed"
    """The epoch is visible now, with its marker."""
    ALREADY = "already"
    """The epoch was in the target already (its marker said so, or another decision's
    claim of it): nothing of this call's manifests was made visible by it."""
    NO_TARGET = "no_target"
    """There is no target, and the epoch carried nothing to create one with (an empty
    epoch whose schema no writer saw): nothing was written, not even the marker."""

class Held(enum.Enum):
    """What a writer's ``finish`` did with the transaction it held for an epoch (sinks
    whose writers hold what they staged: ``Sink.holds_transactions``)."""

    COMMITTED = "committed"
    """Committed, now or earlier, by this process."""
    ABORTED = "aborted"
    """Aborted now."""
    GONE = "gone"
    """Not held by this process, and no other process can end it any more (this process
    took the transaction's identity over, which ended whatever an earlier holder left)."""
    UNKNOWN = "unknown"
    """Not held by this process, which cannot say who else might: the caller must fence
    the transaction's identity before it acts on the epoch."""


SinkT = TypeVar("SinkT", bound="Sink")


def decision_id(epoch: int, manifests: Sequence[Manifest]) -> str:
    """A digest naming one decision of ``epoch``: its manifests, as the meta store keeps
    them (the same after a JSON round trip, so a restarted coordinator names it alike).
    Staged names are unique per writer file, so two decisions never share one."""
    text = json.dumps({"epoch": epoch, "manifests": list(manifests)}, sort_keys=True,
                      separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def staged_name(epoch: int, attempt: int, writer_id: int, unique: str) -> str:
    """Deterministic, sortable name of a staged object: zero-padded epoch and attempt."""
    return f"e{epoch:012d}-a{attempt:04d}-w{writer_id:04d}-{unique}"


class SinkWriter(ABC):
    """The half of a sink that lives inside one writer actor.

    Calls arrive one at a time (the actor serialises them under its lock). ``write`` may be
    called many times per epoch; ``pre_commit`` ends the epoch for this writer and must
    leave the writer ready for the next epoch's ``write`` calls.
    """

    def open(self) -> None:  # noqa: B027 - optional hook
        """Connect. Idempotent; called again after every actor restart."""

    @abstractmethod
    def write(self, batch: pa.RecordBatch) -> None:
        """Buffer or stage ``batch`` for the current epoch. ``SchemaMismatchError``: bad
        data, the epoch is poisoned and not retried."""

    def flush(self) -> None:  # noqa: B027 - optional hook
        """Push buffered rows to durable staging."""

    @abstractmethod
    def pre_commit(self, epoch: int, attempt: int) -> Manifest:
        """Make everything written since the last pre-commit durable and staged, invisible to
        readers, and describe it in a small JSON-serialisable manifest."""

    @abstractmethod
    def rollback(self, epoch: int, attempt: int) -> None:
        """Drop what this writer staged or buffered for ``(epoch, attempt)``."""

    def wants_early_start(self) -> bool:
        """A sink with ``holds_transactions``: whether this writer would begin the current
        epoch's transaction now, before its pre-commit (it holds enough of the epoch that
        writing it while the rest arrives pays). Asked after each table applied; the
        writer actor then calls ``start_early`` once every earlier epoch is committed."""
        return False

    def start_early(self, epoch: int, attempt: int) -> None:  # noqa: B027 - optional hook
        """Begin ``(epoch, attempt)``'s transaction with what is buffered; later writes of
        the attempt go to the target as they come, ``pre_commit`` ends them as before and
        ``rollback`` aborts them. Never raises for the target: a writer that cannot begin
        early leaves the epoch to its pre-commit."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release files and connections. Called once by the draining close
        (``rt.close()``), never after; not called when the actor crashes or is killed."""

    def finish(self, epoch: int, attempt: int, *, commit: bool) -> Held:
        """Commit (``commit``) or abort what this writer holds open for ``(epoch,
        attempt)``; called by the sink's ``commit``/``abort`` in the coordinator, through
        the writer actor, only for sinks with ``holds_transactions``. Idempotent."""
        raise NotImplementedError(f"{type(self).__name__} holds no transactions")


class Sink(ABC):
    """The picklable, driver-side description of a target.

    Subclasses set ``kind`` (stable: it is part of the runtime's identity in the meta store)
    and implement the abstract methods. ``runtime`` and ``name`` are set by ``bind``.
    """

    kind: str = "abstract"
    runtime: str = ""
    name: str = ""
    schema_evolution: SchemaEvolution = "fail"
    holds_transactions: bool = False
    """The sink's writers keep what they staged open in their own processes (a Kafka
    transaction, which only the producer that opened it can end). The runtime then lets a
    writer pre-commit an epoch only once every earlier epoch is committed to this sink
    (so records of epochs never interleave in the target, a replayed one included), and
    serves ``SinkWriter.finish`` to the sink's ``commit``/``abort``."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A subclass's constructor answers an unknown or misspelt option with
        ``ConfigError`` naming the options it has (not Python's ``TypeError``)."""
        super().__init_subclass__(**kwargs)
        init = cls.__dict__.get("__init__")
        if init is not None:
            from raysink._options import checked_options

            cls.__init__ = checked_options(cls.__name__, init)  # type: ignore[method-assign]

    def bind(self: SinkT, runtime: str, name: str) -> SinkT:
        """A copy of this sink named ``name`` inside the runtime ``runtime``."""
        bound = copy.copy(self)
        bound.runtime = runtime
        bound.name = name
        return bound

    @property
    def key(self) -> Sequence[str] | None:
        """The upsert key, or ``None`` for append-only sinks."""
        return None

    @property
    def marker_id(self) -> str:
        """Identity of this sink's progress marker in its target."""
        return f"raysink:{self.runtime}:{self.name}"

    def describe(self) -> dict[str, Any]:
        """A JSON-safe, secret-free description for status and logs."""
        return {"kind": self.kind}

    def evolution_rules(self) -> Rules:
        """How this target stores types and which widenings it applies to a column it
        holds (``raysink._schema``); pure, called by writers, the coordinator and commit.
        By default: Arrow's types, and no widening."""
        return Rules(target=f"the {self.kind} target")

    @abstractmethod
    def validate(self) -> None:
        """Check the target without side effects: reachable, permitted, schema compatible.

        Raises ``SinkUnavailableError``, ``SchemaMismatchError`` or ``ConfigError``.
        """

    @abstractmethod
    def create_writer(self, writer_id: int) -> SinkWriter:
        """A new writer for one writer actor."""

    @abstractmethod
    def commit(self, epoch: int, manifests: Sequence[Manifest]) -> CommitResult:
        """Make ``epoch`` visible together with its marker. Idempotent: safe to run again
        after a crash at any point (``ALREADY`` when the marker says it is in).
        ``NO_TARGET``: the target does not exist and the epoch carried nothing to create
        it with; the coordinator records the epoch committed without a marker."""

    @abstractmethod
    def abort(self, epoch: int, manifests: Sequence[Manifest] | None) -> None:
        """Remove staged data of ``epoch``; with ``None``, sweep everything staged for it.
        Idempotent; never removes what a commit made visible."""

    @abstractmethod
    def committed_epoch(self) -> int | None:
        """The highest epoch whose marker is in the target, or ``None``."""

    def holds_decision(self, epoch: int, manifests: Sequence[Manifest]) -> bool | None:
        """Whether the data the target holds as ``epoch`` is the decision ``manifests``
        (``True``: a commit of it landed before, say before a crash) or another's
        (``False``); ``None``: the target cannot tell. Asked when the marker skipped a
        commit: only ``True`` makes the epoch's report count its rows as written."""
        return None

    def partly_committed(self) -> tuple[int, tuple[int, ...]] | None:
        """An epoch above the marker whose data is partly visible in the target already,
        and the writers whose parts are; ``None``: no such epoch. Only a sink whose
        writers make their parts visible before the marker is written (Kafka: each
        writer commits its own transaction) can have one, after a commit cut between the
        two; read when the coordinator starts, where alignment refuses to decide that
        epoch again unless the meta store has it pending (``raysink.coordinator.markers``).
        The default, for sinks whose data and marker land together: ``None``."""
        return None

    def target_exists(self) -> bool:
        """Whether the target is there. Checked before a missing marker is re-created: a
        target that is gone after commits is a loss (``DataLossError``), not a lost
        marker. An exception means "cannot tell" and is not taken as evidence of loss."""
        return True

    def heal_marker(self, expected: int) -> int | None:
        """The marker read again, after it read behind ``expected`` (the epoch the meta
        store says this sink committed). A target whose marker can be *held back* rather
        than lost ends what holds it where it can prove how (Kafka: a transaction left
        open on the progress partition), or raises ``TransactionHeldError`` naming it;
        the coordinator calls this before it takes the marker for lost. By default the
        marker is read as it is."""
        return self.committed_epoch()

    maintenance: Maintenance = OFF
    """How this sink keeps its table small over a long stream (``raysink.Maintenance``);
    set from the ``maintenance=`` option by sinks that implement ``maintain``."""

    def maintain(self, window: MaintenanceWindow) -> MaintenanceReport:
        """One maintenance pass (compaction, expiry, log cleanup), run by the coordinator
        in this sink's commit worker between two of its commits, so it never races one;
        it stops at a step boundary once ``window.deadline`` has passed. It never touches
        the marker of ``window.committed_epoch`` nor anything staged for an uncommitted
        epoch (``raysink.sinks._maintenance``). By default there is nothing to do."""
        return MaintenanceReport(sink=self.name)

    def table_stats(self) -> TableStats | None:
        """Files, bytes and snapshots of the target now; ``None``: not a table."""
        return None

    def recreate_marker(self, epoch: int) -> None:  # noqa: B027 - optional hook
        """Re-create a deleted progress marker at ``epoch`` (no epoch is pending)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release what the coordinator-side commits opened (connections, caches). Called
        when the coordinator closes; the sink may be used again after it."""

    def __repr__(self) -> str:
        desc = ", ".join(f"{k}={v!r}" for k, v in self.describe().items() if k != "kind")
        return f"{type(self).__name__}({desc})"
