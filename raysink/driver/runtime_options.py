"""``RuntimeOptions``: every option of a ``SinkRuntime``, checked, and what the driver makes
of them (the actors' configurations, the sinks bound to the runtime, the routing key, the
``Router`` that plans each epoch's data).

``SinkRuntime(name, sinks, writers=4, ...)`` builds one; ``rt.options`` returns it.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from raysink.coordinator.coordinator import CoordinatorConfig
from raysink.driver import routing
from raysink.driver.feed import FeedRoute
from raysink.driver.lease import LEASE_SECONDS
from raysink.driver.lifecycle import PING_TIMEOUT, ActorSet, coordinator_name
from raysink.driver.placement import Placement
from raysink.driver.routing import DEFAULT_MAX_BATCH_BYTES, DEFAULT_MAX_BUFFER_BYTES
from raysink.errors import ConfigError
from raysink.progress import Progress
from raysink.protocol.vnodes import Bitmap, assign
from raysink.sinks.base import Sink
from raysink.writer.writer import WriterConfig

__all__ = ["Router", "RuntimeOptions", "bind_sinks", "check_name", "progress_line",
           "routing_key"]


@dataclass(frozen=True, kw_only=True, slots=True)
class RuntimeOptions:
    """The options of a ``SinkRuntime`` (each a keyword of its constructor).

    ``writers``: writer actors per sink. ``key``: the routing key (default: the sinks'
    upsert key); all rows of a key reach one writer. ``metastore``: where epoch decisions
    live (``None``: ``sqlite:///<cwd>/.raysink/<runtime>.db``). ``flush_interval``:
    seconds between a writer's flushes. ``max_pending_epochs``: epochs open or decided
    but not yet committed. ``commit_timeout``: how long an epoch's commit is waited for
    (and actors that restart). ``max_attempts``: attempts of an epoch before
    ``EpochFailedError``. ``retry_cap``: the longest pause between a sink's commit
    retries. ``credits``: data messages in flight per writer. ``epoch_offset``: for a
    Structured Streaming query, epoch = ``batch_id + 1 + offset``; implicit epochs are
    numbered above it. ``actor_options``: passed to Ray for every actor.

    ``max_batch_bytes`` bounds one data message a writer takes (local tables are cut to
    fit; a larger Spark partition or object ref is a ``SchemaMismatchError`` and nothing
    of the epoch is written; ``None``: no limit); ``max_buffer_bytes`` bounds each
    writer's reorder buffer (messages that arrived before their turn; one that does not
    fit is sent again later); ``warn_interval``: a sink commit or flush still running
    logs a warning every this many seconds; ``feed_timeout``: a producer's feed
    (``open_epoch``) silent this long without closing is lost, and its epoch's attempt
    given up; ``checkpoint_interval``: seconds between the epochs of a continuous stream
    (``stream``); ``add_sinks``/``drop_sinks`` change the sink set on purpose (a dropped
    sink shows as ``dropped``).

    On a cluster: ``placement`` (a ``raysink.Placement``) narrows the nodes writers may use
    and where the coordinator runs (see ``raysink.driver.placement``); an actor that does
    not answer a ping within ``ping_timeout`` seconds while an epoch waits on it is
    replaced and the epoch fed again. ``lease_timeout``: a killed driver's lease of the
    runtime is taken over this long after its last renewal (at once on its own machine).
    """

    writers: int = 2
    key: tuple[str, ...] | None = None
    metastore: str | None = None
    flush_interval: float = 5.0
    max_pending_epochs: int = 2
    commit_timeout: float = 60.0
    max_attempts: int = 3
    retry_cap: float = 60.0
    credits: int = 4
    epoch_offset: int | None = None
    actor_options: dict[str, Any] = field(default_factory=dict)
    max_batch_bytes: int | None = DEFAULT_MAX_BATCH_BYTES
    max_buffer_bytes: int | None = DEFAULT_MAX_BUFFER_BYTES
    warn_interval: float = 5.0
    feed_timeout: float = 30.0
    checkpoint_interval: float = 10.0
    add_sinks: tuple[str, ...] = ()
    drop_sinks: tuple[str, ...] = ()
    placement: Placement = field(default_factory=Placement)
    ping_timeout: float = PING_TIMEOUT
    lease_timeout: float = LEASE_SECONDS

    def validate(self, runtime: str) -> None:
        """``ConfigError`` naming the first option out of range."""
        for ok, message in self._checks():
            if not ok:
                raise ConfigError(message, runtime=runtime)

    def _checks(self) -> list[tuple[bool, str]]:
        positive = [(name, getattr(self, name)) for name in (
            "flush_interval", "commit_timeout", "retry_cap", "warn_interval", "feed_timeout",
            "checkpoint_interval", "ping_timeout", "lease_timeout")]
        at_least_one = [(name, getattr(self, name)) for name in (
            "writers", "max_pending_epochs", "max_attempts", "credits")]
        checks = [(value > 0, f"{name} must be > 0; got {value!r}") for name, value in positive]
        checks += [(value >= 1, f"{name} must be at least 1; got {value!r}")
                   for name, value in at_least_one]
        checks += [(value is None or value >= 1,
                    f"{name} must be at least 1 (or None: no limit); got {value!r}")
                   for name, value in (("max_batch_bytes", self.max_batch_bytes),
                                       ("max_buffer_bytes", self.max_buffer_bytes))]
        checks += [
            (isinstance(self.placement, Placement),
             f"placement must be a raysink.Placement; got {type(self.placement).__name__}"),
            (self.epoch_offset is None or self.epoch_offset >= 0,
             f"epoch_offset must be >= 0; got {self.epoch_offset!r}"),
        ]
        return checks

    # ------------------------------------------------------------------ the actors

    def actor_set(self, runtime: str, sinks: Mapping[str, Sink], metastore: str,
                  holder: str) -> ActorSet:
        """The runtime's actors (not started): the coordinator and ``writers`` per sink."""
        coordinator = CoordinatorConfig(
            runtime=runtime, metastore=metastore, sinks=dict(sinks), writers=self.writers,
            max_pending_epochs=self.max_pending_epochs, retry_cap=self.retry_cap,
            add_sinks=self.add_sinks, drop_sinks=self.drop_sinks,
            epoch_offset=self.epoch_offset, warn_after=self.warn_interval,
            lease_holder=holder)
        return ActorSet(coordinator_config=coordinator,
                        writer_configs=self.writer_configs(runtime, sinks, self.writers),
                        options=self.actor_options,
                        max_pending_calls=max(64, self.credits * 8),
                        placement=self.placement, ping_timeout=self.ping_timeout)

    def writer_configs(self, runtime: str, sinks: Mapping[str, Sink],
                       writers: int) -> dict[str, list[WriterConfig]]:
        return {
            sink_name: [WriterConfig(runtime=runtime, sink_name=sink_name, sink=sink,
                                     writer_id=i, coordinator=coordinator_name(runtime),
                                     flush_interval=self.flush_interval,
                                     max_batch_bytes=self.max_batch_bytes,
                                     max_buffer_bytes=self.max_buffer_bytes,
                                     warn_interval=self.warn_interval)
                        for i in range(writers)]
            for sink_name, sink in sinks.items()}


