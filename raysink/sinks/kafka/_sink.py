"""``KafkaSink``: the picklable description, and the coordinator's calls.

``commit(E)``, in the coordinator:

1. the committer (``_committer``: transactional id ``<prefix>.<runtime>.<sink>.<topic>.c``, taken
   over once per coordinator process, a new coordinator fencing the one before it, and
   again after an error that ends its producer; a commit that timed out is resumed at the
   next try, not begun again) begins a transaction
   with the epoch's progress record and flushes it: a committer another coordinator
   fenced stops here, before anything of the epoch is committed (``FencedError``);
2. each writer that produced records is asked, through its actor (named in its
   manifest), to commit the transaction it holds (``SinkWriter.finish``), with its part's
   progress record;
3. every part committed: the committer commits the epoch record. A part whose writer no
   longer holds it (``Held.GONE``/``UNKNOWN``, or no answer): the committer aborts its
   transaction and replays the lost parts with the epoch record (``_replay``).

A commit that failed half way runs again: writers answer ``COMMITTED`` for the parts
they committed, the progress topic answers for parts whose writer is gone, so nothing is
committed twice. ``committed_epoch()`` is the epoch record's epoch.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from raysink import _faults
from raysink.errors import (
    ConfigError,
    DataLossError,
    SinkUnavailableError,
    TransactionHeldError,
)
from raysink.sinks.base import CommitResult, Held, Manifest, Sink, decision_id
from raysink.sinks.kafka import _hanging, _replay
from raysink.sinks.kafka._committer import Committer
from raysink.sinks.kafka._config import (
    KafkaSettings,
    check_client_config,
    check_producer_config,
    check_topic,
    default_progress_topic,
    kafka_module,
    positive_or_none,
    unavailable,
)
from raysink.sinks.kafka._encode import check_columns, value_source
from raysink.sinks.kafka._progress import (
    KafkaManifest,
    ProgressReader,
    Topics,
    epoch_key,
    kafka_manifests,
    record_value,
)
from raysink.sinks.kafka._writer import KafkaWriter

__all__ = ["KafkaSink"]

log = logging.getLogger("raysink.sinks.kafka")

_HEAL_ROUNDS = 4  # transactions ended one after another before the marker is read as it is
_PROBE = 5.0  # seconds a first read of the progress topic waits (``_read_to_end``)
_LIVE = ("_topics", "_reader", "_committer", "_read_at")


class KafkaSink(Sink):
    """Exactly-once sink into the Kafka topic ``topic`` for ``read_committed`` readers.

    Each row is one record: its value the row as JSON (or the bytes of ``value``, a
    binary or string column; a binary column named ``value`` is taken by default; or,
    with ``value_format="avro"``, the row as one Avro record of ``avro_schema``, a record
    schema as a dict or JSON text, its fields taken from the columns of their names, framed
    for a Schema Registry when ``schema_id`` is given: docs/kafka.md, "Avro values"), its
    key the ``key`` column (partitioned by the client's default partitioner on it),
    headers from the ``headers`` columns. ``producer_config`` passes librdkafka settings
    to the writers' producers and refuses those that contradict exactly-once;
    ``client_config`` goes to every client (security settings).

    Topics are created when first needed, never by ``validate()``: the data topic by the
    first writer to pre-commit, with ``partitions``, ``replication_factor``,
    ``min_insync_replicas`` and ``topic_config`` (``None``: the broker's defaults); the
    progress topic (``progress_topic``, default ``<topic>-raysink-progress``: one
    partition, compacted) by the first commit. ``transaction_timeout`` (seconds) bounds
    how long a writer's transaction may stay open: one that outlives it is aborted by the
    broker and its epoch replayed from the log. With ``early_start_records`` set, a writer
    holding that many records of an epoch begins its transaction early (``_produced``);
    ``None``, the default, begins every epoch's at its pre-commit.
    """

    kind = "kafka"
    holds_transactions = True

    def __init__(
        self,
        bootstrap_servers: str,
        topic: str,
        *,
        key: str | None = None,
        value: str | None = None,
        headers: Sequence[str] = (),
        value_format: Literal["json", "avro"] = "json",
        avro_schema: Mapping[str, Any] | str | None = None,
        schema_id: int | None = None,
        progress_topic: str | None = None,
        partitions: int | None = None,
        replication_factor: int | None = None,
        min_insync_replicas: int | None = None,
        topic_config: Mapping[str, str] | None = None,
        producer_config: Mapping[str, Any] | None = None,
        client_config: Mapping[str, Any] | None = None,
        transactional_id_prefix: str = "raysink",
        transaction_timeout: float = 900.0,
        timeout: float = 60.0,
        early_start_records: int | None = None,
    ) -> None:
        kafka_module()
        check_columns(key, value, headers)
        check_topic(topic, "topic")
        if not isinstance(transaction_timeout, int | float) or transaction_timeout <= 0:
            raise ConfigError(f"transaction_timeout must be positive seconds; got "
                              f"{transaction_timeout!r}")
        self.settings = KafkaSettings(
            bootstrap_servers=bootstrap_servers, topic=topic,
            progress_topic=progress_topic or default_progress_topic(topic),
            partitions=partitions, replication_factor=replication_factor,
            min_insync_replicas=min_insync_replicas,
            topic_config={str(k): str(v) for k, v in (topic_config or {}).items()},
            producer=check_producer_config(producer_config),
            client=check_client_config(client_config),
            transactional_id_prefix=transactional_id_prefix,
            transaction_timeout_ms=int(transaction_timeout * 1000), timeout=timeout)
        self.key_column = key
        # a column's name, the Avro schema (``AvroValues``), or None: what ``encode`` takes
        self.value_source = value_source(value, value_format, avro_schema, schema_id)
        self.headers = tuple(headers)
        self.early_start_records = positive_or_none(early_start_records, "early_start_records",
                                                    "every epoch begins at its pre-commit")
        self._topics: Topics | None = None
        self._reader: ProgressReader | None = None
        self._committer: Committer | None = None
        self._read_at = 0.0
        self._decision: tuple[int, str] | None = None  # the epoch being committed, its id
        self._ready = False  # both topics seen by this process's last commit

    # -- description ----------------------------------------------------------------

    def describe(self) -> dict[str, Any]:
        s = self.settings
        return {"kind": self.kind, "bootstrap_servers": s.bootstrap_servers,
                "topic": s.topic, "progress_topic": s.progress_topic,
                "key": self.key_column}

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, **dict.fromkeys(_LIVE), "_read_at": 0.0, "_ready": False}

    def _where(self, epoch: int | None = None) -> dict[str, Any]:
        return {"runtime": self.runtime or None, "sink": self.name or None, "epoch": epoch}

    def topics(self) -> Topics:
        if self._topics is None:
            self._topics = Topics(self.settings)
        return self._topics

    def progress(self) -> ProgressReader:
        if self._reader is None:
            self._reader = ProgressReader(self.settings, self.runtime, self.name)
        return self._reader

    # -- validate / writers -----------------------------------------------------------

    def validate(self) -> None:
        """The brokers answer; an existing data topic is not compacted. Creates nothing."""
        topics = self.topics()
        if topics.exists(self.settings.topic):
            policy = topics.config(self.settings.topic).get("cleanup.policy", "delete")
            if "compact" in policy:
                raise ConfigError(
                    f"topic {self.settings.topic!r} is compacted (cleanup.policy={policy}): "
                    "compaction drops the records of aborted transactions, which the sink "
                    "reads back to replay an epoch whose writer was lost; write to a topic "
                    "with cleanup.policy=delete", **self._where())

    def create_writer(self, writer_id: int) -> KafkaWriter:
        return KafkaWriter(self, writer_id)

    # -- the coordinator's calls --------------------------------------------------------

    def _claim(self) -> Committer:
        """The committer (``_committer``): its producer, transaction and errors."""
        if self._committer is None:
            self._committer = Committer(self.settings, self.runtime, self.name)
        return self._committer

    def committer(self) -> Committer:
        """The committer (its producer made at its first use)."""
        return self._claim()

    def _taken_over(self) -> bool:
        return self._committer is not None and self._committer.producer is not None

    def _take_over(self) -> None:
        """Take the committer's transactional id over now (``init_transactions``), which
        fences an earlier coordinator's committer and ends the transaction it left open;
        and, once per process, the id of the scheme before ids were scoped by topic
        (``_fence_legacy_committer``). Called when something holds the progress topic
        back, never merely at start: a second runtime of the name that alignment then
        refuses must not fence the running one."""
        if self._taken_over():
            return
        self._claim().claim()
        self._fence_legacy_committer()

    def _fence_legacy_committer(self) -> None:
        """Fence the committer's id of the scheme before ids were scoped by topic: a
        coordinator of that scheme (an upgrade) may have left its epoch record in a
        transaction that, open, hides every later record of the progress topic from
        ``read_committed`` readers. Best effort: such a transaction also ends at its
        ``transaction_timeout``. Its writers' ids need no such step: a PENDING epoch's
        manifests name them, and a commit fences a part's id that no writer vouches for
        (``_vouched``)."""
        legacy = self.settings.legacy_committer_txn(self.runtime, self.name)
        if legacy == self.settings.committer_txn(self.runtime, self.name):
            return
        try:
            _replay.fence(self, legacy)
        except SinkUnavailableError as exc:
            log.info("kafka sink %s/%s: the legacy committer id %s was not fenced: %s",
                     self.runtime, self.name, legacy, exc)

    def _begin(self, epoch: int, attempt: int) -> Any:
        """Begin the committer's transaction with the epoch record, flushed: fails with
        ``FencedError`` when another coordinator took the committer over."""
        committer = self.begin_committer_transaction(epoch)
        try:
            committer.produce(self.settings.progress_topic, self.epoch_record(epoch, attempt),
                              epoch_key(self.runtime, self.name))
        except kafka_module().KafkaException as exc:
            raise self._claim().failed(exc, epoch) from exc
        self._claim().flush(epoch)
        return committer

    def begin_committer_transaction(self, epoch: int) -> Any:
        """The committer's producer in a new transaction; what an earlier call left
        unfinished is ended first (``Committer.settle``)."""
        return self._claim().begin(epoch)

    def end_committer_transaction(self, committer: Any, epoch: int) -> None:
        self._claim().commit(epoch)

    def _abort_committer(self, committer: Any, epoch: int) -> None:
        self._claim().abort(epoch)

    def commit(self, epoch: int, manifests: Sequence[Manifest]) -> CommitResult:
        """Make ``epoch`` visible with its progress records (see the module docstring)."""
        started = time.monotonic()
        parts = [m for m in kafka_manifests(manifests) if m.get("txn")]
        self._decision = (epoch, decision_id(epoch, manifests))
        try:
            if not self._ready and not self._topics_ready(epoch, parts):
                return CommitResult.NO_TARGET
            resumed = self._claim().settle(epoch)
            if resumed is not None and resumed >= epoch:
                log.info("kafka sink %s/%s committed epoch %d (its commit resumed)",
                         self.runtime, self.name, epoch)
                return CommitResult.COMMITTED
            done = self._committed_recently()
            if done is not None and done >= epoch:
                return CommitResult.ALREADY
            replayed = self._commit_parts(epoch, parts)
        except TransactionHeldError:
            self._ready = False
            self._unblock_progress(epoch)  # raises again while it cannot be ended
            raise SinkUnavailableError("the progress topic was held back by a transaction "
                                       "that is ended now; the commit runs again",
                                       **self._where(epoch)) from None
        except BaseException:
            self._ready = False  # a topic deleted meanwhile shows at the next try
            raise
        if replayed is None:
            return CommitResult.ALREADY
        log.info("kafka sink %s/%s committed epoch %d (%d records, %d of %d parts replayed) "
                 "in %.3fs", self.runtime, self.name, epoch,
                 sum(int(m.get("rows", 0)) for m in parts), replayed, len(parts),
                 time.monotonic() - started)
        return CommitResult.COMMITTED

    def _topics_ready(self, epoch: int, parts: Sequence[KafkaManifest]) -> bool:
        """The data topic is there (else: ``False`` for an epoch without records, a
        ``DataLossError`` for one with), and the progress topic (created if missing)."""
        topics = self.topics()
        if not topics.exists(self.settings.topic):
            if parts:
                raise DataLossError(f"the data topic {self.settings.topic!r} was deleted "
                                    "while the epoch was pending", **self._where(epoch))
            return False
        if not topics.exists(self.settings.progress_topic):
            topics.create_progress()
            self.progress().reset()
        self._ready = True
        return True

    def _commit_parts(self, epoch: int, parts: Sequence[KafkaManifest]) -> int | None:
        """Steps 1-3 of the module docstring: the number of parts replayed, ``None`` when
        the progress topic showed the epoch in."""
        attempt = int(parts[0].get("attempt", 0)) if parts else 0
        committer = self._begin(epoch, attempt)
        _faults.hit("kafka.before_finish", runtime=self.runtime, sink=self.name, epoch=epoch)
        outcomes = self._finish(epoch, parts, commit=True)
        lost = [(m, held) for m, held in zip(parts, outcomes, strict=True)
                if held is not Held.COMMITTED]
        _faults.hit("sink.mid_commit", runtime=self.runtime, sink=self.name, epoch=epoch)
        if not lost:
            self.end_committer_transaction(committer, epoch)
            return 0
        self._abort_committer(committer, epoch)
        return len(lost) if _replay.replay(self, epoch, attempt, lost) else None

    def _committed_recently(self) -> int | None:
        """The epoch record as read by ``committed_epoch()`` just before (the coordinator
        reads it before each commit), or read now."""
        if time.monotonic() - self._read_at > 1.0:
            return self.committed_epoch()
        return self.progress().committed_epoch(cached=True)

    def _finish(self, epoch: int, parts: Sequence[KafkaManifest], *,
                commit: bool) -> list[Held]:
        """Ask each part's writer actor to end its transaction; ``UNKNOWN`` where no
        actor answers. A writer's own error (the broker down) is raised: asked again."""
        if not parts:
            return []
        from raysink.errors import RaySinkError
        from raysink.protocol.clients import WriterClient, answer

        calls: list[Any] = []
        for manifest in parts:
            try:
                writer = WriterClient.named(str(manifest["actor"]))
                calls.append(writer.finish(epoch, int(manifest["attempt"]), commit).send())
            except Exception as exc:  # no such actor (gone), or Ray not here
                log.info("writer %s of epoch %s unreachable: %s", manifest["writer"], epoch,
                         exc)
                calls.append(None)
        outcomes: list[Held] = []
        for call in calls:
            try:
                outcomes.append(Held.UNKNOWN if call is None
                                else answer(call, timeout=self.settings.timeout))
            except RaySinkError:
                raise
            except Exception as exc:
                log.info("a writer of epoch %s did not finish: %s", epoch, exc)
                outcomes.append(Held.UNKNOWN)
        return [self._vouched(m, held) for m, held in zip(parts, outcomes, strict=True)]

    def _vouched(self, manifest: KafkaManifest, held: Held) -> Held:
        """``GONE`` says the writer took the part's transactional id over, which holds
        only if the part was made under the id the writer uses now: a part made under
        another (a manifest of the scheme before ids were scoped by topic, decided
        before an upgrade) is ``UNKNOWN``, so its id is fenced before a replay."""
        own = self.settings.writer_txn(self.runtime, self.name, int(manifest["writer"]))
        return Held.UNKNOWN if held is Held.GONE and manifest.get("txn") != own else held

    def abort(self, epoch: int, manifests: Sequence[Manifest] | None) -> None:
        """Abort the parts' held transactions; a part no writer vouches for is fenced.
        With ``None`` (the sweep of an aborted or unrecorded attempt) nothing is known of
        the writers: each one's next start fences its own id, but what this sink's
        producers left open on the progress partition is fenced now
        (``_fence_progress_holders``)."""
        parts = [m for m in kafka_manifests(manifests) if m.get("txn")]
        for manifest, held in zip(parts, self._finish(epoch, parts, commit=False),
                                  strict=True):
            if held is Held.UNKNOWN:
                _replay.fence(self, str(manifest["txn"]))
        if manifests is None:
            self._fence_progress_holders(epoch)

    def _fence_progress_holders(self, epoch: int) -> None:
        """Fence each of this sink's transactional ids whose open transaction holds the
        progress partition back: a writer that added its part record and died before
        committing (its id is taken over only when a writer of that number starts again,
        maybe never after a rescale), or a dead committer (taken over only at its
        successor's first commit). Open, such a transaction hides every later progress
        record from ``read_committed`` readers until ``transaction_timeout``: the marker
        reads as behind. The coordinator sweeps and commits a sink one at a time, so
        none of its own producers holds the partition now; one of another process (a
        second runtime of the name) would be inside a commit, so a transaction younger
        than ``_PROBE`` seconds is looked at again after that, as ``_read_to_end`` does.
        Only ids named by the record at the last stable offset are fenced, one after
        another: fencing every writer number blindly would also fence a second runtime's
        live writers before alignment refuses it. Best effort: a broker that cannot be
        asked leaves it to ``heal_marker`` and the transactions' timeout."""
        prefix = epoch_key(self.runtime, self.name)
        fenced: set[int] = set()  # first offsets of the transactions fenced
        waited = False
        try:
            if not self.topics().exists(self.settings.progress_topic):
                return
            for _ in range(_HEAL_ROUNDS + 1):
                held = self._open_on_progress()
                if held is None or held.first_offset in fenced or not (
                        held.key == prefix or (held.key or "").startswith(prefix + ":w")):
                    return  # nothing held, still held after fencing (hanging), not ours
                if not waited and (held.age_seconds or 0.0) < _PROBE:
                    waited = True
                    time.sleep(_PROBE - (held.age_seconds or 0.0))
                    continue
                log.info("kafka sink %s/%s: sweeping epoch %d, fencing %s: %s", self.runtime,
                         self.name, epoch, held.holder(prefix),
                         held.describe(prefix, self.settings.bootstrap_servers))
                self._fence_holder(held)
                fenced.add(held.first_offset)
        except SinkUnavailableError as exc:
            log.info("kafka sink %s/%s: what holds the progress topic back was not fenced "
                     "at the sweep of epoch %d: %s", self.runtime, self.name, epoch, exc)

    def committed_epoch(self) -> int | None:
        """The last epoch the progress topic records committed (``None``: no record, or
        no progress topic); the topic looked up first unless the reader reads on
        (``ProgressReader.read_on``)."""
        known = self.progress().read_on()
        if known is not None:
            self._read_at = time.monotonic()
            return known[0]
        if not self.topics().exists(self.settings.progress_topic):
            self.progress().reset()
            return None
        epoch = self.progress().committed_epoch(strict=False)
        self._read_at = time.monotonic()
        return epoch

    def heal_marker(self, expected: int) -> int | None:
        """The epoch record read again after it read behind ``expected``: a transaction
        left open on the progress partition (``_hanging``) hides it rather than a lost
        record. This sink's own transactional ids that may hold it are fenced first (the
        committer, taken over by this process; a writer whose part record is held), which
        ends whatever their coordinator still knows; one still open after that is hanging,
        and is ended where its outcome is proven (``_hanging.end_if_proven``, ``expected``
        being what is true), or named in ``TransactionHeldError``."""
        marker = self.committed_epoch()
        for _ in range(_HEAL_ROUNDS):
            if marker is not None and marker >= expected:
                return marker
            if not self.topics().exists(self.settings.progress_topic):
                return marker  # deleted: nothing holds it back (re-created by the caller)
            held = self._open_on_progress()
            if held is None:
                return marker  # nothing held back: the record is gone
            self._fence_holder(held)
            held = self._open_on_progress()
            if held is not None:
                self._end_held(held, truth=expected)
            marker = self.committed_epoch()
        return marker

    def _open_on_progress(self) -> _hanging.OpenTransaction | None:
        try:
            return _hanging.find_open(self.settings, self.settings.progress_topic)
        except Exception as exc:
            raise unavailable(self.settings, "could not tell what holds the progress "
                              "topic back", exc, **self._where()) from exc

    def _fence_holder(self, held: _hanging.OpenTransaction) -> None:
        """End what this sink's own producers may still hold open there."""
        prefix = epoch_key(self.runtime, self.name)
        if held.key == prefix:
            self._take_over()  # an earlier process's committer: fenced by the take-over
        elif held.key is not None and held.key.startswith(prefix + ":w"):
            try:
                writer = int(held.key[len(prefix) + 2:])
            except ValueError:
                return
            _replay.fence(self, self.settings.writer_txn(self.runtime, self.name, writer))

    def _end_held(self, held: _hanging.OpenTransaction, *, truth: int | None) -> None:
        """End a transaction that outlived the fencing, or raise ``TransactionHeldError``."""
        prefix = epoch_key(self.runtime, self.name)
        outcome = _hanging.end_if_proven(self.settings, held, prefix=prefix, truth=truth)
        if outcome is None:
            raise TransactionHeldError(
                f"the progress of sink {self.name!r} cannot be read: "
                f"{held.describe(prefix, self.settings.bootstrap_servers)}. raysink ends "
                "such a transaction itself only where its outcome is proven (every record "
                "it holds is this sink's progress of a committed epoch), or once it is "
                "older than the broker's transaction.max.timeout.ms and not this sink's",
                held=held.as_dict(), **self._where())
        log.warning("kafka sink %s/%s: wrote a %s marker for the hanging transaction of "
                    "producer %s on %s[%s] from offset %s (open %.0f s)", self.runtime,
                    self.name, outcome.upper(), held.producer_id, held.topic, held.partition,
                    held.first_offset, held.age_seconds or 0.0)

    def _unblock_progress(self, epoch: int) -> None:
        """A commit's strict read of the progress topic was held back: fence and end what
        holds it where proven (every epoch before ``epoch`` is committed: a sink commits
        its epochs in order), else raise ``TransactionHeldError``."""
        held = self._open_on_progress()
        if held is None:
            return
        self._fence_holder(held)
        held = self._open_on_progress()
        if held is not None:
            self._end_held(held, truth=epoch - 1)

    def epoch_record(self, epoch: int, attempt: int) -> bytes:
        """The epoch record's value: with the id of the decision being committed
        (``decision_id`` of its manifests), which ``holds_decision`` compares."""
        decision = self._decision
        if decision is None or decision[0] != epoch:
            return record_value(epoch, attempt)
        return record_value(epoch, attempt, decision=decision[1])

    def holds_decision(self, epoch: int, manifests: Sequence[Manifest]) -> bool | None:
        """Whether the epoch record of ``epoch`` names this decision (``decision``): the
        coordinator asks after a commit was skipped because the record holds the epoch,
        e.g. its predecessor died after the epoch record and before recording the
        commit, so the report counts the epoch's rows, not ``skipped``. ``None`` when the
        record is past ``epoch`` (compaction keeps the newest only) or names no decision
        (written by a release before it did, or re-created for a lost marker)."""
        self._committed_recently()
        record = self.progress().latest.get(epoch_key(self.runtime, self.name))
        if record is None or int(record["epoch"]) != epoch or "decision" not in record:
            return None
        return bool(record["decision"] == decision_id(epoch, manifests))

    def partly_committed(self) -> tuple[int, tuple[int, ...]] | None:
        """An epoch above the epoch record that writers' part records say is partly in
        the data topic, and those writers. A writer commits its own part (with its part
        record) before the committer commits the epoch record, so a commit cut in between
        leaves the epoch partly visible; the coordinator's alignment then refuses to
        decide that epoch again without the meta store that decided it
        (``raysink.coordinator.markers``): a new decision would write those parts twice.

        Read to the partition's end (``strict``, ``_read_to_end``)."""
        if not self.topics().exists(self.settings.progress_topic):
            return None
        prefix = epoch_key(self.runtime, self.name)
        latest = self._read_to_end()
        record = latest.get(prefix)
        done = None if record is None else int(record["epoch"])
        above: dict[int, int] = {}
        for key, value in latest.items():
            writer = key.removeprefix(prefix + ":w")
            if key != prefix and writer.isdigit() and (done is None
                                                       or int(value["epoch"]) > done):
                above[int(writer)] = int(value["epoch"])
        if not above:
            return None
        epoch = max(above.values())
        return epoch, tuple(sorted(w for w, e in above.items() if e == epoch))

    def _read_to_end(self) -> dict[str, dict[str, Any]]:
        """The progress records, read to the partition's end (``strict``). A committer
        that died mid-commit leaves its epoch record in a transaction open until
        ``transaction_timeout``, and ``read_committed`` readers stop there, before the
        part records written after it. So when a short read (``_PROBE`` seconds, longer
        than a commit's epoch record is normally open) cannot get to the end, the
        committer is taken over, which fences that committer and aborts its transaction,
        and the partition is read again. Not taken over at once: a live committer of a
        second runtime of the name would be fenced by a start that alignment may refuse
        anyway, stopping the runtime that was running for nothing."""
        if not self._taken_over():
            settings = dataclasses.replace(self.settings,
                                           timeout=min(_PROBE, self.settings.timeout))
            probe = ProgressReader(settings, self.runtime, self.name)
            try:
                return dict(probe.read(strict=True))
            except SinkUnavailableError as exc:
                log.info("kafka sink %s/%s: progress topic held back (%s); taking the "
                         "committer over", self.runtime, self.name, exc)
            finally:
                probe.close()
            self._take_over()
        return self.progress().read(strict=True)

    def target_exists(self) -> bool:
        """Whether the data topic exists."""
        return self.topics().exists(self.settings.topic)

    def recreate_marker(self, epoch: int) -> None:
        """Write the epoch record again (the progress topic was deleted; nothing pending)."""
        topics = self.topics()
        if not topics.exists(self.settings.progress_topic):
            topics.create_progress()
        self.progress().reset()
        self.end_committer_transaction(self._begin(epoch, 0), epoch)
        log.info("kafka sink %s/%s: progress record re-created at epoch %d", self.runtime,
                 self.name, epoch)

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
            self._reader = None
        if self._committer is not None:
            self._committer.close()
            self._committer = None
        self._topics = None
