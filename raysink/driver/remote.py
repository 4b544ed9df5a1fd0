"""How the runtime's actors are made and named in Ray: their classes as Ray actor classes
(made once per driver process), their names, and creating one under a free name.

Ray exports a class to the cluster once per job, but disassembles it again for each new
``ray.remote`` of it (about 60 ms of driver CPU per writer started, measured with 16
writers), so ``raysink.driver.lifecycle`` takes them from here. A writer's methods run in
concurrency groups: data (``write``, ``feed_barrier``), one barrier thread (``barrier``,
``seal``) and control (the rest: ``cancel``, ``drain``, ``finish``, ``ping``, ``process``).

Neither reports task events to Ray's GCS (``enable_task_events=False``, as Ray Serve does
for its replicas): a runtime makes several small actor calls per epoch and a stream's
feeds poll twice a second, and the GCS keeps each call's events (up to
``RAY_task_events_max_num_task_in_gcs``, 100,000): in a 15-minute soak of four runtimes
its memory grew from 47 to 309 MiB. The actor options a runtime is given
(``SinkRuntime(actor_options=)``) can switch them on again.
"""

from __future__ import annotations

import functools
import logging
import re
import time
from collections.abc import Callable
from typing import Any

from raysink.coordinator.coordinator import CoordinatorActor, CoordinatorConfig
from raysink.coordinator.standby import StandbyCoordinatorActor
from raysink.driver import raystate
from raysink.errors import RuntimeInUseError, RuntimeUnavailableError
from raysink.protocol.clients import CoordinatorClient
from raysink.reports import ActorRole
from raysink.writer.writer import NAMESPACE, SinkWriterActor

__all__ = [
    "await_name_free",
    "coordinator_class",
    "coordinator_name",
    "create",
    "exists",
    "find_coordinator",
    "in_use",
    "role_of",
    "take_over",
    "writer_class",
    "writer_name",
]

log = logging.getLogger(__name__)

_NAME_RELEASE_SECONDS = 10.0

_WRITER_GROUPS = {"data": 2, "barrier": 1, "control": 4}
_WRITER_METHOD_GROUPS = {"write": "data", "feed_barrier": "data", "barrier": "barrier",
                         "seal": "barrier"}
_WRITER_METHODS = ("write", "feed_barrier", "barrier", "seal", "cancel", "drain", "finish",
                   "ping", "process")


@functools.cache
def writer_class() -> Any:
    """``SinkWriterActor`` as a Ray actor class, with its concurrency groups."""
    import ray

    for method in _WRITER_METHODS:
        group = _WRITER_METHOD_GROUPS.get(method, "control")
        ray.method(concurrency_group=group)(getattr(SinkWriterActor, method))
    remote = ray.remote(concurrency_groups=_WRITER_GROUPS,  # type: ignore[call-overload]
                        enable_task_events=False)
    return remote(SinkWriterActor)


@functools.cache
def coordinator_class(standby: bool = False) -> Any:
    """``CoordinatorActor`` (``standby``: ``StandbyCoordinatorActor``) as a Ray actor class."""
    import ray

    remote = ray.remote(enable_task_events=False)  # type: ignore[call-overload]
    return remote(StandbyCoordinatorActor if standby else CoordinatorActor)


def coordinator_name(runtime: str) -> str:
    return f"{runtime}.coordinator"


def writer_name(runtime: str, sink: str, index: int) -> str:
    return f"{runtime}.{sink}.writer-{index}"


def role_of(runtime: str, name: str) -> tuple[ActorRole, str | None, int | None] | None:
    """What an actor named ``name`` is to ``runtime`` (``coordinator_name``,
    ``writer_name``, a standby's name, each maybe with an incarnation's ``.<n>``): its
    role, and a writer's sink and index; ``None`` for any other name."""
    base = re.escape(runtime)
    if re.fullmatch(rf"{base}\.coordinator(\.\d+)?", name):
        return "coordinator", None, None
    if re.fullmatch(rf"{base}\.coordinator-standby(\.\d+)?", name):
        return "standby", None, None
    writer = re.fullmatch(rf"{base}\.([A-Za-z0-9_-]+)\.writer-(\d+)(\.\d+)?", name)
    return None if writer is None else ("writer", writer[1], int(writer[2]))


def exists(name: str) -> bool:
    import ray

    try:
        ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        return False
    return True


