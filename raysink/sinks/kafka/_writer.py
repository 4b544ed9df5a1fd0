"""``KafkaWriter``: one writer slot's transactional producer, inside its writer actor.

``open`` (each start of the writer actor's process) makes the slot's producer
(transactional id ``<prefix>.<runtime>.<sink>.<topic>.w<k>``) and runs ``init_transactions`` in a
thread of its own (``_TakeOver``): the broker then fences every earlier producer of the
slot (a dead incarnation, or a zombie still running on a lost node) and aborts the
transaction it left open. Not in ``open`` itself: an actor restarted after a crash must
answer at once, and taking an id over waits for that abort. Nor later, at the first
``pre_commit`` with records: until the abort, ``read_committed`` readers of every
partition the lost transaction wrote stop at its first record, and a writer may get no
records for long (an unkeyed retry goes around a restarting writer). The calls that need
the producer wait for the thread.

``write`` encodes each batch (``_encode``) and keeps the records until the epoch ends.
``pre_commit`` begins a transaction, produces them, flushes, and keeps the transaction
open: the records are durable in the data topic, invisible to ``read_committed`` readers.
A large epoch's transaction may begin before (``start_early``, ``_produced``): the
records buffered are produced then, and each later batch as it comes; ``pre_commit``
flushes. The records stay buffered to the end either way, so that transaction can be
aborted and the epoch produced again in one go at its pre-commit.
Its manifest names the transactional id, this actor, and per partition the runs of
offsets the records got (from the delivery reports: ``[first, count]`` per run, one run
per batch the client sent; other producers' records may lie between runs), which is what
a replay reads back.

``finish`` is the coordinator's call (through the actor) once the epoch is decided: it adds
the slot's progress record to the held transaction and commits it (or aborts it). Its
answer, ``Held``: ``COMMITTED`` (now or before, by this process), ``ABORTED``, ``GONE``
(this process does not hold it, and owns the transactional id: whatever an earlier
holder left open was aborted when it took the id over) or ``UNKNOWN`` (it does not own the
id: the caller must fence it before replaying). A commit that times out (the broker down)
raises and keeps the transaction: the coordinator asks again later, and librdkafka ends a
commit it had begun rather than committing twice.

Errors librdkafka reports: a *fatal* one (fenced: another producer took the id, or the
transaction timed out; or any other, such as an ACL refusing the id) drops the producer
(the next epoch makes a new one), and is called fenced only for a fencing code
(``_failures``); an *abortable* one aborts the transaction; a *retriable* one is left to
the caller's retry.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from raysink.errors import DataLossError, RaySinkError, SinkUnavailableError
from raysink.sinks.base import Held, SinkWriter
from raysink.sinks.kafka._batches import Chunks, resolve
from raysink.sinks.kafka._encode import Encoded, encode
from raysink.sinks.kafka._failures import error_of, is_fencing, missing_acl, named
from raysink.sinks.kafka._produced import Deliveries, Produced, Runs, produce_each
from raysink.sinks.kafka._progress import (
    KafkaManifest,
    ProgressReader,
    Topics,
    part_key,
    record_value,
)
from raysink.sinks.kafka._takeover import TakeOver

if TYPE_CHECKING:
    import pyarrow as pa

    from raysink.sinks.kafka._roles import SinkView

__all__ = ["KafkaWriter", "Runs"]

log = logging.getLogger(__name__)


_REMEMBERED = 64
_PARTITIONER = "consistent_random"  # librdkafka's default, which ``_batches`` reproduces
_METADATA_AGE = 60.0  # seconds a partition count is used before it is asked again


class KafkaWriter(SinkWriter):
    """See the module docstring. Calls arrive one at a time (the actor's lock)."""

    def __init__(self, sink: SinkView, writer_id: int) -> None:
        self.sink = sink
        self.writer_id = writer_id
        self.settings = sink.settings
        self.txn_id = sink.settings.writer_txn(sink.runtime, sink.name, writer_id)
        self._producer: Any = None
        self._buffer: list[Encoded] = []
        self._rows = 0
        self._held: tuple[int, int] | None = None
        self._marked = False  # the held transaction has its progress record
        self._sealed: tuple[int, int] | None = None
        self._committed: list[tuple[int, int]] = []
        self._topic_checked = False
        self._state = threading.Lock()
        self._watch: Any = None
        self._takeover: TakeOver | None = None
        self._takeover_failed = False
        self._partitions: tuple[int, float] | None = None  # the count, when asked
        self._reader: Any = None  # the consumer reading spread chunks back, kept
        self._early: Produced | None = None  # a transaction begun before its pre-commit
        self._early_off = False  # the epoch being written begins at its pre-commit
        self._clock: Callable[[], float] = time.monotonic  # an early transaction's age

    # -- the producer ------------------------------------------------------------------

    def open(self) -> None:
        """Start taking the transactional id over (see the module docstring)."""
        if self._producer is None and self._takeover is None:
            self._takeover = TakeOver(self._new_producer, self.txn_id)

    def _new_producer(self) -> tuple[Any, Any]:
        """A producer that owns the transactional id (``init_transactions`` done), and the
        watch of its fatal errors."""
        from raysink.sinks.kafka._config import FatalWatch, kafka_module

        ck = kafka_module()
        watch = FatalWatch()
        producer = ck.Producer({**self.settings.producer_config(self.txn_id),
                                "error_cb": watch})
        try:
            producer.init_transactions(self.settings.timeout)
        except ck.KafkaException as exc:
            raise self._error("could not take transactional id over", exc) from exc
        return producer, watch

    def _settle_takeover(self) -> None:
        """The producer of the take-over ``open`` started, once it ends; a take-over
        that failed leaves none (the next use makes one, and raises if it cannot)."""
        takeover, self._takeover = self._takeover, None
        if takeover is None:
            return
        try:
            self._producer, self._watch = takeover.result(2 * self.settings.timeout)
        except RaySinkError as exc:
            self._takeover_failed = True
            log.warning("writer %s: %s; trying again at the next pre-commit",
                        self.writer_id, exc)

    def _retry_failed_takeover(self) -> None:
        """A take-over that ended without a producer (the brokers unreachable at the
        writer's start) starts again, without waiting: a writer that gets no records
        must still end what an earlier incarnation left open."""
        takeover = self._takeover
        if takeover is not None and takeover.done():
            self._settle_takeover()
        if self._takeover_failed and self._takeover is None:
            self._takeover_failed = False
            self.open()

    def _ensure_producer(self) -> Any:
        self._settle_takeover()
        if self._producer is None:
            self._producer, self._watch = self._new_producer()
            self._takeover_failed = False
        return self._producer

    def _drop_producer(self) -> None:
        """After a fatal error: this producer is done; the next use makes a new one."""
        self._producer = None
        self._held = None
        self._early = None

    def _error(self, what: str, exc: BaseException, epoch: int | None = None
               ) -> RaySinkError:
        error = error_of(exc)
        text = f"writer {self.writer_id} ({self.txn_id}) {what}: {named(error or exc)}"
        acl = missing_acl(error, txn=self.txn_id,
                          topics=[self.settings.topic, self.settings.progress_topic])
        if acl is not None:
            text += f" - {acl}"
        elif is_fencing(error):
            text += (" - the producer was fenced: another producer took transactional id "
                     f"{self.txn_id!r} over (a newer incarnation of this writer, or another "
                     f"runtime named {self.sink.runtime!r} writing sink {self.sink.name!r} "
                     "into this topic: give each runtime its own name), or the broker "
                     "aborted a transaction that outlived transaction_timeout")
        elif error is not None and error.fatal():
            text += (" - a fatal error of the producer, not a fencing: the producer is "
                     "dropped and made again at the next use")
        return SinkUnavailableError(text, runtime=self.sink.runtime, sink=self.sink.name,
                                    epoch=epoch)

    # -- an epoch ----------------------------------------------------------------------

    def write(self, batch: pa.RecordBatch) -> None:
        s = self.sink
        encoded = encode(batch, key=s.key_column, value=s.value_source, headers=s.headers)
        if len(encoded):
            self._buffer.append(encoded)
            self._rows += len(encoded)
            if self._early is not None:
                self._send_early([encoded])

    # -- a transaction begun before the pre-commit ----------------------------------

    def wants_early_start(self) -> bool:
        """The sink's ``early_start_records`` buffered, no transaction open (begun early,
        or held for the coordinator), and no early start tried yet for this epoch."""
        threshold = self.sink.early_start_records
        return (threshold is not None and self._early is None and not self._early_off
                and self._held is None and self._rows >= threshold)

    def start_early(self, epoch: int, attempt: int) -> None:
        """Begin ``(epoch, attempt)``'s transaction and produce what is buffered (the
        writer actor calls it once every earlier epoch is committed). Where that cannot
        be (the broker unreachable, records placed by another ``partitioner``), the epoch
        is left to its pre-commit, which says what is wrong."""
        from raysink.sinks.kafka._config import kafka_module

        ck = kafka_module()
        self._early_off = True  # one try an epoch: on again once the attempt has ended
        try:
            self._ensure_topic(epoch)
            producer = self._ensure_producer()
            count = self._partition_count(producer, epoch)
        except RaySinkError as exc:
            log.info("writer %s: epoch %s begins at its pre-commit: %s", self.writer_id,
                     epoch, exc)
            return
        if count is None:
            return  # placed by librdkafka, a delivery report a record: at the pre-commit
        try:
            producer.begin_transaction()
        except ck.KafkaException as exc:
            if exc.args and exc.args[0].fatal():
                self._drop_producer()
            log.info("writer %s: epoch %s begins at its pre-commit: %s", self.writer_id,
                     epoch, self._error("could not begin a transaction", exc, epoch))
            return
        self._early_off = False
        self._early = Produced(producer, self.settings.topic, count, self.writer_id,
                               (epoch, attempt), self._clock())
        log.info("writer %s: epoch %s attempt %s begun before its pre-commit, with %d "
                 "records", self.writer_id, epoch, attempt, self._rows)
        self._send_early(self._buffer)

    def _send_early(self, buffer: Sequence[Encoded]) -> None:
        """Produce ``buffer`` into the transaction begun early; give it up instead when
        it has been open half of ``transaction_timeout``, or when the produce fails."""
        from raysink.sinks.kafka._config import kafka_module

        early = self._early
        assert early is not None
        if self._clock() - early.began > self.settings.transaction_timeout_ms / 2000:
            self._give_up_early("it has been open for half of transaction_timeout "
                                f"({self.settings.transaction_timeout_ms / 1000:g} s)")
            return
        try:
            early.send(buffer)
        except kafka_module().KafkaException as exc:
            error = exc.args[0] if exc.args else None
            self._give_up_early(f"a produce failed: {named(error or exc)}",
                                fatal=error is not None and error.fatal())

    def _give_up_early(self, why: str, *, fatal: bool = False) -> None:
        """Abort the transaction begun early (none of it is ever visible); the epoch's
        records, all still buffered, are produced at its pre-commit."""
        early, self._early = self._early, None
        self._early_off = True
        if early is None:
            return
        log.warning("writer %s: the transaction of epoch %s attempt %s, begun before its "
                    "pre-commit, is aborted (%s); the epoch's %d records are produced at "
                    "its pre-commit", self.writer_id, early.key and early.key[0],
                    early.key and early.key[1], why, self._rows)
        if fatal:
            self._drop_producer()
        else:
            self._abort_quietly(early.producer)

    # -- the pre-commit ------------------------------------------------------------

    def pre_commit(self, epoch: int, attempt: int) -> KafkaManifest:
        """Produce the epoch's records in a transaction (or end the one begun early) and
        keep it open."""
        buffer, rows = self._buffer, self._rows
        self._buffer, self._rows = [], 0
        early, self._early, self._early_off = self._early, None, False
        self._sealed = (epoch, attempt)
        if early is not None and early.key != (epoch, attempt):
            # another attempt's (its rollback aborts it first: not expected)
            self._abort_quietly(early.producer)
            early = None
        manifest: KafkaManifest = {"writer": self.writer_id, "rows": rows, "epoch": epoch,
                              "attempt": attempt}
        if not rows:
            self._retry_failed_takeover()
            return manifest
        self._ensure_topic(epoch)
        producer = self._ensure_producer()
        runs = self._produce(producer, buffer, epoch, early)
        with self._state:
            self._held, self._marked = (epoch, attempt), False
        manifest.update({"txn": self.txn_id, "actor": _actor_name(),
                         "topic": self.settings.topic, "runs": runs,
                         "bytes": sum(e.nbytes for e in buffer)})
        return manifest

    def _produce(self, producer: Any, buffer: list[Encoded], epoch: int,
                 early: Produced | None) -> Runs:
        """Produce the epoch's records in a new transaction (or flush the one begun
        early, ``early``); the offset runs they got. Chunked (``_batches``: two delivery
        reports per chunk) when this writer can place records as librdkafka's
        partitioner would; with a report per record otherwise, or when a chunk's
        records were not contiguous (that transaction is aborted first: none of it is
        ever visible)."""
        count = None if early is not None else self._partition_count(producer, epoch)
        if early is not None or count is not None:
            runs = (self._settle(early, epoch) if early is not None
                    else self._produce_chunked(producer, buffer, count or 0, epoch))
            if runs is not None:
                return runs
            log.warning("writer %s: epoch %s: a chunk's records were not contiguous "
                        "(another producer wrote between them: more writers than partitions, "
                        "or a foreign producer); produced again with a delivery report per "
                        "record", self.writer_id, epoch)
        return self._produce_each(producer, buffer, epoch)

    def _partition_count(self, producer: Any, epoch: int) -> int | None:
        """The data topic's partition count (asked once a minute), or ``None`` when the
        records must be placed by librdkafka (another ``partitioner`` configured)."""
        from raysink.sinks.kafka._config import kafka_module

        if self.settings.producer.get("partitioner", _PARTITIONER) != _PARTITIONER:
            return None
        now = time.monotonic()
        if self._partitions is not None and now - self._partitions[1] < _METADATA_AGE:
            return self._partitions[0]
        ck = kafka_module()
        try:
            metadata = producer.list_topics(self.settings.topic, self.settings.timeout)
            topic = metadata.topics.get(self.settings.topic)
        except ck.KafkaException as exc:
            raise self._error("could not read the data topic's partitions", exc,
                              epoch) from exc
        if topic is None or topic.error is not None or not topic.partitions:
            return None  # librdkafka places them, and says what is wrong
        self._partitions = (len(topic.partitions), now)
        return self._partitions[0]

    def _produce_chunked(self, producer: Any, buffer: list[Encoded], count: int,
                         epoch: int) -> Runs | None:
        from raysink.sinks.kafka._config import kafka_module

        ck = kafka_module()
        produced = Produced(producer, self.settings.topic, count, self.writer_id, None,
                            time.monotonic())
        try:
            producer.begin_transaction()
            produced.send(buffer)
        except ck.KafkaException as exc:
            raise self._failed(producer, "could not produce", exc, epoch) from exc
        return self._settle(produced, epoch)

    def _settle(self, produced: Produced, epoch: int) -> Runs | None:
        """Flush the transaction's records; their runs, or ``None`` when a chunk cannot be
        placed (the transaction is then aborted)."""
        from raysink.sinks.kafka._config import kafka_module

        producer, chunks = produced.producer, produced.chunks
        try:
            left = self._watch.flush(producer, self.settings.timeout)
        except kafka_module().KafkaException as exc:
            raise self._failed(producer, "could not produce", exc, epoch) from exc
        self._check_delivered(producer, left, chunks.error, epoch)
        runs = chunks.runs()
        if runs is None and chunks.spread():
            runs = self._place_spread(chunks, epoch)
        if runs is None:
            self._abort_quietly(producer)
            if self._producer is None:
                raise SinkUnavailableError(
                    f"writer {self.writer_id}: the epoch's records must be produced again "
                    "and the transaction could not be aborted; the attempt is retried",
                    runtime=self.sink.runtime, sink=self.sink.name, epoch=epoch)
        return runs

    def _place_spread(self, chunks: Chunks, epoch: int) -> Runs | None:
        """Runs of the chunks another producer wrote into, from their offsets read back
        (``_batches.resolve``); ``None`` when one cannot be placed for sure."""
        from raysink.sinks.kafka._config import kafka_module

        ck = kafka_module()
        spread = len(chunks.spread())
        if self._reader is None:  # one per writer: a new one costs a connection and threads
            self._reader = ck.Consumer(self.settings.replay_consumer_config())
        try:
            placed = resolve(self._reader, self.settings.topic, chunks,
                             self.settings.timeout, time.monotonic)
        except ck.KafkaException as exc:
            log.warning("writer %s: epoch %s: reading back %d chunks failed: %s",
                        self.writer_id, epoch, spread, exc)
            self._close_reader()
            placed = False
        log.info("writer %s: epoch %s: %d chunks another producer wrote into %s",
                 self.writer_id, epoch, spread,
                 "placed from their records read back" if placed else "could not be placed")
        return chunks.runs() if placed else None

    def _close_reader(self) -> None:
        reader, self._reader = self._reader, None
        if reader is not None:
            try:
                reader.close()
            except Exception as exc:  # a consumer that failed may fail to close too
                log.debug("writer %s: closing the read-back consumer: %s", self.writer_id, exc)

    def _produce_each(self, producer: Any, buffer: list[Encoded], epoch: int) -> Runs:
        from raysink.sinks.kafka._config import kafka_module

        ck = kafka_module()
        deliveries = Deliveries()
        try:
            producer.begin_transaction()
            for encoded in buffer:
                produce_each(producer, self.settings.topic, encoded, deliveries.report)
            left = self._watch.flush(producer, self.settings.timeout)
        except ck.KafkaException as exc:
            raise self._failed(producer, "could not produce", exc, epoch) from exc
        self._check_delivered(producer, left, deliveries.error, epoch)
        return deliveries.manifest_runs()

    def _check_delivered(self, producer: Any, left: int, error: Any, epoch: int) -> None:
        """``SinkUnavailableError`` (the transaction aborted) when records are left unsent
        or a delivery failed."""
        if left or error is not None:
            why = (f"{left} records still unsent after {self.settings.timeout:g} s" if left
                   else str(error))
            self._abort_quietly(producer)
            raise SinkUnavailableError(
                f"writer {self.writer_id}: the epoch's records did not all reach the data "
                f"topic {self.settings.topic!r}: {why}", runtime=self.sink.runtime,
                sink=self.sink.name, epoch=epoch)

    def _failed(self, producer: Any, what: str, exc: Any, epoch: int) -> RaySinkError:
        error = exc.args[0] if exc.args else None
        if error is not None and error.fatal():
            self._drop_producer()
        else:
            self._abort_quietly(producer)
        return self._error(what, exc, epoch)

    def _abort_quietly(self, producer: Any) -> None:
        try:
            producer.abort_transaction(self.settings.timeout)
        except Exception as exc:  # the producer is past saving: make a new one next time
            log.warning("writer %s: abort failed (%s); the producer is replaced",
                        self.writer_id, exc)
            self._drop_producer()
        with self._state:
            self._held = None
        self._early = None

    def _ensure_topic(self, epoch: int) -> None:
        """The data topic, created at this writer's first epoch when missing (never by
        ``validate``); missing after this sink committed to it is ``DataLossError``."""
        if self._topic_checked:
            return
        topics = Topics(self.settings)
        if not topics.exists(self.settings.topic):
            if topics.exists(self.settings.progress_topic):
                reader = ProgressReader(self.settings, self.sink.runtime, self.sink.name)
                try:
                    done = reader.committed_epoch()
                finally:
                    reader.close()
                if done is not None:
                    raise DataLossError(
                        f"the data topic {self.settings.topic!r} was deleted after epoch "
                        f"{done} was committed to it (the progress topic says so); restore "
                        "it, or drop the sink from the runtime", runtime=self.sink.runtime,
                        sink=self.sink.name, epoch=epoch)
            topics.create_data()
        self._topic_checked = True

    def rollback(self, epoch: int, attempt: int) -> None:
        """Drop the attempt: its held transaction is aborted; records still buffered for
        it are dropped (a rollback of the attempt just pre-committed leaves the buffer,
        which holds the next epoch's)."""
        with self._state:
            held = self._held == (epoch, attempt)
        if held:
            self._abort_quietly(self._producer)
        elif self._sealed != (epoch, attempt):
            if self._early is not None:  # begun early with the records dropped here
                self._abort_quietly(self._early.producer)
            self._buffer, self._rows = [], 0
            self._early_off = False

    # -- the coordinator's call ---------------------------------------------------------

    def finish(self, epoch: int, attempt: int, *, commit: bool) -> Held:
        """Commit (or abort) the held transaction of ``(epoch, attempt)``: see ``Held``."""
        self._settle_takeover()
        with self._state:
            if (epoch, attempt) in self._committed:
                return Held.COMMITTED
            if self._held != (epoch, attempt):
                return Held.GONE if self._producer is not None else Held.UNKNOWN
        producer = self._producer
        if not commit:
            self._abort_quietly(producer)
            return Held.ABORTED
        return self._commit_held(producer, epoch, attempt)

    def _commit_held(self, producer: Any, epoch: int, attempt: int) -> Held:
        from raysink.sinks.kafka._config import kafka_module

        ck = kafka_module()
        try:
            if not self._marked:  # a commit asked again after a timeout has it already
                producer.produce(self.settings.progress_topic,
                                 record_value(epoch, attempt, writer=self.writer_id),
                                 part_key(self.sink.runtime, self.sink.name, self.writer_id))
                self._marked = True
            producer.commit_transaction(self.settings.timeout)
        except ck.KafkaException as exc:
            error = exc.args[0]
            if error.fatal():  # fenced, timed out, or refused: the transaction is lost
                log.warning("writer %s: held transaction of epoch %s lost (%s): %s",
                            self.writer_id, epoch,
                            "fenced" if is_fencing(error) else "a fatal error",
                            self._error("could not commit", exc, epoch))
                self._drop_producer()
                return Held.GONE
            if error.txn_requires_abort():
                self._abort_quietly(producer)
                return Held.GONE
            raise self._error("could not commit yet (asked again later)", exc,
                              epoch) from exc
        with self._state:
            self._held = None
            self._committed = [*self._committed[-_REMEMBERED:], (epoch, attempt)]
        return Held.COMMITTED

    def close(self) -> None:
        """Abort a transaction still held (its epoch, if decided, is replayed by the
        coordinator), then let the producer go."""
        self._close_reader()
        self._settle_takeover()
        producer = self._producer
        if producer is None:
            return
        with self._state:
            held = self._held is not None or self._early is not None
        if held:
            self._abort_quietly(producer)
        producer.flush(5.0)
        self._producer = None


def _actor_name() -> str | None:
    """This writer actor's Ray name (the coordinator asks it to finish the epoch)."""
    try:
        import ray

        return ray.get_runtime_context().get_actor_name()
    except Exception:  # not in an actor (the sink used without a runtime)
        return None


