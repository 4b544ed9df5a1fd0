"""Running one epoch from the driver: feed it, have it decided and committed, recover.

::

    [open_epoch]            only when the next epoch's number and attempt are not known
    write * n, barrier * k  the data with a credit window, then a barrier to each writer
                            that received data (its answer carries its commit request)
    commit_epoch            every writer's request in one call; the coordinator decides
                            (PENDING, with the OPEN of an epoch not opened first) and
                            answers once every sink made the epoch visible

After any failure the driver asks the coordinator to ``resolve`` the attempt and feeds it
again only when it was aborted (after a CANCEL barrier to every writer), up to
``max_attempts`` attempts; a decided attempt rolls forward. Bad data
(``SchemaMismatchError``) is never fed again.

A writer Ray is restarting (its process ended) or that is still starting (a replacement)
holds nothing of the attempt: its CANCEL is sent but not waited for (the next attempt's
number makes the old one stale there anyway). An epoch without a routing key is fed
around such writers (they are idle in the attempt, the driver answers for them); a keyed
epoch waits until they answer, since a call sent while Ray restarts an actor fails once
it is back.
"""

from __future__ import annotations

import contextlib
import logging
import random
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from raysink.driver import routing
from raysink.driver.calls import ask, get, result, short
from raysink.driver.lifecycle import ActorSet
from raysink.errors import (
    EpochFailedError,
    RescaleRefusedError,
    RuntimeUnavailableError,
    SchemaMismatchError,
)
from raysink.progress import Progress
from raysink.protocol.barrier import BarrierFlags, CheckpointBarrier
from raysink.protocol.clients import Call
from raysink.protocol.messages import BarrierAck, CommitRequest, CommitWait, OpenedEpoch
from raysink.reports import EpochReport

__all__ = ["EpochDriver", "EpochSettings"]

log = logging.getLogger(__name__)
R = TypeVar("R")


class EpochSettings:
    """What the driver needs of the runtime's options."""

    def __init__(self, *, max_attempts: int, commit_timeout: float, credits: int) -> None:
        self.max_attempts = max_attempts
        self.commit_timeout = commit_timeout
        self.credits = credits


