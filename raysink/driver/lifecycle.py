"""Creating, checking, replacing and ending a runtime's actors.

Writers (one set per sink) and the coordinator are ordinary actors owned by the driver in
the Ray namespace ``raysink``, named ``<runtime>.coordinator`` and
``<runtime>.<sink>.writer-<i>``. They reserve no CPU unless ``actor_options`` says so and
die with the driver. Where they run: ``raysink.driver.placement`` (writers spread over the
nodes, the coordinator on the driver's node). Writers restart after a crash
(``max_restarts=-1``; in-flight calls fail, ``max_task_retries=0``). The coordinator is
not restarted by Ray: the driver re-creates it (``heal``), so a new coordinator always
starts with the current writer layout (``rescale`` changes it).

Replacing what does not answer (``heal``). Ray declares a lost node dead only after its
health checks time out (15-20 s with the defaults), and until then an actor there is
neither dead nor answering. The driver does not wait for that: every actor is pinged at
once. One whose ping fails (dead) is killed for good (``ray.kill(no_restart=True)``) and a
new incarnation is started under the same name (or ``<name>.<n>`` while Ray still holds
the name, as it may for an actor on a lost node until it declares the node dead). One that
does not answer within ``ping_timeout`` seconds is replaced only when its node does not
accept a connection to its raylet either: the node is lost, and every actor placed there is
replaced (one may still answer for a moment, its process not yet ended), on other nodes,
and placement leaves the node out for a while. Silence on a node that answers is a busy
actor, or one Ray is restarting there (in a second or two): it is left alone, since
replacing a healthy writer would fail an epoch whose producers cannot feed it again (a
Ray Data write, a feed). Then the epoch in flight is resolved and fed again to the new
actors.

Why a replaced actor that is still running somewhere (a zombie: its node cut off, not
dead) cannot get anything committed: with the gathered protocol a writer never talks to
the coordinator; its commit request reaches the coordinator only inside the driver's
``commit_epoch``, built from the answers to the barriers the driver sent to the handles it
holds now. The zombie's attempt was resolved ABORTED (recorded in the meta store, its
staging swept) before the epoch was fed again under a new attempt number, and the
coordinator refuses requests for any attempt but the open one (``StaleAttemptError``), so
the zombie's staged data is never named in a decision; what it stages after the sweep is
litter in the staging area, never visible. A replaced coordinator is fenced by the meta
store: its successor claims a new generation, and every write of an older generation
raises ``FencedError`` (its in-progress sink commit, if any, is one of a PENDING epoch,
idempotent by the target's marker).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

from raysink._metrics import DriverMetrics
from raysink.coordinator.coordinator import CoordinatorActor, CoordinatorConfig
from raysink.driver.calls import watched
from raysink.driver.placement import ClusterView, Placement, affinity, coordinator_node
from raysink.errors import RuntimeInUseError, RuntimeUnavailableError
from raysink.protocol.clients import CoordinatorClient, WriterClient
from raysink.writer.writer import NAMESPACE, SinkWriterActor, WriterConfig

__all__ = ["PING_TIMEOUT", "ActorSet", "coordinator_name", "find_coordinator", "writer_name"]

log = logging.getLogger(__name__)

_WRITER_GROUPS = {"data": 2, "barrier": 1, "control": 4}
_WRITER_METHOD_GROUPS = {"write": "data", "feed_barrier": "data", "barrier": "barrier",
                         "seal": "barrier"}
_WRITER_METHODS = ("write", "feed_barrier", "barrier", "seal", "cancel", "drain", "finish",
                   "ping", "status")
_NAME_RELEASE_SECONDS = 10.0
_REPLACE_NAME_WAIT = 0.3
PING_TIMEOUT = 1.0
"""Seconds an actor may take to answer a ping before ``heal`` replaces it."""

Key = tuple[str, int]
"""An actor of the set: ``(sink, writer index)``, or ``COORDINATOR``."""
COORDINATOR: Key = ("", -1)


def coordinator_name(runtime: str) -> str:
    return f"{runtime}.coordinator"


def writer_name(runtime: str, sink: str, index: int) -> str:
    return f"{runtime}.{sink}.writer-{index}"


@functools.cache
def _remote_writer_class() -> Any:
    """The writer as a Ray actor class, made once per process: Ray exports a class to the
    cluster once per job, but disassembles it again for each new ``ray.remote`` of it
    (about 60 ms of driver CPU per writer started, measured with 16 writers)."""
    import ray

    for method in _WRITER_METHODS:
        group = _WRITER_METHOD_GROUPS.get(method, "control")
        ray.method(concurrency_group=group)(getattr(SinkWriterActor, method))
    remote = ray.remote(concurrency_groups=_WRITER_GROUPS)  # type: ignore[call-overload]
    return remote(SinkWriterActor)


@functools.cache
def _remote_coordinator_class() -> Any:
    """The coordinator as a Ray actor class, made once per process (see the writer's)."""
    import ray

    return ray.remote(CoordinatorActor)


def _exists(name: str) -> bool:
    import ray

    try:
        ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        return False
    return True


def _create(name: str, make: Callable[[str], Any], *, runtime: str,
            first: bool = False) -> tuple[str, Any]:
    """``make(name)`` the actor. A replacement (not ``first``) whose name Ray still holds
    (an actor that died in its constructor, or one on a lost node, may keep it a while) is
    started under the first free ``<name>.<n>``. The ``first`` incarnation never is: Ray
    registers a name atomically, so when it is taken another driver started the runtime
    at the same moment (``RuntimeInUseError``). Returns the name used and the handle."""
    from ray.exceptions import ActorAlreadyExistsError

    for incarnation in range(64):
        candidate = name if incarnation == 0 else f"{name}.{incarnation}"
        if incarnation and _exists(candidate):
            continue
        try:
            return candidate, make(candidate)
        except ActorAlreadyExistsError as exc:
            if first:
                raise _in_use(name, runtime) from exc
            log.warning("the name %s is still taken; starting the actor under another",
                        candidate)
    raise RuntimeUnavailableError(f"no free name for a new incarnation of {name}")


def find_coordinator(runtime: str, wait: float = 5.0) -> Any | None:
    """The runtime's current coordinator, for a process that lost it (a stream's
    producer): of the live actors named ``<runtime>.coordinator`` or
    ``<runtime>.coordinator.<n>`` (see ``_create``), the one that answers with the highest
    generation (a replaced one that still answers has a lower one). ``None`` when none
    answers within ``wait`` seconds."""
    import ray

    base = coordinator_name(runtime)
    names = [entry["name"] for entry in ray.util.list_named_actors(all_namespaces=True)
             if entry["namespace"] == NAMESPACE and (entry["name"] == base or (
                 entry["name"].startswith(f"{base}.")
                 and entry["name"][len(base) + 1:].isdigit()))]
    best: tuple[int, Any] | None = None
    for name in names:
        try:
            handle = ray.get_actor(name, namespace=NAMESPACE)
            answer: Any = ray.get(handle.ping.remote(), timeout=wait)
            generation = int(answer)
        except Exception as exc:  # dead, or gone meanwhile
            log.debug("coordinator candidate %s: %s", name, exc)
            continue
        if best is None or generation > best[0]:
            best = (generation, handle)
    return None if best is None else best[1]


def _in_use(name: str, runtime: str) -> RuntimeInUseError:
    return RuntimeInUseError(
        f"an actor named {name!r} is live in this Ray cluster: the runtime is open in "
        "another driver (one with another meta store, or none: the lease in a meta store "
        "fences only the drivers that share it). Close it there, or pick another runtime "
        "name", runtime=runtime)


@dataclass(kw_only=True)
class ActorSet:
    """The coordinator and writers of one runtime, with what re-creating them needs.

    ``placement`` says where they may run and ``ping_timeout`` how long an actor may take
    to answer a ping before ``heal`` replaces it. ``view`` (tests) replaces the cluster
    view ``start`` makes. ``metrics``: the driver's, for this runtime."""

    coordinator_config: CoordinatorConfig
    writer_configs: dict[str, list[WriterConfig]]
    options: Mapping[str, Any] = field(default_factory=dict)
    max_pending_calls: int = 64
    placement: Placement = field(default_factory=Placement)
    ping_timeout: float = PING_TIMEOUT
    view: ClusterView | None = None
    coordinator: Any = None
    writers: dict[str, list[Any]] = field(default_factory=dict)
    _names: dict[Key, str] = field(default_factory=dict)
    _index_nodes: dict[int, str | None] = field(default_factory=dict)
    _coordinator_node: str | None = None
    _probed: tuple[float, list[Key]] | None = None
    _retired_names: list[str] = field(default_factory=list)
    # one heal at a time: a stream's ticks and the user's calls may both heal
    _healing: threading.Lock = field(default_factory=threading.Lock, repr=False)
    metrics: DriverMetrics = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.metrics = DriverMetrics(self.runtime)

    @property
    def runtime(self) -> str:
        return self.coordinator_config.runtime

    @property
    def writer_count(self) -> int:
        """Writers per sink."""
        return len(next(iter(self.writer_configs.values()), []))

    def names(self) -> list[str]:
        return [coordinator_name(self.runtime)] + [
            writer_name(self.runtime, c.sink_name, c.writer_id)
            for configs in self.writer_configs.values() for c in configs]

    def refuse_if_live(self) -> None:
        """``RuntimeInUseError`` when an actor of the runtime is live in this Ray cluster
        (a cheap check first; creating the actors checks again, atomically)."""
        for name in self.names():
            if _exists(name):
                raise _in_use(name, self.runtime)

    def start(self, timeout: float = 300.0) -> None:
        """Start the coordinator and the writers where placement puts them, and wait (up
        to ``timeout``) until each answers a ping: only actors that answered once are
        judged by ``ping_timeout`` afterwards."""
        self.refuse_if_live()
        self.view = self.view or ClusterView()
        try:
            self.coordinator = self._start_coordinator(first=True)
            self.writers = {sink: [] for sink in self.writer_configs}
            for index in range(self.writer_count):
                self._index_nodes[index] = self._choose_node(index)
                for sink in self.writer_configs:
                    self.writers[sink].append(self._start_writer(sink, index, first=True))
        except BaseException:
            self.stop()
            raise
        if self._await_answers(self._handles(), timeout):
            self.heal(timeout)  # one could not start (its node lost meanwhile, say)

    # ------------------------------------------------------------------ placement

    def node_of(self, key: Key) -> str | None:
        """The node an actor was placed on (``None``: Ray's own scheduling)."""
        return self._coordinator_node if key == COORDINATOR else self._index_nodes.get(key[1])

    def _cluster(self) -> ClusterView:
        if self.view is None:
            self.view = ClusterView()
        return self.view

    def _user_schedules(self) -> bool:
        return "scheduling_strategy" in self.options

    def _writer_resources(self) -> dict[str, float]:
        return {**dict(self.options.get("resources") or {}), **self.placement.resources}

    def _choose_node(self, index: int) -> str | None:
        """The node for writer index ``index``: the matching node with the fewest writer
        indexes (of the others)."""
        if self._user_schedules():
            return None
        load: dict[str, int] = {}
        for other, node in self._index_nodes.items():
            if other != index and node is not None:
                load[node] = load.get(node, 0) + 1
        return self._cluster().choose(load, self.placement.labels, self._writer_resources())

    # ------------------------------------------------------------------ creating

    def _base_options(self, name: str) -> dict[str, Any]:
        options: dict[str, Any] = {"num_cpus": 0, "max_restarts": -1, "max_task_retries": 0}
        options.update(self.options)
        options.update({"name": name, "namespace": NAMESPACE, "lifetime": None})
        return options

    def _start_coordinator(self, first: bool = False) -> Any:
        """A new coordinator (a new generation: it claims the runtime in the meta store);
        ``first``: at ``start``, never under another name (see ``_create``)."""
        options_node: dict[str, Any] = {}
        if not self._user_schedules():
            node, hard = coordinator_node(self._cluster(), self.placement,
                                          self.coordinator_config.metastore or "sqlite:",
                                          self.runtime)
            self._coordinator_node = node
            options_node = affinity(node, soft=not hard)

        def make(name: str) -> Any:
            options = self._base_options(name)
            if "max_restarts" not in self.options:
                options["max_restarts"] = 0  # the driver re-creates it with the current layout
            options["max_concurrency"] = 1000
            options.update(options_node)
            return _remote_coordinator_class().options(**options).remote(
                self.coordinator_config)

        self._names[COORDINATOR], handle = _create(coordinator_name(self.runtime), make,
                                                   runtime=self.runtime, first=first)
        return handle

    def _start_writer(self, sink: str, index: int, first: bool = False) -> Any:
        config = self.writer_configs[sink][index]
        node = self._index_nodes.get(index)

        def make(name: str) -> Any:
            options = self._base_options(name)
            options["max_pending_calls"] = self.max_pending_calls
            resources = self._writer_resources()
            if resources:
                options["resources"] = resources
            if node is not None:
                options.update(affinity(node, soft=False))
            return _remote_writer_class().options(**options).remote(config)

        self._names[(sink, index)], handle = _create(
            writer_name(self.runtime, sink, index), make, runtime=self.runtime, first=first)
        return handle

    # ------------------------------------------------------------------ liveness

    def _handles(self) -> dict[Key, Any]:
        handles: dict[Key, Any] = {}
        if self.coordinator is not None:
            handles[COORDINATOR] = self.coordinator
        for sink, writers in self.writers.items():
            for index, handle in enumerate(writers):
                handles[(sink, index)] = handle
        return handles

    def _await_answers(self, handles: Mapping[Key, Any], timeout: float) -> list[Key]:
        """Ping every handle at once; the keys that did not answer within ``timeout``
        (their ping failed, or is still out)."""
        failed, quiet = self._ping(handles, timeout)
        return failed + quiet

    @staticmethod
    def _ping(handles: Mapping[Key, Any],
              timeout: float) -> tuple[list[Key], list[Key]]:
        """Ping every handle at once: the keys whose ping failed (the actor is dead), and
        those with no answer within ``timeout`` (busy, restarting, or on a lost node)."""
        import ray
        from ray.exceptions import PendingCallsLimitExceeded

        refs: dict[Key, Any] = {}
        failed: list[Key] = []
        for key, handle in handles.items():
            try:
                refs[key] = handle.ping.remote()
            except PendingCallsLimitExceeded:
                continue  # calls are queued for it: busy, not lost
            except Exception as exc:
                log.debug("ping of %s: %s", key, exc)
                failed.append(key)
        ready: set[Any] = set()
        if refs:
            ready = set(ray.wait(list(refs.values()), num_returns=len(refs),
                                 timeout=timeout)[0])
        failed += [key for key, ref in refs.items() if ref in ready and not _answered(ref)]
        return failed, [key for key, ref in refs.items() if ref not in ready]

    def _probe(self) -> list[Key]:
        """The actors to replace: those whose ping failed (dead), and, when one did not
        answer within ``ping_timeout`` and its node's raylet does not answer either,
        every actor on that node (the node is lost: an actor there may still answer for
        a moment, its process not yet ended, but it is doomed). Such a node is left out
        of placement for a while. An actor that is only silent, on a node that answers,
        is busy or being restarted by Ray: left alone. A result is reused for
        ``ping_timeout`` seconds."""
        now = time.monotonic()
        if self._probed is not None and now - self._probed[0] < self.ping_timeout:
            return list(self._probed[1])
        handles = self._handles()
        failed, quiet = self._ping(handles, self.ping_timeout)
        view = self._cluster()
        lost = {node for node in {self.node_of(k) for k in failed + quiet}
                if node is not None and node != view.driver_node and view.lost(node)}
        replace = failed + [k for k in handles if k not in failed and self.node_of(k) in lost]
        self._probed = (time.monotonic(), replace)
        return replace

    def check_responsive(self) -> None:
        """``RuntimeUnavailableError`` naming the actors to replace (dead, or on a lost
        node: see ``_probe``): the epoch driver's probe while it waits for an attempt,
        which then fails and is recovered by ``heal``."""
        silent = self._probe()
        if silent:
            names = [self._names.get(k, str(k)) for k in silent]
            raise RuntimeUnavailableError(
                f"{', '.join(names)} did not answer a ping (dead, or silent for "
                f"{self.ping_timeout:g} s on a node whose raylet does not answer either): "
                "the attempt is given up and the actor replaced", runtime=self.runtime)

    def watching(self) -> AbstractContextManager[None]:
        """Within the block, waits of the epoch driver end with ``RuntimeUnavailableError``
        as soon as an actor stops answering (see ``raysink.driver.calls.watched``)."""
        return watched(self.check_responsive)

    def heal(self, timeout: float = 60.0) -> list[str]:
        """Replace every dead actor, and every actor of a lost node, by a new
        incarnation, and wait (up to ``timeout``) until the new ones answer. Returns the
        names of what was replaced. One heal at a time (a second one probes again)."""
        with self._healing:
            return self._heal(timeout)

    def _heal(self, timeout: float) -> list[str]:
        silent = self._probe()
        if not silent:
            return []
        self._retire(silent)
        self.metrics.replaced("coordinator" if key == COORDINATOR else "writer" for key in silent)
        if COORDINATOR in silent:
            self.coordinator = self._start_coordinator()
        writers = [key for key in silent if key != COORDINATOR]
        for index in sorted({index for _, index in writers}):
            node = self._index_nodes.get(index)
            if node is None or self._cluster().is_suspect(node):
                self._index_nodes[index] = self._choose_node(index)
        for sink, index in writers:
            self.writers[sink][index] = self._start_writer(sink, index)
        self._probed = None
        replaced = [self._names[key] for key in silent]
        late = self._await_answers({k: h for k, h in self._handles().items() if k in silent},
                                   timeout)
        log.warning("%s: replaced actors that did not answer: %s%s", self.runtime, replaced,
                    f" (not answering yet: {late})" if late else "")
        return replaced

    def _retire(self, keys: list[Key]) -> None:
        """Kill the actors for good (no restart), then give Ray a moment (one for all) to
        free their names; a name still taken after it gets a new incarnation's suffix."""
        import ray

        handles = self._handles()
        for key in keys:
            if key in handles:
                try:
                    ray.kill(handles[key], no_restart=True)
                except Exception as exc:  # already gone
                    log.debug("kill %s: %s", key, exc)
        deadline = time.monotonic() + _REPLACE_NAME_WAIT
        for key in keys:
            name = self._names.get(key)
            if name is not None:
                _await_name_free(name, max(0.0, deadline - time.monotonic()))

    # ------------------------------------------------------------------ rescale

    def resize(self, configs: Mapping[str, list[WriterConfig]], *,
               commit: Callable[[], None], timeout: float = 60.0) -> list[Any]:
        """Change the writers to ``configs`` (per sink, ids ``0..n-1``; existing writers
        keep theirs). New writers are started and answer first; then ``commit`` (the
        coordinator's layout change) runs; a failure there ends the new writers and
        changes nothing. Returns the handles of the writers removed (drain and end them
        with ``end``)."""
        old, count = self.writer_count, len(next(iter(configs.values())))
        grown: list[Key] = []
        try:
            for index in range(old, count):
                self._index_nodes[index] = self._choose_node(index)
                for sink in self.writer_configs:
                    self.writer_configs[sink].append(configs[sink][index])
                    self.writers[sink].append(self._start_writer(sink, index))
                    grown.append((sink, index))
            late = self._await_answers({k: self._handles()[k] for k in grown}, timeout)
            if late:
                raise RuntimeUnavailableError(f"new writers {late} did not start within "
                                              f"{timeout:g} s", runtime=self.runtime)
            commit()
        except BaseException:
            self.end(self._drop_writers(old))
            raise
        self.coordinator_config = dataclasses.replace(self.coordinator_config, writers=count)
        return self._drop_writers(count)

    def _drop_writers(self, count: int) -> list[Any]:
        """Forget writers ``count`` and up (their handles are returned); fewer writers
        from now on."""
        removed: list[Any] = []
        for sink in self.writer_configs:
            removed += self.writers[sink][count:]
            del self.writers[sink][count:]
            del self.writer_configs[sink][count:]
        for index in [i for i in self._index_nodes if i >= count]:
            del self._index_nodes[index]
        for key in [k for k in self._names if k != COORDINATOR and k[1] >= count]:
            self._retired_names.append(self._names.pop(key))
        return removed

    def end(self, handles: list[Any]) -> None:
        """Kill actors this set no longer holds (writers removed by ``resize``) and wait
        until their names are free."""
        import ray

        for handle in handles:
            if handle is None:
                continue
            try:
                ray.kill(handle, no_restart=True)
            except Exception as exc:  # already gone
                log.debug("kill: %s", exc)
        names, self._retired_names[:] = list(self._retired_names), []
        for name in names:
            _await_name_free(name)

    # ------------------------------------------------------------------ calls, stop

    @property
    def coordinator_client(self) -> CoordinatorClient:
        """The coordinator's calls, to send (again) with ``calls.ask``: each send goes to
        the current handle, which ``heal`` may replace."""
        return CoordinatorClient(lambda: self.coordinator)

    def writer_clients(self) -> list[WriterClient]:
        """Every writer of every sink, as clients (sink by sink, in writer order)."""
        return [WriterClient(h) for h in self.all_writers()]

    def all_writers(self) -> list[Any]:
        return [h for handles in self.writers.values() for h in handles]

    def stop(self) -> None:
        """End every actor and wait until their names are free again. ``rt.close()``
        drains them first (the DRAIN barrier closes each sink writer; the coordinator
        closes its sinks and meta store), so ending the processes drops nothing open.
        (Ray frees the name of a killed actor at once, of one that exits on its own only
        seconds later.)"""
        self.end([self.coordinator, *self.all_writers()])
        for name in self._names.values():
            _await_name_free(name)
        self.coordinator = None
        self.writers = {}


def _answered(ref: Any) -> bool:
    import ray

    try:
        ray.get(ref, timeout=0)
    except Exception:
        return False
    return True


def _await_name_free(name: str, seconds: float = _NAME_RELEASE_SECONDS) -> None:
    deadline = time.monotonic() + seconds
    while _exists(name) and time.monotonic() < deadline:
        time.sleep(0.05)