@dataclass(kw_only=True)
class Router:
    """How the driver routes a runtime's epochs to its writers: by ``key`` (a row's vnode
    picks its writer by ``bitmaps``, see ``raysink.protocol.vnodes``) or, unkeyed,
    round-robin from a first writer that turns with every epoch planned, so that epochs of
    one small table do not all land on writer 0. ``evolve``: every sink takes
    ``schema_evolution="add_columns"``, so the tables of one epoch may differ in schema
    where they have a union. ``resize`` follows a rescale."""

    runtime: str
    key: tuple[str, ...] | None
    writers: int
    max_batch_bytes: int | None
    credits: int
    evolve: bool
    bitmaps: list[Bitmap] = field(init=False)
    planned: int = field(default=0, init=False)  # epochs planned: turns the first writer

    def __post_init__(self) -> None:
        self.bitmaps = assign(self.writers)

    @classmethod
    def of(cls, runtime: str, options: RuntimeOptions, sinks: Mapping[str, Sink]) -> Router:
        return cls(runtime=runtime, key=routing_key(runtime, options.key, sinks),
                   writers=options.writers, max_batch_bytes=options.max_batch_bytes,
                   credits=options.credits,
                   evolve=all(s.schema_evolution == "add_columns" for s in sinks.values()))

    def resize(self, writers: int) -> None:
        self.writers, self.bitmaps = writers, assign(writers)

    def plan_arrow(self, data: Any) -> routing.FeedPlan:
        """One epoch of local Arrow data or refs (``routing.plan_arrow``)."""
        return routing.plan_arrow(data, writers=self.writers, key=self.key,
                                  bitmaps=self.bitmaps, max_batch_bytes=self.max_batch_bytes,
                                  first_writer=self._first_writer(), evolve=self.evolve)

    def plan_refs(self, refs: Iterable[Any]) -> routing.FeedPlan:
        """One epoch of refs or pulls, each routed as it comes (``routing.plan_refs``)."""
        return routing.plan_refs(refs, writers=self.writers, key=self.key,
                                 bitmaps=self.bitmaps, first_writer=self._first_writer())

    def feed_route(self, actors: ActorSet) -> FeedRoute:
        """What producers' feeds route and send by, to ``actors`` as they are now."""
        return FeedRoute(runtime=self.runtime, writers=actors.writers,
                         coordinator=actors.coordinator, key=self.key,
                         bitmaps=tuple(self.bitmaps), max_batch_bytes=self.max_batch_bytes,
                         credits=self.credits, evolve=self.evolve)

    def _first_writer(self) -> int:
        self.planned += 1
        return (self.planned - 1) % self.writers