def _name_taken(exc: ValueError) -> bool:
    """Whether Ray refused an actor's creation because another actor holds its name: an
    ``ActorAlreadyExistsError`` (a ``ValueError``) in recent Ray; before it had that class
    (Ray 2.41, raysink's oldest), a plain ``ValueError`` saying the name "is already
    taken"."""
    try:
        from ray.exceptions import ActorAlreadyExistsError
    except ImportError:
        return "is already taken" in str(exc)
    return isinstance(exc, ActorAlreadyExistsError)


def create(name: str, make: Callable[[str], Any], *, runtime: str,
            first: bool = False) -> tuple[str, Any]:
    """``make(name)`` the actor. A replacement (not ``first``) whose name Ray still holds
    (an actor that died in its constructor, or one on a lost node, may keep it a while) is
    started under the first free ``<name>.<n>``. The ``first`` incarnation never is: Ray
    registers a name atomically, so when it is taken another driver started the runtime
    at the same moment (``RuntimeInUseError``). Returns the name used and the handle."""
    for incarnation in range(64):
        candidate = name if incarnation == 0 else f"{name}.{incarnation}"
        if incarnation and exists(candidate):
            continue
        try:
            return candidate, make(candidate)
        except ValueError as exc:
            if not _name_taken(exc):
                raise
            if first:
                raise in_use(name, runtime) from exc
            log.warning("the name %s is still taken; starting the actor under another",
                        candidate)
    raise RuntimeUnavailableError(f"no free name for a new incarnation of {name}")


def find_coordinator(runtime: str, wait: float = 5.0) -> Any | None:
    """The runtime's current coordinator, for a process that lost it (a stream's
    producer): of the live actors named ``<runtime>.coordinator`` or
    ``<runtime>.coordinator.<n>`` (see ``create``), or a standby's name (one that took
    over: ``raysink.coordinator.standby``), the one that answers with the highest generation (a
    replaced one that still answers has a lower one; a standby that has not taken over
    answers 0). ``None`` when none answers within ``wait`` seconds."""
    import ray

    names = [entry["name"] for entry in ray.util.list_named_actors(all_namespaces=True)
             if entry["namespace"] == NAMESPACE and _names_coordinator(entry["name"], runtime)]
    best: tuple[int, Any] | None = None
    for name in names:
        try:
            handle = ray.get_actor(name, namespace=NAMESPACE)
            answer: Any = ray.get(CoordinatorClient.of(handle).ping().send(), timeout=wait)
            generation = int(answer)
        except Exception as exc:  # dead, or gone meanwhile
            log.debug("coordinator candidate %s: %s", name, exc)
            continue
        if generation > 0 and (best is None or generation > best[0]):
            best = (generation, handle)
    return None if best is None else best[1]


def _names_coordinator(name: str, runtime: str) -> bool:
    """``name`` is one a coordinator (or a standby) of ``runtime`` may have."""
    found = role_of(runtime, name)
    return found is not None and found[0] != "writer"


def in_use(name: str, runtime: str) -> RuntimeInUseError:
    return RuntimeInUseError(
        f"an actor named {name!r} is live in this Ray cluster: the runtime is open in "
        "another driver (one with another meta store, or none: the lease in a meta store "
        "fences only the drivers that share it). Close it there, or pick another runtime "
        "name", runtime=runtime)


def await_name_free(name: str, seconds: float = _NAME_RELEASE_SECONDS) -> None:
    deadline = time.monotonic() + seconds
    while exists(name) and time.monotonic() < deadline:
        time.sleep(0.05)


def take_over(handle: Any, config: CoordinatorConfig, *, ping_timeout: float,
              timeout: float) -> bool:
    """Make the standby the coordinator; ``False`` when it cannot be (gone, or silent
    for ``ping_timeout`` seconds: lost with its node, say). One still being started is
    waited for, up to ``timeout`` like the take-over itself."""
    import ray

    state = raystate.state_of(handle)
    if state not in ("ALIVE", "PENDING_CREATION"):
        log.info("no standby coordinator to take over (%s)", state)
        return False
    standby = CoordinatorClient.of(handle)
    try:
        if state == "ALIVE":
            ray.get(standby.ping().send(), timeout=ping_timeout)
        ray.get(standby.take_over(config).send(), timeout=timeout)
    except Exception as exc:
        log.warning("the standby coordinator could not take over (%s: %s); starting a new "
                    "coordinator", type(exc).__name__, exc)
        return False
    return True
