"""What the modules below ``_sink`` need of ``KafkaSink``, as protocols, so that none of
them imports it (the package imports downward only; see its docstring).

``SinkView``: what a writer slot reads of its sink (``_writer``); ``CommittingSink``: what a
replay of a lost part uses of the coordinator's sink (``_replay``). ``KafkaSink`` is both.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from collections.abc import Sequence

    from raysink.sinks.kafka._avroschema import AvroValues
    from raysink.sinks.kafka._committer import Committer
    from raysink.sinks.kafka._config import KafkaSettings
    from raysink.sinks.kafka._progress import ProgressReader

__all__ = ["BoundSink", "CommittingSink", "SinkView"]


class BoundSink(Protocol):
    """A sink bound to its runtime: its settings and names."""

    @property
    def settings(self) -> KafkaSettings: ...

    @property
    def runtime(self) -> str: ...

    @property
    def name(self) -> str: ...


class SinkView(BoundSink, Protocol):
    """The bound sink as a writer slot sees it."""

    @property
    def key_column(self) -> str | None: ...

    @property
    def value_source(self) -> str | AvroValues | None:
        """What a record's value is (``_encode.encode``'s ``value``): a column's bytes, the
        row in Avro, or ``None`` (a binary column named ``value``, else JSON)."""

    @property
    def headers(self) -> Sequence[str]: ...

    @property
    def early_start_records(self) -> int | None:
        """Records of an epoch after which a writer begins its transaction early
        (``None``: at the pre-commit)."""


class CommittingSink(BoundSink, Protocol):
    """The bound sink as the coordinator's replay of a lost part uses it."""

    def progress(self) -> ProgressReader: ...

    def committer(self) -> Committer: ...

    def begin_committer_transaction(self, epoch: int) -> Any: ...

    def end_committer_transaction(self, committer: Any, epoch: int) -> None: ...

    def epoch_record(self, epoch: int, attempt: int) -> bytes: ...
