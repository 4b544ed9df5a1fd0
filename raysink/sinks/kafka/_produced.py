"""``Produced``: one writer transaction's records sent so far, chunk by chunk, and when
it began: the epoch's transaction begun at its pre-commit, or early
(``KafkaSink(early_start_records=)``, off by default).

A writer's transaction is begun at the epoch's pre-commit, or earlier: once a writer holds
that many records of an epoch and every earlier epoch is committed, the writer
actor has it begin the transaction (``KafkaWriter.start_early``); what is buffered is
produced at once and every later batch of the epoch as it arrives, so the client sends
while the rest of the epoch is still handed over (a Spark partition after another), and
the pre-commit only flushes. Either way the same ``Chunks`` record the offsets (two
delivery reports per chunk) and the same ``Planner`` places the records, so the
manifest's runs are found as before.

The writer keeps every record of the epoch until its pre-commit whichever way it began,
so a transaction begun early can be given up at any point (aborted: none of it is ever
visible) and the epoch produced again in one go at its pre-commit: when a produce fails,
or when the transaction has been open for half of ``transaction_timeout`` (an epoch whose
records arrive over a long time would otherwise outlive the timeout and be aborted by the
broker at every try).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from raysink.sinks.kafka._batches import Chunks, Planner, produce_parts

if TYPE_CHECKING:
    from raysink.sinks.kafka._encode import Encoded

__all__ = ["Deliveries", "Produced", "Runs", "produce_each"]

Runs = dict[str, list[list[int]]]
"""Offsets of one part's records per partition (as a string): ``[[first, count], ...]``."""

class Produced:
    """The records of one transaction sent so far (``send``), for ``key`` (the epoch and
    attempt of one begun early, else ``None``); ``began``: the clock's reading when the
    transaction began."""

    def __init__(self, producer: Any, topic: str, count: int, writer: int,
                 key: tuple[int, int] | None, began: float) -> None:
        self.producer = producer
        self.topic = topic
        self.key = key
        self.began = began
        self.planner = Planner(count, writer)
        self.chunks = Chunks()
        self.records = 0

    def send(self, buffer: Sequence[Encoded]) -> None:
        """Produce ``buffer``'s records, placed and chunked; a full local queue is waited
        out. ``KafkaException`` as the client raises it."""
        producer = self.producer
        produce_parts(producer, self.topic, self.planner.plan(buffer), self.chunks,
                      lambda: producer.poll(0.05))
        self.records += sum(len(encoded) for encoded in buffer)


class Deliveries:
    """Delivery reports of one transaction: runs of offsets per partition, the first
    error. Reports of one partition come in offset order."""

    def __init__(self) -> None:
        self.runs: dict[int, list[list[int]]] = {}
        self.error: Any = None
        self.count = 0

    def report(self, err: Any, msg: Any) -> None:
        if err is not None:
            if self.error is None:
                self.error = err
            return
        self.count += 1
        runs = self.runs.setdefault(msg.partition(), [])
        offset = msg.offset()
        if runs and runs[-1][0] + runs[-1][1] == offset:
            runs[-1][1] += 1
        else:
            runs.append([offset, 1])

    def manifest_runs(self) -> Runs:
        return {str(p): runs for p, runs in sorted(self.runs.items())}


def produce_each(producer: Any, topic: str, encoded: Encoded,
                 report: Callable[[Any, Any], None]) -> None:
    """Produce one batch's records; a full local queue is waited out."""
    produce = producer.produce
    values = encoded.values
    keys = encoded.keys or [None] * len(values)
    headers = encoded.headers
    for i, (value, key) in enumerate(zip(values, keys, strict=True)):
        while True:
            try:
                if headers is None:
                    produce(topic, value, key, on_delivery=report)
                else:
                    produce(topic, value, key, on_delivery=report, headers=headers[i])
                break
            except BufferError:
                producer.poll(0.05)
        if not i & 0x3FF:
            producer.poll(0)