def routing_key(runtime: str, key: tuple[str, ...] | None,
                sinks: Mapping[str, Sink]) -> tuple[str, ...] | None:
    """The routing key: given, or the sinks' upsert key; within every upsert key."""
    upsert_keys = {n: tuple(s.key) for n, s in sinks.items() if s.key}
    if key is None and upsert_keys:
        key = next(iter(upsert_keys.values()))
    for sink, upsert in upsert_keys.items():
        if key is not None and not set(key) <= set(upsert):
            raise ConfigError(
                f"routing key {list(key)} is not within the upsert key {list(upsert)} of "
                f"sink {sink!r}: all rows of a key must reach one writer. Route by a "
                "subset of the upsert key", runtime=runtime, sink=sink)
    return key


def progress_line(name: str, choice: Progress | bool | None) -> Progress | None:
    """A progress line on stderr: drawn only on a terminal unless forced with ``True``."""
    if choice is False:
        return None
    if isinstance(choice, Progress):
        return choice
    return Progress(label=name, stream=sys.stderr, enabled=True if choice else None)


def check_name(name: str) -> None:
    if not name or not all(c.isalnum() or c in "-_" for c in name):
        raise ConfigError(f"runtime names use letters, digits, '-' and '_'; got {name!r}")


def bind_sinks(runtime: str, sinks: Sink | Mapping[str, Sink]) -> dict[str, Sink]:
    """The sinks by name (a single one is ``"main"``), each bound to the runtime."""
    named = {"main": sinks} if isinstance(sinks, Sink) else dict(sinks)
    if not named:
        raise ConfigError("give at least one sink", runtime=runtime)
    bound: dict[str, Sink] = {}
    for name, sink in named.items():
        if not isinstance(sink, Sink):
            raise ConfigError(f"sink {name!r} is not a raysink Sink; got {type(sink).__name__}",
                              runtime=runtime)
        check_name(name)
        bound[name] = sink.bind(runtime, name)
    return bound
