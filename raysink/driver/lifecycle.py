"""Creating, checking, replacing and ending a runtime's actors.

Writers (one set per sink) and the coordinator are ordinary actors owned by the driver in
the Ray namespace ``raysink``, named ``<runtime>.coordinator`` and
``<runtime>.<sink>.writer-<i>``. They reserve no CPU unless ``actor_options`` says so and
die with the driver. Where they run: ``raysink.driver.placement`` (writers spread over the
nodes, the coordinator on the driver's node). Writers restart after a crash
(``max_restarts=-1``; in-flight calls fail, ``max_task_retries=0``). The coordinator is
not restarted by Ray: the driver re-creates it (``heal``) with the current writer layout
(``rescale`` changes it), or a standby started ahead takes over when node labels pin the
coordinator (``raysink.coordinator.standby``: no process start while the epoch waits).

Replacing what does not answer (``heal``). Ray declares a lost node dead only after its
health checks time out (15-20 s with the defaults), and until then an actor there is
neither dead nor answering. The driver does not wait for that: every actor is pinged at
once. One whose ping fails (dead) is killed for good (``ray.kill(no_restart=True)``) and a
new incarnation is started under the same name (or ``<name>.<n>`` while Ray still holds
the name, as it may for an actor on a lost node until it declares the node dead). One that
does not answer within ``ping_timeout`` seconds is replaced only when its node does not
accept a connection to its raylet either: the node is lost, and every actor placed there is
replaced (one may still answer for a moment, its process not yet ended), on other nodes,
and placement leaves the node out for a while (at once, unpinged, when the raylet refuses
connections). Silence on a node that answers is a busy actor, or one Ray is restarting
there (in a second or two): it is left alone, since replacing a healthy writer would fail
an epoch whose producers cannot feed it again (a Ray Data write, a feed); one Ray's GCS
lists as (re)starting (``raysink.driver.raystate``) is not pinged at all. Then the epoch
in flight is resolved and fed again: ``heal`` waits for a new coordinator, not for new
writers (the epoch driver feeds around a writer still starting, or waits for it when the
epoch is keyed).

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
import logging
import threading
import time
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

from raysink._metrics import DriverMetrics
from raysink.coordinator.coordinator import CoordinatorConfig
from raysink.driver import raystate
from raysink.driver.calls import ask, watched
from raysink.driver.placement import ClusterView, Placement, affinity, coordinator_node
from raysink.driver.remote import (
    await_name_free,
    coordinator_class,
    coordinator_name,
    create,
    exists,
    find_coordinator,
    in_use,
    take_over,
    writer_class,
    writer_name,
)
from raysink.errors import RuntimeUnavailableError
from raysink.protocol.clients import CoordinatorClient, WriterClient
from raysink.writer.writer import NAMESPACE, WriterConfig

__all__ = ["PING_TIMEOUT", "ActorSet", "coordinator_name", "find_coordinator", "writer_name"]

log = logging.getLogger(__name__)

_REPLACE_NAME_WAIT = 0.3
PING_TIMEOUT = 1.0
"""Seconds an actor may take to answer a ping before ``heal`` replaces it."""
STANDBY_CHECK = 2.0
"""Seconds between looks for a better node for a standby coordinator (``tend_standby``)."""

Key = tuple[str, int]
"""An actor of the set: ``(sink, writer index)``, or ``COORDINATOR``."""
COORDINATOR: Key = ("", -1)


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
    _starting: set[Key] = field(default_factory=set)  # seen (re)starting, until they answer
    _standby: tuple[str, str | None, Any] | None = None  # name, node, handle
    _standby_looked: float = 0.0
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
            if exists(name):
                raise in_use(name, self.runtime)

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
            self.heal(timeout, writers=True)  # one could not start (its node lost, say)
        self._keep_standby()

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

    def _start_coordinator(self, *, first: bool = False, standby: bool = False) -> Any:
        """A new coordinator (a new generation: it claims the runtime in the meta store);
        ``first``: at ``start``, never under another name (see ``remote.create``);
        ``standby``: a standby (``_standby``) on another node its labels allow."""
        options_node: dict[str, Any] = {}
        node: str | None = None
        if not self._user_schedules():
            node, hard = coordinator_node(self._cluster(), self.placement,
                                          self.coordinator_config.metastore or "sqlite:",
                                          self.runtime,
                                          avoid=self._coordinator_node if standby else None)
            options_node = affinity(node, soft=not hard)

        def make(name: str) -> Any:
            options = self._base_options(name)
            if "max_restarts" not in self.options:
                options["max_restarts"] = 0  # the driver re-creates it with the current layout
            options["max_concurrency"] = 1000
            options.update(options_node)
            return coordinator_class(standby).options(**options).remote(
                self.coordinator_config)

        suffix = "-standby" if standby else ""
        name, handle = create(coordinator_name(self.runtime) + suffix, make,
                               runtime=self.runtime, first=first)
        if standby:
            self._standby = (name, node, handle)
        else:
            self._names[COORDINATOR], self._coordinator_node = name, node
        return handle

    def _keep_standby(self) -> None:
        """A standby coordinator when node labels pin the coordinator (not waited for)."""
        if (self._standby is not None or self.placement.coordinator_on_driver
                or self._user_schedules()):
            return
        try:
            self._start_coordinator(standby=True)
        except Exception as exc:  # the runtime goes on without one
            log.warning("%s: no standby coordinator: %s", self.runtime, exc)

    def tend_standby(self) -> None:
        """Between epochs: a standby that shares the coordinator's node (no other node
        matched when it started: one was just lost, say), or none, is started on another
        matching node once there is one. Looked for at most every ``STANDBY_CHECK`` s."""
        standby, now = self._standby, time.monotonic()
        if (self.placement.coordinator_on_driver or self._user_schedules()
                or (standby is not None and standby[1] != self._coordinator_node)
                or now - self._standby_looked < STANDBY_CHECK):
            return
        self._standby_looked = now
        if standby is not None:
            node, _ = coordinator_node(self._cluster(), self.placement,
                                       self.coordinator_config.metastore or "sqlite:",
                                       self.runtime, avoid=self._coordinator_node)
            if node == self._coordinator_node:
                return
            self._standby = None
            self.end([standby[2]])
        self._keep_standby()

    def _replace_coordinator(self, timeout: float) -> Any:
        """The standby coordinator once it took over (unless its node is suspect); else,
        or when it cannot, a new coordinator."""
        if self._standby is not None:
            (name, node, handle), self._standby = self._standby, None
            if (node is None or not self._cluster().is_suspect(node)) and take_over(
                    handle, self.coordinator_config, ping_timeout=self.ping_timeout,
                    timeout=timeout):
                self._names[COORDINATOR], self._coordinator_node = name, node
                return handle
            self.end([handle])
        return self._start_coordinator()

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
            return writer_class().options(**options).remote(config)

        self._names[(sink, index)], handle = create(
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
    def _ping(handles: Mapping[Key, Any], timeout: float) -> tuple[list[Key], list[Key]]:
        """Ping every handle at once: the keys whose ping failed (the actor is dead), and
        those with no answer within ``timeout`` (busy, restarting, or on a lost node)."""
        import ray
        from ray.exceptions import PendingCallsLimitExceeded

        refs: dict[Key, Any] = {}
        failed: list[Key] = []
        for key, handle in handles.items():
            try:
                refs[key] = (CoordinatorClient.of(handle) if key == COORDINATOR
                             else WriterClient(handle)).ping().send()
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
        """The actors to replace: those whose ping failed (dead), and every actor of a
        lost node (left out of placement for a while): its raylet refuses connections, or
        does not answer when an actor there was silent for ``ping_timeout`` (one there may
        answer a moment longer, but it is doomed). An actor Ray's GCS says it is
        (re)starting is not pinged (the ping would come back only once it is up); it, and
        a silent one on a node that answers, are left alone (busy, or restarted by Ray).
        A result is reused for ``ping_timeout`` seconds, unless ``check_calls`` saw an
        actor lost since."""
        now = time.monotonic()
        if self._probed is not None and now - self._probed[0] < self.ping_timeout:
            return list(self._probed[1])
        handles = self._handles()
        view = self._cluster()
        starting = raystate.keys_in(self._handles(), raystate.STARTING)
        self._starting = set(starting)
        refused = {node for node in {self.node_of(k) for k in handles}
                   if node is not None and node != view.driver_node and view.refuses(node)}
        failed, quiet = self._ping({k: h for k, h in handles.items() if k not in starting
                                    and self.node_of(k) not in refused}, self.ping_timeout)
        lost = refused | {node for node in {self.node_of(k) for k in failed + quiet + starting}
                          if node is not None and node != view.driver_node
                          and node not in refused and view.lost(node)}
        replace = failed + [k for k in handles if k not in failed and self.node_of(k) in lost]
        self._probed = (time.monotonic(), replace)
        return replace

    # ------------------------------------------------------------------ Ray's view

    def starting_writers(self) -> frozenset[int]:
        """Writer indexes (of any sink) whose actor Ray is still restarting or starting,
        among those seen so (by a probe, or replaced by ``heal``): the GCS is asked only
        while there are such writers, and forgets them once they are up."""
        if not self._starting - {COORDINATOR}:
            return frozenset()
        now = set(raystate.keys_in(self._handles(), raystate.STARTING))
        self._starting &= now
        return frozenset(index for key in self._starting - {COORDINATOR} for _, index in [key])

    def ready_for_producers(self, timeout: float) -> None:
        """Wait (up to ``timeout``) for the writers Ray is (re)starting now, asking the
        GCS afresh: one killed while a producer fed it (the driver saw nothing) would
        fail the first call of the next epoch's producers. An actor ended for good is
        replaced first: Ray starts no other, and every epoch's producers would fail."""
        if raystate.keys_in(self._handles(), raystate.DEAD):
            self.heal(timeout, writers=True, fresh=True)
        self._starting.update(raystate.keys_in(self._handles(), raystate.STARTING))
        self.await_writers(self.starting_writers(), timeout=timeout)

    def await_writers(self, indexes: frozenset[int], timeout: float) -> None:
        """Wait (up to ``timeout``) until the writers of ``indexes`` answer a ping (a call
        sent while Ray restarts an actor fails once the actor is back)."""
        for sink, handles in self.writers.items():
            for index in sorted(indexes):
                ask(WriterClient(handles[index]).ping(), what=f"writer {index} of {sink} starting",
                    timeout=timeout, runtime=self.runtime)

    def check_calls(self, refs: list[Any]) -> None:
        """The quick check while the epoch driver waits for ``refs``:
        ``RuntimeUnavailableError`` once an actor they went to is being restarted by Ray
        (the call is lost: Ray fails it only after gathering the details of the death),
        sits on a node whose raylet refuses connections, or is the coordinator and dead.
        One or two GCS requests, a connection to each node's raylet. A probe result
        kept from before is dropped then: the heal that follows must see the loss."""
        handles = self._handles()
        keys = raystate.targeted(handles, refs)
        if not keys:
            return
        view = self._cluster()
        lost = [key for key in keys if (node := self.node_of(key)) is not None
                and node != view.driver_node and view.refuses(node)]
        restarting = raystate.keys_in({k: handles[k] for k in keys}, raystate.RESTARTING)
        self._starting.update(restarting)
        if COORDINATOR in keys and raystate.state_of(self.coordinator) == "DEAD":
            restarting.append(COORDINATOR)  # Ray does not restart it: the driver replaces it
        if lost or restarting:
            self._probed = None  # older than this news: the heal after it probes afresh
            names = [self._names.get(k, str(k)) for k in lost + restarting]
            raise RuntimeUnavailableError(
                f"{', '.join(names)} lost its process (restarting, or its node is gone) "
                "with calls of this attempt: the attempt is given up", runtime=self.runtime)

    def waitable(self, refs: list[Any]) -> tuple[list[Any], list[Any]]:
        """Calls of a failed attempt that end soon (to a current actor that is up), and
        the others (to one replaced since, or (re)starting); asks the GCS afresh."""
        handles = self._handles()
        self._starting.update(raystate.keys_in(handles, raystate.STARTING))
        return raystate.split_calls(refs, [h for k, h in handles.items()
                                           if k not in self._starting])

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
        return watched(self.check_responsive, self.check_calls)

    def heal(self, timeout: float = 60.0, *, writers: bool = False,
             fresh: bool = False) -> list[str]:
        """Replace every dead actor, and every actor of a lost node, by a new incarnation
        (the standby takes a coordinator's place), and wait (up to ``timeout``) until a
        new coordinator answers; new writers too with ``writers`` (else the epoch driver
        goes around a writer still starting, or waits for it). Returns what was replaced.
        One heal at a time (a second one probes again); ``fresh``: probe anew."""
        with self._healing:  # a kept "all well" predates the failure this heal follows
            if fresh or not (self._probed and self._probed[1]):
                self._probed = None
            return self._heal(timeout, writers)

    def _heal(self, timeout: float, writers: bool) -> list[str]:
        silent = self._probe()
        if not silent:
            return []
        self._retire(silent)
        self.metrics.replaced("coordinator" if key == COORDINATOR else "writer" for key in silent)
        if COORDINATOR in silent:
            self.coordinator = self._replace_coordinator(timeout)
        new = [key for key in silent if key != COORDINATOR]
        for index in sorted({index for _, index in new}):
            node = self._index_nodes.get(index)
            if node is None or self._cluster().is_suspect(node):
                self._index_nodes[index] = self._choose_node(index)
        for sink, index in new:
            self.writers[sink][index] = self._start_writer(sink, index)
        self._probed = None
        self._starting.update(new)
        replaced = [self._names[key] for key in silent]
        awaited = silent if writers else [k for k in silent if k == COORDINATOR]
        late = self._await_answers({k: h for k, h in self._handles().items() if k in awaited},
                                   timeout)
        log.warning("%s: replaced actors that did not answer: %s%s", self.runtime, replaced,
                    f" (not answering yet: {late})" if late else "")
        self._keep_standby()
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
                await_name_free(name, max(0.0, deadline - time.monotonic()))

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
            await_name_free(name)

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

    def named(self) -> dict[str, Any]:
        """Every actor of the set (the standby too) by its name in Ray."""
        named = {self._names[key]: h for key, h in self._handles().items() if key in self._names}
        if self._standby is not None:
            named[self._standby[0]] = self._standby[2]
        return named

    def stop(self) -> None:
        """End every actor and wait until their names are free again. ``rt.close()``
        drains them first (the DRAIN barrier closes each sink writer; the coordinator
        closes its sinks and meta store), so ending the processes drops nothing open.
        (Ray frees the name of a killed actor at once, of one that exits on its own only
        seconds later.)"""
        standby, self._standby = self._standby, None
        self.end([self.coordinator, *self.all_writers(), standby and standby[2]])
        for name in [*self._names.values(), *(standby[:1] if standby else [])]:
            await_name_free(name)
        self.coordinator = None
        self.writers = {}


def _answered(ref: Any) -> bool:
    import ray

    try:
        ray.get(ref, timeout=0)
    except Exception:
        return False
    return True
