"""The coordinator's committer of one Kafka sink: its transactional producer (id
``<prefix>.<runtime>.<sink>.c``), the transaction it is in, and what its errors mean.

The producer is made, and the id taken over (``init_transactions``: a new coordinator
fences the one before it), at the first use in a process and after any error that ends
it. Its state: ``IDLE`` (no transaction), ``OPEN`` (one begun), ``COMMITTING`` (a
``commit_transaction`` that did not end in time, or failed retriably), ``ABORTING`` (the
same of ``abort_transaction``).

**After a commit timeout the commit is resumed, not replaced.** librdkafka keeps a
``commit_transaction`` that timed out as the call in progress: the commit goes on in the
background, every other transactional call is refused with a retriable ``_CONFLICT``
("Conflicting commit_transaction API call is already in progress"), and calling
``commit_transaction`` again waits for that same commit's outcome; it never commits
twice. So the committer's next use first calls the unfinished method again (``settle``):
a commit that then succeeds means the epoch it carried is in (``KafkaSink.commit``
reports the epoch committed without writing anything again); one that fails abortably is
aborted, and the epoch's commit runs again; a fatal one drops the producer. An abort that
timed out is resumed the same way. Replacing the producer instead would be safe too (the
new one's ``init_transactions`` completes or aborts the old transaction; writers answer
``COMMITTED`` and the progress topic answers for replayed parts), but a commit that is
slow rather than stuck (a large replay whose flush outlasts ``timeout``) would then be
thrown away at every try and never end, where a resumed one goes on from where it was.
The producer is replaced only when librdkafka says it is past saving: a fatal error, an
authorization failure, or a call refused in a state resuming does not explain
(``_STATE``, ``_CONFLICT``): that is the fallback that keeps the committer from being
stuck whatever librdkafka's state.

**Errors** (``failed``), see ``_failures``: a fencing code within 0.9 x
``transaction_timeout`` of the transaction's start is another coordinator's takeover
(``FencedError``: this one must stop); later, it is the broker aborting a transaction that
outlived ``transaction_timeout`` (``SinkUnavailableError``, a new producer at the next
try). An authorization failure names the ACL to grant; any other fatal error says what it
is; both drop the producer and are ``SinkUnavailableError``, retried with backoff.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from raysink.errors import FencedError, RaySinkError, SinkUnavailableError
from raysink.sinks.kafka._config import FatalWatch, KafkaSettings, kafka_module
from raysink.sinks.kafka._failures import error_of, is_fencing, missing_acl, named

__all__ = ["Committer"]

log = logging.getLogger("raysink.sinks.kafka")

IDLE, OPEN, COMMITTING, ABORTING = "idle", "open", "committing", "aborting"
_REFUSED_IN_STATE = ("_STATE", "_CONFLICT")


class Committer:
    """See the module docstring. Used by one thread at a time (the sink's commit lock)."""

    def __init__(self, settings: KafkaSettings, runtime: str, sink: str) -> None:
        self.settings = settings
        self.runtime, self.sink = runtime, sink
        self.txn = settings.committer_txn(runtime, sink)
        self.producer: Any = None
        self.state = IDLE
        self._watch = FatalWatch()
        self._epoch: int | None = None  # the epoch of the transaction begun last
        self._began = 0.0

    def _where(self, epoch: int | None) -> dict[str, Any]:
        return {"runtime": self.runtime or None, "sink": self.sink or None, "epoch": epoch}

    # -- the producer ------------------------------------------------------------------

    def claim(self, epoch: int | None = None) -> Any:
        """The producer, its transactional id taken over once per producer."""
        if self.producer is None:
            ck = kafka_module()
            watch = FatalWatch()
            producer = ck.Producer({**self.settings.producer_config(self.txn),
                                    "error_cb": watch})
            try:
                producer.init_transactions(self.settings.timeout)
            except ck.KafkaException as exc:
                acl = missing_acl(error_of(exc), txn=self.txn, topics=self._topics())
                raise SinkUnavailableError(
                    f"Kafka at {self.settings.bootstrap_servers}: could not take the "
                    f"committer's transactional id {self.txn!r} over: "
                    f"{acl or named(error_of(exc) or exc)}", **self._where(epoch)) from exc
            self.producer, self._watch, self.state = producer, watch, IDLE
        return self.producer

    def drop(self) -> None:
        """This producer is done: the next use makes a new one (which takes the id over,
        aborting or completing what this one left)."""
        self.producer, self.state = None, IDLE

    def close(self) -> None:
        if self.producer is not None:
            self.producer.flush(1.0)
        self.drop()

    def _topics(self) -> list[str]:
        return [self.settings.progress_topic, self.settings.topic]

    # -- the transaction ---------------------------------------------------------------

    def settle(self, epoch: int) -> int | None:
        """End what an earlier call left unfinished (see the module docstring): returns
        the epoch of a commit this resumed and that is now in; ``None`` otherwise."""
        producer = self.producer
        if producer is None or self.state == IDLE:
            return None
        ck = kafka_module()
        if self.state == COMMITTING:
            pending = self._epoch
            try:
                producer.commit_transaction(self.settings.timeout)
            except ck.KafkaException as exc:
                raise self.failed(exc, epoch, unfinished=COMMITTING) from exc
            self.state = IDLE
            log.warning("kafka sink %s/%s: the commit of epoch %s that had timed out is "
                        "complete (resumed)", self.runtime, self.sink, pending)
            return pending
        self.abort(epoch)  # OPEN (a failed commit left it) or ABORTING (timed out)
        return None

    def begin(self, epoch: int) -> Any:
        """The producer in a new transaction; an earlier one is ended first."""
        self.settle(epoch)
        producer = self.claim(epoch)
        try:
            producer.begin_transaction()
        except kafka_module().KafkaException as exc:
            raise self.failed(exc, epoch) from exc
        self.state, self._epoch, self._began = OPEN, epoch, time.monotonic()
        return producer

    def flush(self, epoch: int) -> None:
        """Everything produced in the transaction delivered; ``SinkUnavailableError``
        when not within ``timeout``."""
        try:
            left = self._watch.flush(self.producer, self.settings.timeout)
        except kafka_module().KafkaException as exc:
            raise self.failed(exc, epoch) from exc
        if left:
            raise SinkUnavailableError(f"the epoch record was not delivered in "
                                       f"{self.settings.timeout:g} s", **self._where(epoch))

    def watch_flush(self, producer: Any, timeout: float) -> int:
        """Flush in slices for up to ``timeout``; the records left. A fatal error of the
        producer meanwhile is raised (``KafkaException``): a replay's chunks use it."""
        return self._watch.flush(producer, timeout)

    def commit(self, epoch: int) -> None:
        try:
            self.producer.commit_transaction(self.settings.timeout)
        except kafka_module().KafkaException as exc:
            raise self.failed(exc, epoch, unfinished=COMMITTING) from exc
        self.state = IDLE

    def abort(self, epoch: int) -> None:
        try:
            self.producer.abort_transaction(self.settings.timeout)
        except kafka_module().KafkaException as exc:
            raise self.failed(exc, epoch, unfinished=ABORTING) from exc
        self.state = IDLE

    # -- errors ------------------------------------------------------------------------

    def failed(self, exc: Exception, epoch: int, *, unfinished: str | None = None
               ) -> RaySinkError:
        """What a client error of the committer means (see the module docstring), with
        the producer's state brought in line: ``unfinished`` is the state a retriable
        failure of the call leaves (the call is resumed at the next use)."""
        error = error_of(exc)
        acl = missing_acl(error, txn=self.txn, topics=self._topics())
        if error is None or acl is not None:
            self.drop()
            return self._unavailable(f"refused the committer ({self.txn!r})",
                                     acl or str(exc), epoch)
        if error.fatal():
            return self._fatal(error, epoch)
        if error.txn_requires_abort():
            self._abort_quietly()
            return self._unavailable("aborted the committer's transaction (the commit "
                                     "runs again)", named(error), epoch)
        if _refused_in_state(error):
            state = self.state
            self.drop()
            return self._unavailable(f"refused a call of the committer in its state "
                                     f"{state!r}; its producer is made again at the next "
                                     "try", named(error), epoch)
        if unfinished is not None and (error.retriable() or _timed_out(error)):
            self.state = unfinished
            call = "commit" if unfinished == COMMITTING else "abort"
            return self._unavailable(f"did not end the committer's {call} of epoch "
                                     f"{self._epoch} in {self.settings.timeout:g} s (it "
                                     "is resumed at the next try)", named(error), epoch)
        return self._unavailable("refused the epoch's commit", named(error), epoch)

    def _unavailable(self, what: str, detail: str, epoch: int) -> SinkUnavailableError:
        return SinkUnavailableError(f"Kafka at {self.settings.bootstrap_servers} {what}: "
                                    f"{detail}", **self._where(epoch))

    def _fatal(self, error: Any, epoch: int) -> RaySinkError:
        self.drop()
        if is_fencing(error):
            age = time.monotonic() - self._began
            if age < 0.9 * self.settings.transaction_timeout_ms / 1000:
                return self._fenced(error, epoch)
            return self._unavailable(f"aborted the committer's transaction after "
                                     f"{age:.0f} s (transaction_timeout); a new producer "
                                     "takes the id over at the next try", named(error),
                                     epoch)
        return self._unavailable(f"ended the committer's producer ({self.txn!r}) with a "
                                 "fatal error that is no fencing; a new producer takes the "
                                 "id over at the next try", named(error), epoch)

    def _fenced(self, error: Any, epoch: int) -> FencedError:
        return FencedError(
            f"the committer of sink {self.sink!r} (transactional id {self.txn!r}) was "
            "fenced: another coordinator took it over. Either a newer coordinator of this "
            f"runtime runs (this one must stop), or a second runtime named {self.runtime!r} "
            f"writes sink {self.sink!r} into topic {self.settings.topic!r}: at most one of "
            f"them commits; give each runtime its own name ({named(error)})",
            **self._where(epoch))

    def _abort_quietly(self) -> None:
        try:
            self.producer.abort_transaction(self.settings.timeout)
            self.state = IDLE
        except Exception as exc:  # past saving: a new producer at the next try
            log.info("kafka sink %s/%s: the committer's abort failed (%s); its producer "
                     "is made again", self.runtime, self.sink, exc)
            self.drop()


def _refused_in_state(error: Any) -> bool:
    ck = kafka_module()
    return bool(error.code() in {getattr(ck.KafkaError, n) for n in _REFUSED_IN_STATE})


def _timed_out(error: Any) -> bool:
    ck = kafka_module()
    return bool(error.code() in (ck.KafkaError._TIMED_OUT, ck.KafkaError._TIMED_OUT_QUEUE))
