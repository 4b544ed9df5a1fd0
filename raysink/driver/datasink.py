"""``ds.write_datasink(rt.datasink(epoch=N))``: a whole Ray Dataset as one epoch, exactly once.

The epoch is opened when the datasink is made (on the driver). Each Ray Data write task
is a producer with its own feed, numbered by the task's index (``ctx.task_idx + 1``):
it sends its blocks straight to the runtime's writers and closes its feed, returning its
id. A write task Ray Data retries has the same index, so its messages carry the same
numbers and the writers drop what they already have: nothing shows twice. When every
task is done (``on_write_complete``, on the driver) the epoch is committed over the feeds
that reported; if the write fails (``on_write_failed``) the epoch is aborted and nothing
of it is visible. Running the same job again with the same epoch writes nothing: the
epoch opens skipped, the tasks send nothing, and ``report.skipped`` says so.

``report`` holds the ``EpochReport`` once ``write_datasink`` returned.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from ray.data import Datasink
from ray.data.block import Block, BlockAccessor
from ray.exceptions import RayError

from raysink.driver.calls import public_error, short, unreachable
from raysink.driver.feed import Feed, FeedRoute
from raysink.errors import ConfigError, EpochFailedError, RaySinkError, RuntimeUnavailableError
from raysink.reports import EpochReport

if TYPE_CHECKING:
    from ray.data._internal.execution.interfaces import TaskContext
    from ray.data.datasource.datasink import WriteResult

    from raysink.driver.handle import EpochHandle

__all__ = ["EpochDatasink"]

log = logging.getLogger(__name__)


class EpochDatasink(Datasink[int]):
    """One epoch of a ``SinkRuntime``, written by a Ray Data write."""

    def __init__(self, handle: EpochHandle, route: FeedRoute) -> None:
        self._handle: EpochHandle | None = handle  # the driver's side; not pickled
        self._route = route
        self.epoch, self.attempt = handle.epoch, handle.attempt
        self._checkpoint_id = handle.checkpoint_id
        self._skip = handle.skipped
        self.report: EpochReport | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_handle"] = None
        return state

    def get_name(self) -> str:
        return f"raysink({self._route.runtime}, epoch {self.epoch})"

    def write(self, blocks: Iterable[Block], ctx: TaskContext) -> int:
        """A write task: its blocks through its own feed, then its barrier. A writer
        lost meanwhile (killed, its node gone) fails the task with ``EpochFailedError``
        saying to run the write again: what it had taken is gone with it, so this attempt
        can never commit (the feed tells the coordinator it failed)."""
        from ray.exceptions import ActorUnavailableError, RayActorError

        feed = Feed(self._route, epoch=self.epoch, attempt=self.attempt,
                    feed_id=ctx.task_idx + 1, checkpoint_id=self._checkpoint_id,
                    skip=self._skip)
        try:
            with feed:
                for block in blocks:
                    table = BlockAccessor.for_block(block).to_arrow()
                    if table.num_rows:
                        feed.write(table)
        except (RayActorError, ActorUnavailableError, RuntimeUnavailableError) as exc:
            raise EpochFailedError(
                f"a writer of the runtime was lost while write task {ctx.task_idx} fed "
                f"epoch {self.epoch} ({short(exc)}): nothing of the epoch is visible. Run "
                f"the write again: ds.write_datasink(rt.datasink(epoch={self.epoch}))",
                runtime=self._route.runtime, epoch=self.epoch) from exc
        return feed.id

    def on_write_complete(self, write_result: WriteResult[int]) -> None:
        """Every task closed its feed: commit the epoch over them (``EpochHandle.commit``
        raises raysink errors only)."""
        handle = self._driver_handle()
        self.report = handle.commit(feeds=[int(f) for f in write_result.write_returns])

    def on_write_failed(self, error: Exception) -> None:
        """The write failed for good: nothing of the epoch becomes visible. Ray Data
        raises ``error`` after this hook, Ray's own error (a ``RayTaskError`` around what a
        write task raised, an actor gone) as it is; raising here puts the raysink error
        that says what happened, and what to do, in its place (``error`` its cause)."""
        handle = self._driver_handle()
        try:
            handle.abort()
        except RaySinkError as exc:  # the write's own error says more; the abort's is logged
            log.warning("%s: giving epoch %s up after its write failed: %s",
                        self._route.runtime, self.epoch, exc)
        raise self._failed(error) from error

    def _failed(self, error: Exception) -> RaySinkError:
        """The raysink error for a write that failed with ``error``: a raysink error in
        it (a write task's, through Ray's wrappers) as itself; else what it comes down to
        (Ray Data wraps a task's error in ``UserCodeException``) in ``EpochFailedError``."""
        again = f"ds.write_datasink(rt.datasink(epoch={self.epoch}))"
        chain = _chain(error)
        own = next((e for e in chain if isinstance(e, RaySinkError)
                    and not isinstance(e, RayError)), None)
        if own is not None:
            return own
        if any(unreachable(e) for e in chain):
            return public_error(next(e for e in chain if unreachable(e)),
                                what=f"the write of epoch {self.epoch}",
                                runtime=self._route.runtime, epoch=self.epoch,
                                then=f"nothing of the epoch is visible: run {again} again")
        return EpochFailedError(
            f"the write of epoch {self.epoch} failed ({_root(chain)}): nothing of the "
            f"epoch is visible; fix the cause and run {again} again",
            runtime=self._route.runtime, epoch=self.epoch)

    def _driver_handle(self) -> EpochHandle:
        if self._handle is None:
            raise ConfigError("the datasink's commit runs on the driver that made it: "
                              "call ds.write_datasink(...) on that driver",
                              runtime=self._route.runtime, epoch=self.epoch)
        return self._handle


def _chain(error: BaseException) -> list[BaseException]:
    """``error`` and what it wraps: the causes (``__cause__``, a Ray task error's
    ``cause``), outermost first."""
    chain = [error]
    while len(chain) < 20:
        inner = getattr(chain[-1], "cause", None)
        if not isinstance(inner, BaseException):
            inner = chain[-1].__cause__
        if inner is None or inner in chain:
            return chain
        chain.append(inner)
    return chain


_RAISED = re.compile(r"^(?:[A-Za-z_][\w.]*\.)?[A-Za-z_]\w*(?:Error|Exception)(?::\s.*)?$")


def _root(chain: list[BaseException]) -> str:
    """What the failure comes down to: the first exception line in the text of the
    chain, outermost first (a task error's cause is pickled without its own causes; the
    task error's text keeps its traceback, innermost exception first), else the
    innermost error."""
    for error in chain:
        for line in str(error).splitlines():
            if _RAISED.match(line.strip()):
                return line.strip()[:500]
    return short(chain[-1])