class EpochDriver:
    """Runs a runtime's epochs, one at a time, from its driver process. ``sinks``: how many
    sinks each writer index feeds (rows are counted once, not per sink)."""

    def __init__(self, name: str, options: EpochSettings, *, sinks: int,
                 progress: Progress | None) -> None:
        self.name = name
        self._options = options
        self.sinks = max(sinks, 1)
        self._progress = progress
        self._checkpoint_id = 0
        self._inflight: list[Any] = []
        self._unsettled: list[Any] = []  # calls of failed attempts not ended yet
        self.shuffle: random.Random | None = None  # tests: deliver writes out of order
        # the epoch the coordinator would open next with its attempt, when known (the one
        # after the epoch just committed), and the coordinator generation that said so:
        # its open then travels with its commit requests
        self._predicted: tuple[int, int, int] | None = None
        # epochs running now, and whether a rescale holds them off (``exclusive``)
        self._gate = threading.Condition()
        self._running = 0
        self._exclusive = False

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """No epoch runs within the block (``rt.rescale``): ``RescaleRefusedError`` when one
        is running (being fed, committed or recovered); an epoch started meanwhile waits
        until the block ends."""
        with self._gate:
            if self._running or self._exclusive:
                raise RescaleRefusedError(
                    "an epoch is being written (or recovered): rescale between epochs",
                    retry_after=1.0, runtime=self.name)
            self._exclusive = True
        try:
            yield
        finally:
            with self._gate:
                self._exclusive = False
                self._gate.notify_all()

    @contextlib.contextmanager
    def _epoch_running(self) -> Iterator[None]:
        with self._gate:
            while self._exclusive:
                self._gate.wait()
            self._running += 1
        try:
            yield
        finally:
            with self._gate:
                self._running -= 1

    def next_checkpoint(self) -> int:
        self._checkpoint_id += 1
        return self._checkpoint_id

    def run(self, actors: ActorSet, epoch: int | None,
            plan: routing.FeedPlan) -> EpochReport:
        """Feed one epoch and have it committed; after a failure resolve it, and re-feed
        an aborted attempt (up to ``max_attempts``).

        The epoch after the one just committed is not opened first: its first attempt is
        known, so the data goes at once and the open travels with the commit requests
        (one meta store transaction records both). Any other epoch is opened first."""
        with self._epoch_running():
            report = self._run(actors, epoch, plan)
        actors.tend_standby()
        return report

    def _run(self, actors: ActorSet, epoch: int | None,
             plan: routing.FeedPlan) -> EpochReport:
        started = time.monotonic()
        requested = epoch
        last_error: BaseException | None = None
        for attempt_no in range(1, self._options.max_attempts + 1):
            predicted, next_attempt, generation = self._predicted or (None, 0, None)
            known: int | None = None  # every epoch up to it is committed everywhere
            if predicted is not None and requested in (None, predicted):
                # predicted from the previous epoch's answer: it committed everywhere
                epoch, attempt, known = predicted, next_attempt, predicted - 1
            else:
                decision = self._open_epoch(actors, requested)
                if decision.skip:
                    self._predicted = None
                    return self._report(decision.epoch, 0, True, True,
                                        decision.skipped_sinks, attempt_no - 1, started)
                epoch, attempt, generation = decision.epoch, decision.attempt, None
                known = decision.committed_through
            self._predicted = None
            try:
                rows, outcome = self._feed_and_commit(actors, epoch, attempt, plan,
                                                      generation, known)
            except SchemaMismatchError:
                self._abandon(actors, epoch, attempt)
                raise
            except Exception as exc:
                last_error = exc
                log.warning("%s: epoch %s attempt %s failed: %s", self.name, epoch, attempt,
                            short(exc))
                log.debug("%s: epoch %s attempt %s failed", self.name, epoch, attempt,
                          exc_info=exc)
                if self._recover_epoch(actors, epoch, attempt):
                    outcome = self._committed(actors, epoch)
                    return self._visible(epoch, plan.rows or 0, attempt_no, started, outcome)
                plan.renew()
                requested = epoch
                continue
            if outcome.committed:
                self._predicted = (epoch + 1, outcome.next_attempt, outcome.generation)
            return self._visible(epoch, rows, attempt_no, started, outcome)
        raise EpochFailedError(
            f"epoch {epoch} failed {self._options.max_attempts} times; last error: "
            f"{short(last_error)}. The data is not committed; fix the cause and write the "
            "epoch again", attempts=self._options.max_attempts, runtime=self.name,
            epoch=epoch) from last_error

    def commit_fed(self, actors: ActorSet, epoch: int, attempt: int,
                   seal: Callable[[], routing.Barriers], started: float) -> EpochReport:
        """Commit an attempt its producers fed (``EpochHandle``): ``seal`` sends the
        writers' seals. After a failure the attempt is resolved: a decided one rolls
        forward; else it was given up at the writers and ``EpochFailedError`` says to feed
        the epoch again (the producers' data is not here to re-send)."""
        try:
            with actors.watching():  # an actor that stops answering fails the attempt
                rows, outcome = self.commit_barriers(actors, epoch, attempt, seal())
        except SchemaMismatchError:
            self._abandon(actors, epoch, attempt)
            raise
        except Exception as exc:
            log.warning("%s: epoch %s attempt %s failed: %s", self.name, epoch, attempt,
                        short(exc))
            if self._recover_epoch(actors, epoch, attempt):
                return self.settled(actors, epoch, started)
            raise EpochFailedError(
                f"epoch {epoch} attempt {attempt} failed: {short(exc)}. Nothing of it is "
                f"visible; open epoch {epoch} again and feed it again", attempts=1,
                runtime=self.name, epoch=epoch) from exc
        if outcome.committed:
            self._predicted = (epoch + 1, outcome.next_attempt, outcome.generation)
        return self._visible(epoch, rows, 1, started, outcome)

    def recover_attempt(self, actors: ActorSet, epoch: int, attempt: int) -> bool:
        """After a failure: True when the attempt was decided (it rolls forward); else it
        was given up everywhere."""
        return self._recover_epoch(actors, epoch, attempt)

    def settled(self, actors: ActorSet, epoch: int, started: float) -> EpochReport:
        """The report of a decided epoch, once visible (or ``commit_timeout``)."""
        return self._visible(epoch, 0, 1, started, self._committed(actors, epoch))

    def visible(self, epoch: int, rows: int, started: float,
                outcome: CommitWait) -> EpochReport:
        return self._visible(epoch, rows, 1, started, outcome)

    def give_up(self, actors: ActorSet, epoch: int, attempt: int) -> None:
        """Abort an attempt its producers fed: nothing of it becomes visible (unless the
        coordinator decided it meanwhile: see ``_abandon``)."""
        self._abandon(actors, epoch, attempt)

    def open(self, actors: ActorSet, epoch: int | None) -> OpenedEpoch:
        """Open an epoch for producers (``EpochHandle``): always opened first, once
        every writer Ray is restarting answers and one ended for good is replaced (the
        producers' calls would fail)."""
        self._predicted = None
        actors.ready_for_producers(timeout=self._options.commit_timeout)
        return self._open_epoch(actors, epoch)

    def skipped(self, epoch: int, skipped_sinks: tuple[str, ...],
                started: float) -> EpochReport:
        return self._report(epoch, 0, True, True, skipped_sinks, 0, started)

    def _open_epoch(self, actors: ActorSet, epoch: int | None) -> OpenedEpoch:
        """Open at the coordinator; a coordinator lost meanwhile is waited for (restarting)
        or re-created, and asked again (its successor aborted the half-opened attempt
        while recovering). The open itself may wait up to ``commit_timeout`` under
        backpressure, so the deadline is twice that."""
        decision: OpenedEpoch = self._ask(
            actors, "opening an epoch",
            actors.coordinator_client.open_epoch(epoch, self._options.commit_timeout),
            timeout=2 * self._options.commit_timeout)
        return decision

    def _feed_and_commit(self, actors: ActorSet, epoch: int, attempt: int,
                         plan: routing.FeedPlan, generation: int | None = None,
                         committed_through: int | None = None) -> tuple[int, CommitWait]:
        """Send the data and the barriers; gather every writer's commit request from its
        barrier answer and send them to the coordinator in one call, which decides the
        attempt and answers once every sink made it visible (or ``commit_timeout``).
        Returns the rows and that answer. ``committed_through`` goes with the barriers
        (``routing.send``)."""
        with actors.watching():  # an actor that stops answering fails the attempt at once
            return self._feed_and_commit_watched(actors, epoch, attempt, plan, generation,
                                                 committed_through)

    def _feed_and_commit_watched(self, actors: ActorSet, epoch: int, attempt: int,
                                 plan: routing.FeedPlan, generation: int | None,
                                 committed_through: int | None
                                 ) -> tuple[int, CommitWait]:
        progress = self._progress
        on_rows = None if progress is None else (lambda rows: progress.advance(rows=rows))
        barriers = routing.send(epoch=epoch, attempt=attempt, plan=plan, writers=actors.writers,
                              credits=self._options.credits, checkpoint_id=self.next_checkpoint(),
                              shuffle=self.shuffle, on_rows=on_rows,
                              avoid=self._starting_writers(actors, plan),
                              committed_through=committed_through)
        return self.commit_barriers(actors, epoch, attempt, barriers, generation)

    def commit_barriers(self, actors: ActorSet, epoch: int, attempt: int,
                        barriers: routing.Barriers, generation: int | None = None
                        ) -> tuple[int, CommitWait]:
        """Gather the writers' barrier answers (bad data wins over other failures) and
        the driver's answers for idle writers; send them to the coordinator in one call.
        Returns the rows and its answer."""
        self._inflight = barriers.refs
        try:
            acks: list[BarrierAck] = get(barriers.refs)
        except Exception as exc:
            from ray.exceptions import RayActorError

            # an actor lost: its barrier may not end before Ray declares its node dead,
            # so only the answers already in are looked at (bad data shows again in the
            # next attempt)
            lost = isinstance(exc, RuntimeUnavailableError | RayActorError)
            bad = self._bad_data_among(barriers.refs, timeout=0.0 if lost else 5.0)
            if bad is not None and bad is not exc:
                raise bad from exc
            raise
        self._inflight = []
        log.debug("%s: epoch %s attempt %s: every barrier answered", self.name, epoch, attempt)
        requests = [ack.request for ack in acks] + [
            CommitRequest(sink=sink, writer=k, epoch=epoch, attempt=attempt, manifest=None)
            for sink, k in barriers.idle]
        outcome: CommitWait = result(actors.coordinator_client.commit_epoch(
            epoch, attempt, requests, self._options.commit_timeout, generation))
        rows = sum(ack.rows for ack in acks) // max(self.sinks, 1)
        return rows, outcome

    def _starting_writers(self, actors: ActorSet, plan: routing.FeedPlan) -> frozenset[int]:
        """The writers to feed around: those Ray is still (re)starting, for a movable plan
        while another writer is up. Otherwise the attempt waits until they answer."""
        starting = actors.starting_writers()
        if not starting:
            return starting
        if plan.movable and len(starting) < actors.writer_count:
            log.info("%s: writers %s are starting; the attempt goes around them", self.name,
                     sorted(starting))
            return starting
        actors.await_writers(starting, timeout=self._options.commit_timeout)
        return frozenset()

    def _bad_data_among(self, barriers: list[Any], timeout: float
                        ) -> SchemaMismatchError | None:
        """The ``SchemaMismatchError`` one of the failed attempt's barriers raised, if any:
        ``ray.get`` of the list raises whichever failure it meets first, and bad data must
        win (retrying it cannot help)."""
        import ray

        ready, _ = ray.wait(barriers, num_returns=len(barriers), timeout=timeout)
        for ref in ready:
            try:
                get(ref)
            except SchemaMismatchError as exc:
                return exc
            except Exception as exc:  # the other failures are the coordinator's to resolve
                log.debug("%s: barrier of the failed attempt: %s", self.name, short(exc))
        return None

    def _visible(self, epoch: int, rows: int, attempts: int, started: float,
                 outcome: CommitWait) -> EpochReport:
        """The report of a decided epoch. Skipped by every sink (each held the epoch
        already, from a decision not known to be this one): ``skipped``, no rows written;
        by some: ``skipped_sinks`` names them, the rows went to the others."""
        if not outcome.committed:
            log.warning("%s: epoch %s is decided but not yet visible after %.0fs (%s); it "
                        "will roll forward", self.name, epoch, self._options.commit_timeout,
                        dict(outcome.errors))
        skipped = len(set(outcome.skipped_sinks)) >= self.sinks
        return self._report(epoch, 0 if skipped else rows, outcome.committed, skipped,
                            outcome.skipped_sinks, attempts, started)

    def _committed(self, actors: ActorSet, epoch: int) -> CommitWait:
        """Wait (up to ``commit_timeout``) for a decided epoch to be visible."""
        timeout = self._options.commit_timeout
        answer: CommitWait = self._ask(
            actors, f"waiting for epoch {epoch}",
            actors.coordinator_client.wait_committed(epoch, timeout), timeout=2 * timeout)
        return answer

    def _recover_epoch(self, actors: ActorSet, epoch: int, attempt: int) -> bool:
        """After a failure: heal the actors and resolve the attempt. True: it was decided
        (it rolls forward); False: it was aborted, swept and cancelled at the writers, so
        it may be fed again."""
        actors.metrics.attempt_failed()
        actors.heal()
        return self._resolve(actors, epoch, attempt)

    def _resolve(self, actors: ActorSet, epoch: int, attempt: int) -> bool:
        """Resolve the attempt at the coordinator. Decided (COMMITTED or ROLLING_FORWARD):
        True, and the writers keep what they pre-committed, since the decision commits it
        (a Delta or Iceberg table points at those files). Else it was aborted and swept
        there, and its CANCEL goes to every writer: False."""
        resolution = self._ask(actors, f"resolving epoch {epoch}",
                               actors.coordinator_client.resolve(epoch, attempt))
        log.debug("%s: epoch %s attempt %s resolved %s", self.name, epoch, attempt,
                  resolution)
        decided = resolution in ("COMMITTED", "ROLLING_FORWARD")
        if not decided:
            self._rollback_writers(actors, epoch, attempt)
            log.debug("%s: epoch %s attempt %s given up at every writer", self.name, epoch,
                      attempt)
        self._settle_inflight(actors)
        return decided

    def _settle_inflight(self, actors: ActorSet, timeout: float = 2.0) -> None:
        """Collect the failed attempt's barrier calls (cancelled, they end at once), so no
        error is left unobserved. A call to an actor replaced since (its node lost: it may
        end only when Ray declares the node dead) or restarting is collected at a later
        settle, never waited for."""
        import ray

        refs, self._inflight = self._inflight + self._unsettled, []
        soon, later = actors.waitable(refs)
        ready, _ = (ray.wait(soon, num_returns=len(soon), timeout=timeout) if soon
                    else ([], []))
        ready += ray.wait(later, num_returns=len(later), timeout=0)[0] if later else []
        done = set(ready)
        self._unsettled = [ref for ref in refs if ref not in done]
        for ref in ready:
            try:
                ray.get(ref)
            except Exception as exc:
                log.debug("%s: barrier of the failed attempt: %s", self.name, short(exc))

    def _abandon(self, actors: ActorSet, epoch: int, attempt: int) -> None:
        """Abort the attempt everywhere (bad data, a feed or a stream given up): nothing
        of it is written. An epoch the coordinator decided meanwhile (a stream's lost
        coordinator may have committed the attempt its driver still holds open) stays
        decided (``_resolve``)."""
        actors.metrics.attempt_failed()
        self._predicted = None
        if self._resolve(actors, epoch, attempt):
            log.info("%s: epoch %s was decided before attempt %s could be given up; it "
                     "stays decided", self.name, epoch, attempt)

    def _rollback_writers(self, actors: ActorSet, epoch: int, attempt: int) -> None:
        """The abandoned attempt's CANCEL barrier to every writer: each stops waiting for
        it and drops what it staged. Not waited for at a writer that is (re)starting: its
        new process holds nothing of the attempt (the call goes to ``_unsettled``)."""
        import ray

        cancel = CheckpointBarrier(self.next_checkpoint(), epoch, BarrierFlags.CANCEL)
        soon, later = actors.waitable([w.cancel(cancel, attempt).send()
                                       for w in actors.writer_clients()])
        self._unsettled += later
        for ref in soon:
            try:
                ray.get(ref, timeout=60)
            except Exception as exc:  # a dead writer holds nothing to roll back
                log.debug("cancel: %s", exc)

    def _report(self, epoch: int, rows: int, committed: bool, skipped: bool,
                skipped_sinks: tuple[str, ...], attempts: int, started: float) -> EpochReport:
        if self._progress is not None:
            self._progress.advance(epochs=1, skipped=int(skipped))
        return EpochReport(epoch=epoch, rows=rows, committed=committed, skipped=skipped,
                           skipped_sinks=skipped_sinks, attempts=attempts,
                           seconds=time.monotonic() - started)

    def _ask(self, actors: ActorSet, what: str, call: Call[R],
             timeout: float | None = None) -> R:
        """An idempotent call to the runtime's actors, waiting while they restart (up to
        ``commit_timeout``) and re-creating one that is gone."""
        return ask(call, what=what, runtime=self.name, heal=actors.heal,
                   timeout=self._options.commit_timeout if timeout is None else timeout)
