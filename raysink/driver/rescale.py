"""Changing the writers per sink between epochs (``rt.rescale(writers=n)``).

New writers start first (placed like the others) and must answer; then the coordinator
takes the new layout (``set_layout``: each writer's vnode bitmap by ``vnodes.assign``),
effective from the next epoch; writers no longer needed get the DRAIN barrier and end.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

from raysink.driver.calls import results, short
from raysink.driver.epoch import EpochDriver
from raysink.driver.handle import EpochHandle
from raysink.driver.lifecycle import ActorSet
from raysink.driver.runtime_options import RuntimeOptions
from raysink.driver.stream_controller import StreamController
from raysink.errors import ConfigError, RescaleRefusedError
from raysink.protocol.barrier import BarrierFlags, CheckpointBarrier
from raysink.protocol.clients import Ask, WriterClient
from raysink.sinks.base import Sink

__all__ = ["check_writers", "refuse_rescale", "resize_writers", "retire_writers"]

log = logging.getLogger(__name__)


def check_writers(name: str, writers: object) -> None:
    """``ConfigError`` unless ``writers`` is a writer count (an int of at least 1)."""
    if not isinstance(writers, int) or writers < 1:
        raise ConfigError(f"writers must be at least 1; got {writers!r}", runtime=name)


def refuse_rescale(name: str, writers: int, handle: EpochHandle | None,
                   stream: StreamController | None) -> None:
    """``RescaleRefusedError`` while an epoch is open for producers or a stream runs."""
    if handle is not None:
        raise RescaleRefusedError(
            f"{handle!r} is open for producers: commit or abort it, then rescale",
            runtime=name, epoch=handle.epoch)
    if stream is not None:
        raise RescaleRefusedError(
            "a continuous stream runs (rt.stream()): its producers write an epoch at "
            "every moment, routed by the layout they joined with. To rescale, close "
            "the runtime (rt.close() drains the stream), open it again with "
            f"writers={writers} and start the stream again (producers resume from "
            "feed.committed())", runtime=name)


def resize_writers(name: str, actors: ActorSet, epochs: EpochDriver, options: RuntimeOptions,
                   sinks: Mapping[str, Sink], writers: int, ask: Ask) -> RuntimeOptions:
    """Start or end writers so that each sink has ``writers``, with no epoch in flight
    (the caller holds ``epochs.exclusive()``); the options with the new count."""
    actors.heal()

    def take_layout() -> None:
        ask("changing the writer layout", actors.coordinator_client.set_layout(writers))

    removed = actors.resize(options.writer_configs(name, sinks, writers), commit=take_layout)
    retire_writers(name, actors, epochs, removed, timeout=options.commit_timeout)
    log.info("%s: rescaled to %s writers per sink", name, writers)
    return dataclasses.replace(options, writers=writers)


def retire_writers(name: str, actors: ActorSet, epochs: EpochDriver, handles: list[Any], *,
                   timeout: float) -> None:
    """The DRAIN barrier to writers a rescale removed (each closes its sink writer), then
    end them. They hold nothing undecided: no epoch is in flight."""
    if not handles:
        return
    barrier = CheckpointBarrier(epochs.next_checkpoint(), 0, BarrierFlags.DRAIN)
    try:
        results((WriterClient(h).drain(barrier) for h in handles), timeout=timeout)
    except Exception as exc:  # ending them drops nothing decided
        log.warning("%s: rescale: draining removed writers failed: %s", name, short(exc))
    actors.end(handles)
