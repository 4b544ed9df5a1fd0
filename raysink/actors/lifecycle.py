"""Creating, checking, replacing and ending a runtime's actors.

Writers (one set per sink) and the coordinator are ordinary actors owned by the driver in
the Ray namespace ``raysink``, named ``<runtime>.coordinator`` and
``<runtime>.<sink>.writer-<i>``. They reserve no CPU unless ``actor_options`` says so, die
with the driver, and restart after a crash (``max_restarts=-1``; in-flight calls fail,
``max_task_retries=0``). An actor ended by ``ray.kill`` is re-created by ``heal``.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from raysink.actors.writer import NAMESPACE, SinkWriterActor, WriterConfig
from raysink.coordinator.coordinator import CoordinatorActor, CoordinatorConfig
from raysink.errors import RuntimeInUseError

__all__ = ["ActorSet", "coordinator_name", "writer_name"]

log = logging.getLogger(__name__)

_WRITER_GROUPS = {"data": 2, "barrier": 1, "control": 4}
_WRITER_METHOD_GROUPS = {"write": "data", "feed_barrier": "data", "barrier": "barrier",
                         "seal": "barrier"}
_WRITER_METHODS = ("write", "feed_barrier", "barrier", "seal", "cancel", "drain", "ping",
                   "status")
_NAME_RELEASE_SECONDS = 10.0


def coordinator_name(runtime: str) -> str:
    return f"{runtime}.coordinator"


def writer_name(runtime: str, sink: str, index: int) -> str:
    return f"{runtime}.{sink}.writer-{index}"


def _remote_writer_class() -> Any:
    import ray

    for method in _WRITER_METHODS:
        group = _WRITER_METHOD_GROUPS.get(method, "control")
        ray.method(concurrency_group=group)(getattr(SinkWriterActor, method))
    remote = ray.remote(concurrency_groups=_WRITER_GROUPS)  # type: ignore[call-overload]
    return remote(SinkWriterActor)


def _exists(name: str) -> bool:
    import ray

    try:
        ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        return False
    return True


def _create(name: str, make: Callable[[], Any]) -> Any:
    """``make()`` the actor; when Ray still holds the name (an actor that died in its
    constructor keeps it a while), the actor holding it: a dead one fails the next call,
    and the next heal tries again."""
    import ray
    from ray.exceptions import ActorAlreadyExistsError

    try:
        return make()
    except ActorAlreadyExistsError:
        log.warning("the name %s is still taken; using the actor that holds it", name)
        return ray.get_actor(name, namespace=NAMESPACE)


@dataclass(kw_only=True)
class ActorSet:
    """The coordinator and writers of one runtime, with what re-creating them needs."""

    coordinator_config: CoordinatorConfig
    writer_configs: dict[str, list[WriterConfig]]
    options: Mapping[str, Any] = field(default_factory=dict)
    max_pending_calls: int = 64
    coordinator: Any = None
    writers: dict[str, list[Any]] = field(default_factory=dict)

    @property
    def runtime(self) -> str:
        return self.coordinator_config.runtime

    def names(self) -> list[str]:
        return [coordinator_name(self.runtime)] + [
            writer_name(self.runtime, c.sink_name, c.writer_id)
            for configs in self.writer_configs.values() for c in configs]

    def refuse_if_live(self) -> None:
        for name in self.names():
            if _exists(name):
                raise RuntimeInUseError(
                    f"an actor named {name!r} is live in this Ray cluster: the runtime is open "
                    "in another driver. Close it there, or pick another runtime name",
                    runtime=self.runtime)

    def start(self) -> None:
        self.refuse_if_live()
        self.coordinator = self._new_coordinator()
        self.writers = {sink: [self._new_writer(c) for c in configs]
                        for sink, configs in self.writer_configs.items()}

    def _base_options(self, name: str) -> dict[str, Any]:
        options: dict[str, Any] = {"num_cpus": 0, "max_restarts": -1, "max_task_retries": 0}
        options.update(self.options)
        options.update({"name": name, "namespace": NAMESPACE, "lifetime": None})
        return options

    def _new_coordinator(self) -> Any:
        import ray

        options = self._base_options(coordinator_name(self.runtime))
        options["max_concurrency"] = 1000
        return ray.remote(CoordinatorActor).options(**options).remote(self.coordinator_config)

    def _new_writer(self, config: WriterConfig) -> Any:
        options = self._base_options(writer_name(self.runtime, config.sink_name,
                                                 config.writer_id))
        options["max_pending_calls"] = self.max_pending_calls
        return _remote_writer_class().options(**options).remote(config)

    def heal(self, timeout: float = 60.0) -> list[str]:
        """Wait for restarting actors; re-create killed ones. Returns what was re-created."""
        replaced: list[str] = []
        if not self._alive(self.coordinator, timeout):
            self._await_name_free(coordinator_name(self.runtime))
            self.coordinator = _create(coordinator_name(self.runtime), self._new_coordinator)
            replaced.append(coordinator_name(self.runtime))
        for sink, handles in self.writers.items():
            for index, handle in enumerate(handles):
                if self._alive(handle, timeout):
                    continue
                config = self.writer_configs[sink][index]
                name = writer_name(self.runtime, sink, index)
                self._await_name_free(name)
                handles[index] = _create(name, functools.partial(self._new_writer, config))
                replaced.append(name)
        if replaced:
            log.warning("%s: re-created actors %s", self.runtime, replaced)
        return replaced

    @staticmethod
    def _alive(handle: Any, timeout: float) -> bool:
        """False when the actor is dead for good; waits while Ray restarts it."""
        import ray
        from ray.exceptions import ActorDiedError, ActorUnavailableError, GetTimeoutError

        deadline = time.monotonic() + timeout
        while True:
            try:
                ray.get(handle.ping.remote(), timeout=max(1.0, deadline - time.monotonic()))
                return True
            except ActorDiedError:
                return False
            except (ActorUnavailableError, GetTimeoutError):
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.2)

    @staticmethod
    def _await_name_free(name: str) -> None:
        deadline = time.monotonic() + _NAME_RELEASE_SECONDS
        while _exists(name) and time.monotonic() < deadline:
            time.sleep(0.1)

    def coordinator_call(self, method: str, *args: Any) -> Callable[[], Any]:
        """A call of ``method`` on the coordinator, to submit (again) with ``_calls.ask``:
        it always goes to the current handle, which ``heal`` may replace."""
        return lambda: getattr(self.coordinator, method).remote(*args)

    def all_writers(self) -> list[Any]:
        return [h for handles in self.writers.values() for h in handles]

    def stop(self) -> None:
        """End every actor and wait until their names are free again. ``rt.close()``
        drains them first (the DRAIN barrier closes each sink writer; the coordinator
        closes its sinks and meta store), so ending the processes drops nothing open.
        (Ray frees the name of a killed actor at once, of one that exits on its own only
        seconds later.)"""
        import ray

        for handle in [self.coordinator, *self.all_writers()]:
            if handle is not None:
                try:
                    ray.kill(handle, no_restart=True)
                except Exception as exc:  # already gone
                    log.debug("kill: %s", exc)
        for name in self.names():
            self._await_name_free(name)
        self.coordinator = None
        self.writers = {}
