"""The one exception tree of raysink.

::

    RaySinkError
    ├── ConfigError (ValueError)      an option, sink set, routing key or epoch source is wrong
    │   ├── VnodeOverlapError         two writers claim the same vnodes
    │   └── DependencyVersionError    a dependency's release outside raysink's range
    ├── SchemaMismatchError           bad data: nothing of the epoch is written
    ├── EpochRegressionError          an epoch below one still in flight
    ├── StaleAttemptError             a request for an attempt that is no longer open
    ├── StreamUnknownError            a coordinator that does not know the stream (internal)
    ├── BarrierOrderError (ValueError) an input broke the barrier protocol
    ├── BackpressureError             too many outstanding epochs, or a full mailbox
    ├── EpochFailedError              a write poisoned the epoch, or all attempts are used
    ├── StreamRewind                  a stream epoch failed: replay from after ``committed``
    ├── SinkUnavailableError          target unreachable, refused, or holding something else
    │   └── TransactionHeldError      a transaction left open hides the sink's progress
    ├── DataLossError                 a committed target or a pending marker disappeared
    ├── MetaStoreError                meta store unwritable or corrupt; a manifest escaping its sink
    │   └── NewerVersionError         a store, manifest or marker written by a newer raysink
    ├── RuntimeInUseError             a runtime with this name is open in another driver
    ├── RuntimeUnavailableError       the runtime's actors could not be reached in time
    ├── RescaleRefusedError           a rescale while an epoch is in flight or actors recover
    ├── MaintenanceError              ``rt.maintain()`` failed or did not end in time
    └── FencedError                   a newer coordinator generation wrote first

Every error names the runtime, sink and epoch where they apply (``runtime``, ``sink``,
``epoch`` attributes) and says in its message what to change. Every failure a public
method of ``SinkRuntime`` raises is one of these; a Ray error behind it is its
``__cause__``. Errors cross Ray actor
boundaries by pickling, so each keeps its fields in ``args``-independent ``__reduce__``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = [
    "BackpressureError",
    "BarrierOrderError",
    "ConfigError",
    "DataLossError",
    "DependencyVersionError",
    "EpochFailedError",
    "EpochRegressionError",
    "FencedError",
    "MaintenanceError",
    "MetaStoreError",
    "NewerVersionError",
    "RaySinkError",
    "RescaleRefusedError",
    "RuntimeInUseError",
    "RuntimeUnavailableError",
    "SchemaMismatchError",
    "SinkUnavailableError",
    "StaleAttemptError",
    "StreamRewind",
    "StreamUnknownError",
    "TransactionHeldError",
    "VnodeOverlapError",
]


class RaySinkError(Exception):
    """Base of every raysink error.

    ``message`` says what happened and what to change; ``runtime``, ``sink`` and ``epoch``
    locate it when they apply.
    """

    def __init__(
        self,
        message: str,
        *,
        runtime: str | None = None,
        sink: str | None = None,
        epoch: int | None = None,
    ) -> None:
        self.message = message
        self.runtime = runtime
        self.sink = sink
        self.epoch = epoch
        super().__init__(self._render())

    def _render(self) -> str:
        where = [
            f"{label} {value!r}" if isinstance(value, str) else f"{label} {value}"
            for label, value in (("runtime", self.runtime), ("sink", self.sink),
                                 ("epoch", self.epoch))
            if value is not None
        ]
        return f"{self.message} [{', '.join(where)}]" if where else self.message

    def _fields(self) -> dict[str, Any]:
        return {"runtime": self.runtime, "sink": self.sink, "epoch": self.epoch}

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), self.message, self._fields()))


def _rebuild(cls: type[RaySinkError], message: str, fields: dict[str, Any]) -> RaySinkError:
    return cls(message, **fields)


class ConfigError(RaySinkError, ValueError):
    """An invalid option, unknown sink option, changed sink set, routing key outside the
    upsert key, a new epoch source without ``epoch_offset``, no Spark session, or Java
    missing or older than 17."""


class SchemaMismatchError(RaySinkError):
    """A batch whose schema differs from the epoch's or the target's, a column type the sink
    cannot store, null key values, or a batch over the size limit. Nothing of the epoch is
    written. ``column`` names the column at fault, where one is."""

    def __init__(
        self,
        message: str,
        *,
        column: str | None = None,
        runtime: str | None = None,
        sink: str | None = None,
        epoch: int | None = None,
    ) -> None:
        self.column = column
        super().__init__(message, runtime=runtime, sink=sink, epoch=epoch)

    def _fields(self) -> dict[str, Any]:
        return {**super()._fields(), "column": self.column}


class EpochRegressionError(RaySinkError):
    """The requested epoch is new but below an epoch still open or pending."""


class _RetryLater(RaySinkError):
    """An error that says when to try again: after ``retry_after`` seconds."""

    def __init__(
        self,
        message: str,
        *,
        retry_after: float = 1.0,
        runtime: str | None = None,
        sink: str | None = None,
        epoch: int | None = None,
    ) -> None:
        self.retry_after = retry_after
        super().__init__(message, runtime=runtime, sink=sink, epoch=epoch)

    def _fields(self) -> dict[str, Any]:
        return {**super()._fields(), "retry_after": self.retry_after}


class BackpressureError(_RetryLater):
    """Too many outstanding epochs, or a writer's mailbox is full; retry after
    ``retry_after`` seconds."""


class EpochFailedError(RaySinkError):
    """A write failed and poisoned the epoch, or every attempt was used."""

    def __init__(
        self,
        message: str,
        *,
        attempts: int = 0,
        runtime: str | None = None,
        sink: str | None = None,
        epoch: int | None = None,
    ) -> None:
        self.attempts = attempts
        super().__init__(message, runtime=runtime, sink=sink, epoch=epoch)

    def _fields(self) -> dict[str, Any]:
        return {**super()._fields(), "attempts": self.attempts}


class StreamRewind(RaySinkError):
    """A stream epoch failed and nothing after ``committed`` is kept: replay your source
    from the offsets after epoch ``committed`` (``None``: from the start), then write on;
    the next write goes into ``epoch``. Raised by a stream feed's ``write``."""

    def __init__(self, message: str, *, committed: int | None, epoch: int,
                 runtime: str | None = None) -> None:
        self.committed = committed
        super().__init__(message, runtime=runtime, epoch=epoch)

    def _fields(self) -> dict[str, Any]:
        return {**super()._fields(), "committed": self.committed}


