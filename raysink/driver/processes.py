"""What runs where: a runtime's actors and their processes, as ``ActorProcess`` reports.

``rt.processes()`` asks the actors the driver holds (``runtime_processes``); ``raysink
status NAME --processes`` asks those it finds by name in the Ray cluster it joins
(``find_processes``). Each actor answers ``process()`` itself (its node, its pid; a writer
adds its mailbox's state), a writer in its control group, so it answers while it writes
or waits at a barrier. All are asked at once; one that does not answer within the wait
(Ray is restarting it, or its node is lost) is listed by its name alone. Nothing is
replaced or healed here: this is a view.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from raysink.driver.lifecycle import ActorSet
from raysink.driver.remote import role_of
from raysink.protocol.clients import Call, CoordinatorClient, WriterClient
from raysink.reports import ActorProcess
from raysink.writer.writer import NAMESPACE

__all__ = ["find_processes", "runtime_processes"]

log = logging.getLogger(__name__)

_ORDER = {"coordinator": 0, "standby": 1, "writer": 2}


def runtime_processes(actors: ActorSet, timeout: float) -> list[ActorProcess]:
    """The processes of ``actors`` (each asked once, for up to ``timeout`` seconds)."""
    return _gather(actors.runtime, actors.named(), timeout)


def find_processes(runtime: str, timeout: float) -> list[ActorProcess]:
    """The processes of ``runtime``'s actors live in the Ray cluster this process is
    connected to, found by their names in the ``raysink`` namespace."""
    import ray

    handles: dict[str, Any] = {}
    for entry in ray.util.list_named_actors(all_namespaces=True):
        name = entry["name"]
        if entry["namespace"] != NAMESPACE or role_of(runtime, name) is None:
            continue
        try:
            handles[name] = ray.get_actor(name, namespace=NAMESPACE)
        except ValueError:  # gone meanwhile
            continue
    return _gather(runtime, handles, timeout)


def _gather(runtime: str, handles: Mapping[str, Any], timeout: float) -> list[ActorProcess]:
    """Ask every actor of ``handles`` (by name) at once; coordinator first, then the
    standby, then the writers by sink and index."""
    import ray

    refs: dict[str, Any] = {}
    for name, handle in handles.items():
        try:
            refs[name] = _call(runtime, name, handle).send()
        except Exception as exc:  # its queue of calls is full, or it is gone
            log.debug("process of %s: %s", name, exc)
    ready: set[Any] = set()
    if refs:
        ready = set(ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout)[0])
    found = [_answer(refs[name]) if refs.get(name) in ready else None for name in handles]
    processes = [answer or _unanswered(runtime, name)
                 for name, answer in zip(handles, found, strict=True)]
    return sorted(processes, key=lambda p: (_ORDER[p.role], p.sink or "", p.writer or 0,
                                            p.name))


def _call(runtime: str, name: str, handle: Any) -> Call[ActorProcess]:
    role = role_of(runtime, name)
    if role is not None and role[0] == "writer":
        return WriterClient(handle).process()
    return CoordinatorClient.of(handle).process()


def _answer(ref: Any) -> ActorProcess | None:
    import ray

    try:
        answer: ActorProcess = ray.get(ref, timeout=0)
    except Exception as exc:  # it failed the call: restarting, or dead
        log.debug("process: %s", exc)
        return None
    return answer


def _unanswered(runtime: str, name: str) -> ActorProcess:
    role, sink, writer = role_of(runtime, name) or ("writer", None, None)
    return ActorProcess(role=role, name=name, sink=sink, writer=writer)
