"""The meta store: where epoch decisions live.

One meta store may hold many runtimes; every record is keyed by runtime name. Records per
``(runtime, sink, epoch)`` move through::

    OPEN(attempt, layout) ──> PENDING(manifests) ──> COMMITTED
        └──> ABORTED(attempt)      (then deleted once its staging is swept)
    (none) ──────────────────> PENDING(layout, manifests)    ``put_decided``: an epoch
                                                             whose open travelled with it

* OPEN: an attempt started; its writer layout is recorded. Never rolls forward.
* PENDING: every writer pre-committed; the decision to commit is durable. Written for all
  sinks of the runtime in one transaction. Always rolls forward.
* COMMITTED: the sink made the epoch visible. Older COMMITTED rows are pruned; the newest
  one per sink is kept as the high-water mark, and the newest marked one with it.
  ``marked`` says whether the commit left the sink's progress marker in the target: it did
  not when the epoch carried nothing to the sink (no writer of it staged anything, not
  even a schema), which the coordinator records committed without calling the sink, and
  when there was no target yet and nothing to create one with.
* ABORTED: the attempt will never commit; staging is swept, then the row is deleted.

Every write names the coordinator ``generation`` that makes it; a write from an older
generation than the runtime's current one raises ``FencedError`` and changes nothing.

One driver at a time: a runtime's **lease** names the driver that runs it (``holder``, an
id it made up, and ``owner``, what it says of itself: host, pid...) until ``expires_at``,
on the store's own clock (no two machines' clocks are compared). The driver takes it
before it starts any actor and renews it while the runtime is open; a driver that dies
stops renewing, and its successor takes the lease once it expired (or at once, when it
can tell the holder's process is gone). ``token`` grows with every new holder. A
coordinator claims a generation only for the driver that holds the lease (``claim(...,
holder=)``), so a driver whose lease another took cannot start one.
Manifests and layouts are stored as JSON text, never pickle; a row that does not decode
raises ``MetaStoreError``.

The store's schema carries a version (``_versions``): opening a store an older raysink
made migrates it forward in one locked transaction; one a newer raysink made is refused
with ``NewerVersionError``.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from raysink.errors import ConfigError

__all__ = [
    "HISTORY_LIMIT",
    "EpochRecord",
    "EpochState",
    "Lease",
    "ManifestJSON",
    "MetaStore",
    "RuntimeRecord",
    "SinkStatusRecord",
    "check_sink_set",
]

HISTORY_LIMIT = 20
"""Status history entries kept per sink."""

ManifestJSON = Mapping[str, Any]
"""A writer's manifest as the store keeps it: JSON text in, the same mapping out. The
store needs no more of it (what the keys mean is the sink's business)."""


class EpochState(str, enum.Enum):
    OPEN = "OPEN"
    PENDING = "PENDING"
    COMMITTED = "COMMITTED"
    ABORTED = "ABORTED"


@dataclass(frozen=True, kw_only=True, slots=True)
class RuntimeRecord:
    """A runtime's identity: its sink set (name -> kind), epoch source and generation."""

    name: str
    generation: int
    sinks: dict[str, str]
    dropped: tuple[str, ...] = ()
    epoch_source: dict[str, Any] | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class Lease:
    """Who runs a runtime (``holder``, ``owner``) until when, as read at ``now``: both on
    the store's clock, seconds since the Unix epoch. ``token``: one more for every new
    holder."""

    runtime: str
    holder: str
    owner: dict[str, Any]
    token: int
    expires_at: float
    now: float

    @property
    def live(self) -> bool:
        return self.expires_at > self.now

    def describe(self) -> str:
        """``pid 12 on host h (Ray 10.0.0.1:6379) until 21:04:05 UTC, 8.2 s from now``."""
        owner = self.owner
        who = f"pid {owner.get('pid', '?')} on host {owner.get('host', '?')}"
        if owner.get("ray"):
            who += f" (Ray {owner['ray']})"
        until = time.strftime("%H:%M:%S UTC", time.gmtime(self.expires_at))
        left = self.expires_at - self.now
        return (f"{who} until {until}, {left:.1f} s from now" if left > 0
                else f"{who}, expired {-left:.1f} s ago")


@dataclass(frozen=True, kw_only=True, slots=True)
class EpochRecord:
    """One sink's record of one epoch."""

    sink: str
    epoch: int
    attempt: int
    state: EpochState
    layout: dict[str, Any] = field(default_factory=dict)
    manifests: list[ManifestJSON] | None = None
    updated_at: float = 0.0
    marked: bool = True
    written_by: str | None = None
    """The raysink release that recorded the epoch (``None``: raysink 0.1.0)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SinkStatusRecord:
    """A sink's persisted status and a short history of ``(time, state, error)``."""

    sink: str
    state: str
    last_error: str | None = None
    history: list[dict[str, Any]] = field(default_factory=list)


@runtime_checkable
class MetaStore(Protocol):
    """Durable store of runtime identities, epoch records and sink status.

    Implementations: ``SqliteMetaStore`` (embedded default) and ``PostgresMetaStore``.
    Every mutating method takes the caller's ``generation`` and raises ``FencedError`` when
    a newer generation has claimed the runtime. Implementations are used from one thread
    at a time per instance.
    """

    @property
    def url(self) -> str:
        """The store's address with any password redacted."""
        ...

    def claim(
        self,
        runtime: str,
        sinks: Mapping[str, str],
        *,
        add: Collection[str] = (),
        drop: Collection[str] = (),
        holder: str | None = None,
    ) -> RuntimeRecord:
        """Create the runtime or start a new generation of it.

        ``sinks`` maps sink name to kind. A sink set that differs from the stored one raises
        ``ConfigError`` unless every new name is in ``add`` and every missing name in
        ``drop``. With ``holder``: ``RuntimeInUseError`` unless the runtime's lease is that
        holder's (expired or not: nobody else took it). Returns the record with the new
        generation, which fences all older ones.
        """
        ...

    def acquire_lease(self, runtime: str, holder: str, owner: Mapping[str, Any],
                      seconds: float, *, replace: str | None = None) -> Lease:
        """Take or renew the runtime's lease for ``holder``, until ``seconds`` from now,
        when it is free: never held, released, expired, ``holder``'s already, or held by
        ``replace`` (a holder the caller knows is gone). Returns the lease as it stands
        after the call: the caller holds it when ``lease.holder == holder``; else nothing
        changed and the lease is the other holder's."""
        ...

    def release_lease(self, runtime: str, holder: str) -> None:
        """Give the lease up at once (idempotent; nothing when another holds it)."""
        ...

    def lease(self, runtime: str) -> Lease | None:
        """The runtime's lease (live or not), or ``None`` when it was never taken."""
        ...

    def load(self, runtime: str) -> RuntimeRecord | None:
        """The runtime's record, or ``None`` when it was never claimed."""
        ...

    def bind_source(self, runtime: str, generation: int, source: Mapping[str, Any]) -> None:
        """Record the runtime's epoch source (replacing the previous one)."""
        ...

    def records(self, runtime: str) -> list[EpochRecord]:
        """Every epoch record of the runtime, ordered by ``(epoch, sink)``."""
        ...

    def put_open(
        self,
        runtime: str,
        generation: int,
        epoch: int,
        attempt: int,
        sinks: Sequence[str],
        layout: Mapping[str, Any],
    ) -> None:
        """Record ``(epoch, attempt)`` OPEN for every sink in one transaction."""
        ...

    def put_decided(
        self,
        runtime: str,
        generation: int,
        epoch: int,
        attempt: int,
        layout: Mapping[str, Any],
        manifests: Mapping[str, Sequence[ManifestJSON]],
    ) -> None:
        """Record ``(epoch, attempt)``, never recorded OPEN, straight PENDING for every sink
        in ``manifests``, in one transaction: the decision of an epoch whose open travelled
        with its data. Refused (``MetaStoreError``) where ``put_open`` would refuse."""
        ...

    def put_pending(
        self,
        runtime: str,
        generation: int,
        epoch: int,
        attempt: int,
        manifests: Mapping[str, Sequence[ManifestJSON]],
    ) -> None:
        """Record the epoch PENDING for every sink in ``manifests``, in one transaction.

        Raises ``MetaStoreError`` when the epoch's records are not OPEN at ``attempt``.
        """
        ...

    def put_committed(self, runtime: str, generation: int, epoch: int, sink: str, *,
                      marked: bool = True) -> None:
        """Record one sink's epoch COMMITTED and prune that sink's older COMMITTED rows.

        ``marked=False``: the commit left no marker in the target (the epoch carried
        nothing to it, or it had no target and nothing to create one with). The newest
        marked row is kept through the pruning: the target must still hold its marker."""
        ...

    def put_aborted(self, runtime: str, generation: int, epoch: int, attempt: int) -> None:
        """Record every sink's OPEN ``(epoch, attempt)`` ABORTED; PENDING rows are refused
        with ``MetaStoreError`` (a pending epoch only rolls forward)."""
        ...

    def delete_aborted(self, runtime: str, generation: int, epoch: int) -> None:
        """Delete the epoch's ABORTED rows once its staging is swept."""
        ...

    def set_sink_status(
        self,
        runtime: str,
        generation: int,
        sink: str,
        state: str,
        error: str | None = None,
    ) -> None:
        """Set a sink's status; a change of state appends to its bounded history."""
        ...

    def sink_statuses(self, runtime: str) -> dict[str, SinkStatusRecord]:
        """Every sink's persisted status."""
        ...

    def close(self) -> None:
        """Release connections."""
        ...


def check_sink_set(runtime: str, old: Mapping[str, str], new: Mapping[str, str],
                   add: Collection[str], drop: Collection[str]) -> None:
    """``ConfigError`` unless ``new`` differs from ``old`` only by names in add/drop."""
    changed = sorted(n for n in set(old) & set(new) if old[n] != new[n])
    if changed:
        kinds = {n: f"{old[n]} -> {new[n]}" for n in changed}
        raise ConfigError(f"sinks changed kind ({kinds}); give a sink of another kind a "
                          "new name", runtime=runtime)
    added = sorted(set(new) - set(old) - set(add))
    missing = sorted(set(old) - set(new) - set(drop))
    if added or missing:
        raise ConfigError(f"the sink set changed (new {added}, missing {missing}); pass the "
                          "names in add=/drop= to change it on purpose", runtime=runtime)