class StreamUnknownError(RaySinkError):
    """The coordinator does not know the runtime's continuous stream: it was replaced, or
    restarted by Ray, since the stream began. The driver hands the stream over to it (its
    producers rewind to the last decided epoch); it never reaches the user."""


class SinkUnavailableError(RaySinkError):
    """The target is unreachable, refuses authentication or permission, or its path holds
    something else; or a Spark partition fetch timed out."""


class TransactionHeldError(SinkUnavailableError):
    """A transaction left open on the target (a Kafka *hanging transaction*: its marker
    never written) holds back what the sink committed after it, so its progress cannot be
    read. ``held`` describes it (topic, partition, producer id, first offset, age);
    the message says what ends it. Nothing is lost: the sink goes on once it ends."""

    def __init__(
        self,
        message: str,
        *,
        held: Mapping[str, Any] | None = None,
        runtime: str | None = None,
        sink: str | None = None,
        epoch: int | None = None,
    ) -> None:
        self.held = dict(held) if held is not None else None
        super().__init__(message, runtime=runtime, sink=sink, epoch=epoch)

    def _fields(self) -> dict[str, Any]:
        return {**super()._fields(), "held": self.held}


class DataLossError(RaySinkError):
    """A target deleted after raysink committed to it, or a progress marker gone while an
    epoch is pending."""


class MetaStoreError(RaySinkError):
    """The meta store is unwritable or corrupt, or a manifest names a path outside its
    sink's directory (refused, never followed)."""


class NewerVersionError(MetaStoreError):
    """The meta store's schema, a decided epoch's manifest or a target's progress marker
    was written by a newer raysink than this one: ``what`` it is, the ``found`` version and
    the newest this raysink reads (``supported``). Nothing was changed; the message says to
    run the newer raysink (or one at least as new) on every driver of the runtime."""

    def __init__(
        self,
        message: str,
        *,
        what: str | None = None,
        found: int | None = None,
        supported: int | None = None,
        runtime: str | None = None,
        sink: str | None = None,
        epoch: int | None = None,
    ) -> None:
        self.what = what
        self.found = found
        self.supported = supported
        super().__init__(message, runtime=runtime, sink=sink, epoch=epoch)

    def _fields(self) -> dict[str, Any]:
        return {**super()._fields(), "what": self.what, "found": self.found,
                "supported": self.supported}


