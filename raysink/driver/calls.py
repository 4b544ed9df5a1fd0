"""Driver-side calls to the runtime's actors, so that only raysink errors reach the user.

``get`` is ``ray.get`` that re-raises a raysink error raised in an actor as itself (not
wrapped in Ray's ``RayTaskError``); ``result`` and ``results`` send typed calls
(``raysink.protocol.clients``) and ``get`` their answers. ``ask`` sends an idempotent call and waits
while its actor restarts (Ray answers ``ActorUnavailableError`` meanwhile), up to a
deadline, then raises ``RuntimeUnavailableError`` with the Ray error as its cause.
``typed_errors`` guards a public method: any other failure leaves it as the given raysink
error, again with the original as its cause; ``public_error`` is that translation for the
doors that are not a runtime's methods (feeds, epoch handles, the datasink's hooks):
an actor that cannot be reached is ``RuntimeUnavailableError``, a remote raysink error is
itself, anything else (a bug in an actor or a sink) the door's own kind. ``unreachable``
tells the first (worth waiting and asking again) from the rest (the same call fails the
same way again: never retried).

Not waiting for Ray's failure detector: a call to an actor whose node was lost may hang
(no answer and no error) until Ray declares the node dead, 15-20 s later or more. So
``ask`` with ``heal`` waits in slices of ``PROBE_EVERY`` seconds and heals between them
(``ActorSet.heal`` replaces an actor that does not answer a short ping, then the call is
sent again to its replacement), and ``get`` inside ``watched(probe, quick)`` (the epoch
driver feeding an attempt) calls ``quick`` with the calls still out every ``QUICK_EVERY``
seconds and ``probe`` every ``PROBE_EVERY``; either raises when an actor stopped answering
(``quick``: one the calls went to lost its process), so the attempt fails at once and is
recovered. Ray itself fails a call to an actor whose process ended only after waiting for
the details of its end (over a second), and a call to a lost node later still.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol, TypeVar, cast

from raysink.errors import RaySinkError, RuntimeUnavailableError
from raysink.protocol.clients import Call

__all__ = ["PROBE_EVERY", "QUICK_EVERY", "ask", "get", "public_error", "result", "results",
           "short", "typed_errors", "unreachable", "watched"]

log = logging.getLogger(__name__)

R = TypeVar("R")

_RETRY_SLEEP = 0.2

PROBE_EVERY = 1.0
"""Seconds a call may go unanswered before the actors are probed (then again each time)."""
QUICK_EVERY = 0.25
"""Seconds between quick checks of the calls a ``watched`` wait is for."""

_watch = threading.local()


@contextlib.contextmanager
def watched(probe: Callable[[], Any],
            quick: Callable[[list[Any]], Any] | None = None) -> Iterator[None]:
    """Within the block, ``get`` without a timeout (in this thread) calls ``probe`` each
    ``PROBE_EVERY`` seconds it waits, and ``quick`` with the refs still out each
    ``QUICK_EVERY`` seconds; either raises to end the wait."""
    previous = getattr(_watch, "checks", None)
    _watch.checks = (probe, quick)
    try:
        yield
    finally:
        _watch.checks = previous


def get(refs: Any, timeout: float | None = None) -> Any:
    """``ray.get`` that re-raises raysink errors as themselves, not wrapped (Ray's error,
    with the remote traceback, their cause)."""
    import ray
    from ray.exceptions import RayTaskError

    checks = getattr(_watch, "checks", None)
    if checks is not None and timeout is None:
        _wait_probing(refs, checks)
    try:
        return ray.get(refs, timeout=timeout)
    except RayTaskError as exc:
        cause = getattr(exc, "cause", None)
        if isinstance(cause, RaySinkError):
            raise cause from exc  # Ray's error (the remote traceback) as its cause
        raise


def _wait_probing(refs: Any, checks: tuple[Callable[[], Any],
                                          Callable[[list[Any]], Any] | None]) -> None:
    """Wait until every ref is ready, calling the quick check between slices of waiting
    and the probe every ``PROBE_EVERY`` seconds."""
    import ray

    probe, quick = checks
    pending = list(dict.fromkeys(refs if isinstance(refs, list) else [refs]))
    probe_at = time.monotonic() + PROBE_EVERY
    while pending:
        _, pending = ray.wait(pending, num_returns=len(pending), fetch_local=False,
                              timeout=PROBE_EVERY if quick is None else QUICK_EVERY)
        if not pending:
            return
        if quick is not None:
            quick(pending)
        if time.monotonic() >= probe_at:
            probe()
            probe_at = time.monotonic() + PROBE_EVERY


class _Replaced(Exception):
    """``heal`` replaced an actor while a call waited: send the call again."""


def _await_healing(ref: Any, deadline: float, heal: Callable[[], Any]) -> Any:
    """``get(ref)`` up to ``deadline``, healing between slices; ``_Replaced`` when the
    heal replaced an actor (the call may have gone to the old one)."""
    import ray
    from ray.exceptions import GetTimeoutError

    while True:
        left = deadline - time.monotonic()
        ready, _ = ray.wait([ref], timeout=max(0.0, min(PROBE_EVERY, left)),
                            fetch_local=False)
        if ready:
            return get(ref)
        if left <= PROBE_EVERY:
            raise GetTimeoutError(f"no answer within the deadline ({ref})")
        if heal():
            raise _Replaced


def result(call: Call[R], timeout: float | None = None) -> R:
    """Send ``call`` and wait for its answer (``get``)."""
    return cast(R, get(call.send(), timeout=timeout))


def results(calls: Iterable[Call[R]], timeout: float | None = None) -> list[R]:
    """Send every call at once, then wait for all their answers, in order (``get``)."""
    return cast(list[R], get([c.send() for c in calls], timeout=timeout))


def ask(call: Call[R], *, what: str, timeout: float, runtime: str,
        heal: Callable[[], Any] | None = None) -> R:
    """Send ``call`` (one idempotent actor call) and return its answer,
    sending it again while the actor restarts, up to ``timeout`` seconds. With ``heal``
    (``ActorSet.heal``: it replaces an actor that does not answer a short ping and
    returns what it replaced), a call unanswered for ``PROBE_EVERY`` seconds, or an actor
    restarting or gone, heals, and the call is sent again to the current actor."""
    from ray.exceptions import ActorDiedError, ActorUnavailableError, GetTimeoutError

    deadline = time.monotonic() + timeout
    while True:
        try:
            if heal is None:
                return cast(R, get(call.send(),
                                   timeout=max(0.1, deadline - time.monotonic())))
            return cast(R, _await_healing(call.send(), deadline, heal))
        except _Replaced:
            log.info("%s: %s: an actor was replaced; asking again", runtime, what)
        except ActorUnavailableError as exc:
            if time.monotonic() >= deadline:
                raise RuntimeUnavailableError(
                    f"{what}: the actor was still restarting after {timeout:.0f}s",
                    runtime=runtime) from exc
            log.debug("%s: %s: actor restarting; asking again", runtime, what)
            if heal is None or not heal():
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


def unreachable(exc: BaseException) -> bool:
    """Whether ``exc`` says an actor could not be reached (gone, restarting, or no answer
    in time): asking again, or another actor, may go through. A task error (the actor ran
    the call and it raised) is deterministic: the same call fails the same way."""
    from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError

    return isinstance(exc, (RayActorError, ActorUnavailableError, GetTimeoutError))


def public_error(exc: BaseException, *, what: str, runtime: str | None,
                 kind: type[RaySinkError] = RaySinkError, epoch: int | None = None,
                 then: str = "") -> RaySinkError:
    """The raysink error a public call raises for ``exc`` (raise it ``from exc``): a
    raysink error as itself (unwrapped from Ray's ``RayTaskError``); an actor that could
    not be reached, ``RuntimeUnavailableError``; anything else ``kind`` naming ``what``
    failed, as a fault to report. ``then`` says what to do next."""
    if isinstance(exc, RaySinkError):
        return exc
    cause = getattr(exc, "cause", None)
    if isinstance(cause, RaySinkError):
        return cause
    tail = f"; {then}" if then else ""
    if unreachable(exc):
        return RuntimeUnavailableError(
            f"{what}: an actor of the runtime could not be reached ({short(exc)}): it is "
            f"gone or restarting; check that the runtime is open (rt.status()){tail}",
            runtime=runtime, epoch=epoch)
    return kind(f"{what} failed: {short(exc)}; this is not a fault of your data or of the "
                f"runtime's state: report it with the traceback{tail}",
                runtime=runtime, epoch=epoch)


def short(exc: BaseException | None) -> str:
    """One line naming the error (the remote error itself for a Ray task error)."""
    if exc is None:
        return "unknown"
    cause = getattr(exc, "cause", None)
    if isinstance(cause, BaseException) and cause is not exc:
        exc = cause
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:500]
