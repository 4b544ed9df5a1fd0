"""What Ray's control store (its GCS) says of the runtime's actors, read by the driver.

Ray keeps every actor's state in its GCS: ``ALIVE``; ``RESTARTING`` (its process ended and
Ray is starting a new one); ``PENDING_CREATION`` (being started); ``DEAD``. Its raylet tells
the GCS of an ended worker within a few hundred milliseconds, while the driver learns it
from its own calls only later: a call in flight fails after Ray waited for the details of
the death (1.3-1.5 s after a SIGKILL, measured here), and a call sent meanwhile is held
until the actor is back, then fails (``ActorUnavailableError``: "the actor is
restarting"). So the driver asks the GCS instead of waiting for either.

The GCS is read through Ray's developer API (``ray._private.state``). When that fails, the
answer is "nothing known" (an empty set) and the driver falls back on its calls and pings.
Nothing here calls an actor.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any, TypeVar

__all__ = ["DEAD", "RESTARTING", "STARTING", "actors_in", "keys_in", "split_calls",
           "state_of", "target_of", "targeted"]

K = TypeVar("K")

log = logging.getLogger(__name__)

RESTARTING = frozenset({"RESTARTING"})
"""An actor whose process ended; calls in flight to it are lost."""
STARTING = frozenset({"RESTARTING", "PENDING_CREATION"})
"""An actor not answering yet: being restarted, or a new one being started."""
DEAD = frozenset({"DEAD"})
"""An actor ended for good (``ray.kill``, or its restarts ran out): Ray starts no other."""


def actors_in(states: Iterable[str]) -> set[bytes]:
    """The ids (binary) of this job's actors in one of ``states`` now: one GCS request per
    state. Empty when the GCS cannot be asked."""
    try:
        import ray
        from ray._private.state import state

        job = ray.JobID.from_hex(ray.get_runtime_context().get_job_id())
        found: set[bytes] = set()
        for name in states:
            table = state.actor_table(None, job_id=job, actor_state_name=name)
            found.update(bytes.fromhex(actor) for actor in table)
        return found
    except Exception as exc:  # an older or newer Ray: fall back on calls and pings
        log.debug("actor states not available from the GCS: %s", exc)
        return set()


def state_of(handle: Any) -> str | None:
    """The state of one actor now (``None`` when the GCS cannot be asked): one request."""
    try:
        from ray._private.state import actors

        info = actors(actor_id=handle._actor_id.hex())
        return str(info["State"]) if info else None
    except Exception as exc:
        log.debug("actor state not available from the GCS: %s", exc)
        return None


def target_of(ref: Any) -> bytes | None:
    """The id (binary) of the actor a call's result ``ref`` will come from; ``None`` for
    anything else (a task's result, a ``ray.put``)."""
    try:
        actor = ref.task_id().actor_id()
    except Exception:
        return None
    return None if actor.is_nil() else bytes(actor.binary())


def keys_in(handles: Mapping[K, Any], states: Iterable[str]) -> list[K]:
    """The keys of the ``handles`` whose actor is in one of ``states`` now."""
    ids = actors_in(states)
    return [key for key, handle in handles.items() if handle._actor_id.binary() in ids]


def targeted(handles: Mapping[K, Any], refs: Iterable[Any]) -> list[K]:
    """The keys of the ``handles`` that calls ``refs`` went to."""
    targets = {target_of(ref) for ref in refs}
    return [key for key, handle in handles.items() if handle._actor_id.binary() in targets]


def split_calls(refs: list[Any], up: Iterable[Any]) -> tuple[list[Any], list[Any]]:
    """The calls to one of the actors ``up`` (handles), and the others."""
    ids = {handle._actor_id.binary() for handle in up}
    return ([ref for ref in refs if target_of(ref) in ids],
            [ref for ref in refs if target_of(ref) not in ids])