class RuntimeInUseError(RaySinkError):
    """A runtime with this name is open in another driver: its lease in the meta store is
    held by ``holder`` (what that driver said of itself: host, pid, Ray address) until
    ``until`` (seconds since the Unix epoch, the meta store's clock), or its actors are live
    in the connected Ray cluster."""

    def __init__(
        self,
        message: str,
        *,
        holder: Mapping[str, Any] | None = None,
        until: float | None = None,
        runtime: str | None = None,
        sink: str | None = None,
        epoch: int | None = None,
    ) -> None:
        self.holder = dict(holder) if holder is not None else None
        self.until = until
        super().__init__(message, runtime=runtime, sink=sink, epoch=epoch)

    def _fields(self) -> dict[str, Any]:
        return {**super()._fields(), "holder": self.holder, "until": self.until}


class RuntimeUnavailableError(RaySinkError):
    """The runtime's coordinator or writers could not be reached in time: restarting for
    longer than ``commit_timeout``, or gone with their node. The Ray error is the cause."""


class RescaleRefusedError(_RetryLater):
    """``rt.rescale()`` was refused and changed nothing: an epoch is in flight (or still
    open at the coordinator after a failure), or an actor is being replaced. Retry after
    ``retry_after`` seconds, between epochs."""


class MaintenanceError(RaySinkError):
    """A maintenance pass ``rt.maintain()`` asked for failed (its cause is the sink's
    error), or did not end within its timeout. Commits go on either way; the coordinator
    tries the pass again by itself."""


class FencedError(RaySinkError):
    """A newer coordinator generation wrote to the meta store first; this one must stop."""


class VnodeOverlapError(ConfigError):
    """Two writers claim the same vnodes; ``vnodes`` lists them, ``writer_id`` is the writer
    whose claim was refused."""

    def __init__(
        self,
        message: str,
        *,
        vnodes: tuple[int, ...] = (),
        writer_id: int | None = None,
        runtime: str | None = None,
        sink: str | None = None,
        epoch: int | None = None,
    ) -> None:
        self.vnodes = vnodes
        self.writer_id = writer_id
        super().__init__(message, runtime=runtime, sink=sink, epoch=epoch)

    def _fields(self) -> dict[str, Any]:
        return {**super()._fields(), "vnodes": self.vnodes, "writer_id": self.writer_id}


class DependencyVersionError(ConfigError):
    """An installed dependency's release lies outside the range this raysink works with
    (``raysink.protocol.requirements``). ``package`` names it, ``found`` is the installed
    version, ``wanted`` the range (``>=2.41,<3``)."""

    def __init__(
        self,
        message: str,
        *,
        package: str = "",
        found: str = "",
        wanted: str = "",
        runtime: str | None = None,
        sink: str | None = None,
        epoch: int | None = None,
    ) -> None:
        self.package = package
        self.found = found
        self.wanted = wanted
        super().__init__(message, runtime=runtime, sink=sink, epoch=epoch)

    def _fields(self) -> dict[str, Any]:
        return {**super()._fields(), "package": self.package, "found": self.found,
                "wanted": self.wanted}


class BarrierOrderError(RaySinkError, ValueError):
    """An input broke the barrier protocol: a repeated or regressing barrier, a barrier
    whose epoch disagrees with another input's for the same checkpoint, or an event handed
    over for an input in the wrong phase. ``input_id`` and ``checkpoint_id`` locate it."""

    def __init__(
        self,
        message: str,
        *,
        input_id: int | None = None,
        checkpoint_id: int | None = None,
        runtime: str | None = None,
        sink: str | None = None,
        epoch: int | None = None,
    ) -> None:
        self.input_id = input_id
        self.checkpoint_id = checkpoint_id
        super().__init__(message, runtime=runtime, sink=sink, epoch=epoch)

    def _fields(self) -> dict[str, Any]:
        return {
            **super()._fields(),
            "input_id": self.input_id,
            "checkpoint_id": self.checkpoint_id,
        }


class StaleAttemptError(RaySinkError):
    """A commit request for an attempt that is no longer the open one."""
