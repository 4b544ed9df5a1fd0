"""Driver-side calls to the runtime's actors, so that only raysink errors reach the user.

``get`` is ``ray.get`` that re-raises a raysink error raised in an actor as itself (not
wrapped in Ray's ``RayTaskError``). ``ask`` calls an idempotent actor method and waits
while its actor restarts (Ray answers ``ActorUnavailableError`` meanwhile), up to a
deadline, then raises ``RuntimeUnavailableError`` with the Ray error as its cause.
``typed_errors`` guards a public method: any other failure leaves it as the given raysink
error, again with the original as its cause.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from raysink.errors import RaySinkError, RuntimeUnavailableError

__all__ = ["ask", "get", "short", "typed_errors"]

log = logging.getLogger(__name__)

R = TypeVar("R")

_RETRY_SLEEP = 0.2


def get(refs: Any, timeout: float | None = None) -> Any:
    """``ray.get`` that re-raises raysink errors as themselves, not wrapped."""
    import ray
    from ray.exceptions import RayTaskError

    try:
        return ray.get(refs, timeout=timeout)
    except RayTaskError as exc:
        cause = getattr(exc, "cause", None)
        if isinstance(cause, RaySinkError):
            raise cause from None
        raise


def ask(make: Callable[[], Any], *, what: str, timeout: float, runtime: str,
        heal: Callable[[], Any] | None = None) -> Any:
    """Call ``make()`` (it submits one idempotent actor call) and return its result,
    sending it again while the actor restarts, up to ``timeout`` seconds. An actor gone
    for good is re-created by ``heal`` (when given) and asked again."""
    from ray.exceptions import ActorDiedError, ActorUnavailableError, GetTimeoutError

    deadline = time.monotonic() + timeout
    while True:
        try:
            return get(make(), timeout=max(0.1, deadline - time.monotonic()))
        except ActorUnavailableError as exc:
            if time.monotonic() >= deadline:
                raise RuntimeUnavailableError(
                    f"{what}: the actor was still restarting after {timeout:.0f}s",
                    runtime=runtime) from exc
            log.debug("%s: %s: actor restarting; asking again", runtime, what)
            time.sleep(_RETRY_SLEEP)
        except ActorDiedError as exc:
            if heal is None or time.monotonic() >= deadline:
                raise RuntimeUnavailableError(f"{what}: the actor is gone ({short(exc)})",
                                              runtime=runtime) from exc
            heal()
        except GetTimeoutError as exc:
            raise RuntimeUnavailableError(f"{what}: no answer within {timeout:.0f}s",
                                          runtime=runtime) from exc


class _Named(Protocol):
    name: str


S = TypeVar("S", bound=_Named)


def typed_errors(kind: type[RaySinkError], what: str) -> Callable[
        [Callable[..., R]], Callable[..., R]]:
    """Let a public method of a runtime (an object with ``name``) raise only raysink
    errors: any other exception becomes ``kind`` naming ``what`` failed, with the
    original as its cause."""
    def decorate(method: Callable[..., R]) -> Callable[..., R]:
        @functools.wraps(method)
        def guarded(self: S, *args: Any, **kwargs: Any) -> R:
            try:
                return method(self, *args, **kwargs)
            except RaySinkError:
                raise
            except Exception as exc:
                raise kind(f"{what} failed: {short(exc)}", runtime=self.name) from exc
        return guarded
    return decorate


def short(exc: BaseException | None) -> str:
    """One line naming the error (the remote error itself for a Ray task error)."""
    if exc is None:
        return "unknown"
    cause = getattr(exc, "cause", None)
    if isinstance(cause, BaseException) and cause is not exc:
        exc = cause
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:500]
