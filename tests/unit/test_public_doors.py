"""``EpochHandle.commit``/``abort`` raise raysink errors only, whatever Ray raised on the
way (no Ray cluster: the driver and the coordinator are fakes that raise Ray's errors, as
a coordinator gone for good, or one whose call raised, makes them raise): an actor that
cannot be reached is ``RuntimeUnavailableError``, a remote fault is ``EpochFailedError``
for ``commit``, the Ray error the ``__cause__`` and the message says what to do. Before,
the Ray error itself came out of both (from ``give_up`` after a failed wait for the
feeds, and from ``abort``)."""

from __future__ import annotations

from typing import Any, NoReturn

import pytest
from ray.exceptions import ActorDiedError, RayError, RayTaskError

from raysink.driver.feed import FeedRoute
from raysink.driver.handle import EpochHandle
from raysink.errors import (
    EpochFailedError,
    RaySinkError,
    RuntimeUnavailableError,
    StaleAttemptError,
)
from raysink.protocol.clients import CoordinatorClient
from raysink.protocol.messages import OpenedEpoch


def _bug() -> RayTaskError:
    return RayTaskError("resolve", "Traceback: ...", ZeroDivisionError("a bug"))


class _Driver:
    """An ``EpochDriver`` whose ``give_up`` raises ``error``."""

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def next_checkpoint(self) -> int:
        return 1

    def give_up(self, actors: Any, epoch: int, attempt: int) -> None:
        raise self.error


class _Actors:
    """An ``ActorSet`` whose coordinator's ``wait_feeds`` raises ``error``."""

    def __init__(self, error: BaseException) -> None:
        self.coordinator_client = CoordinatorClient(lambda: self)
        self.wait_feeds = _Method(error)


class _Method:
    def __init__(self, error: BaseException) -> None:
        self.error = error

    def remote(self, *args: Any) -> NoReturn:
        raise self.error


def _handle(gave_up: BaseException, waited: BaseException) -> EpochHandle:
    route = FeedRoute(runtime="rt", writers={"main": []}, coordinator=None, key=None,
                      bitmaps=(), max_batch_bytes=None, credits=1)
    return EpochHandle(_Driver(gave_up), _Actors(waited), route,  # type: ignore[arg-type]
                       OpenedEpoch(epoch=7), feed_timeout=1.0, commit_timeout=1.0)


def test_commit_with_the_coordinator_gone_raises_runtime_unavailable() -> None:
    handle = _handle(ActorDiedError(), ActorDiedError())
    handle.feed()
    with pytest.raises(RaySinkError) as failed:
        handle.commit()
    assert isinstance(failed.value, RuntimeUnavailableError), repr(failed.value)
    assert not isinstance(failed.value, RayError)
    assert isinstance(failed.value.__cause__, ActorDiedError)
    assert "whether epoch 7 was committed" in str(failed.value)


def test_commit_after_a_fault_in_the_coordinator_raises_epoch_failed() -> None:
    handle = _handle(_bug(), _bug())
    with pytest.raises(RaySinkError) as failed:
        handle.commit()
    assert isinstance(failed.value, EpochFailedError), repr(failed.value)
    assert isinstance(failed.value.__cause__, RayTaskError)
    assert "ZeroDivisionError: a bug" in str(failed.value)
    assert "open it again and feed it again" in str(failed.value)


@pytest.mark.parametrize("error", [ActorDiedError(), _bug()], ids=["gone", "fault"])
def test_abort_raises_raysink_errors_only(error: RayError) -> None:
    handle = _handle(error, error)
    with pytest.raises(RaySinkError) as failed:
        handle.abort()
    assert isinstance(failed.value, RuntimeUnavailableError), repr(failed.value)
    assert failed.value.__cause__ is error
    assert "aborting epoch 7" in str(failed.value)
    assert "rt.status()" in str(failed.value)


def test_a_remote_raysink_error_is_itself_and_only_unreachable_actors_are_retriable() -> None:
    from raysink.driver.calls import public_error, unreachable

    stale = StaleAttemptError("attempt 2 is gone", epoch=3)
    wrapped = RayTaskError("seal", "Traceback: ...", stale)
    assert public_error(wrapped, what="x", runtime="rt") is stale
    assert unreachable(ActorDiedError())
    assert not unreachable(wrapped) and not unreachable(_bug())
