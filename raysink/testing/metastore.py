"""``InMemoryMetaStore``: the ``MetaStore`` protocol on dicts, for coordinator unit tests."""

from __future__ import annotations

import copy
import dataclasses
import json
import threading
import time
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from raysink.coordinator.metastore import _leases
from raysink.coordinator.metastore.base import (
    HISTORY_LIMIT,
    EpochRecord,
    EpochState,
    Lease,
    RuntimeRecord,
    SinkStatusRecord,
    check_sink_set,
)
from raysink.errors import (
    FencedError,
    MetaStoreError,
)
from raysink.sinks.base import Manifest


def _json_round_trip(value: Any, what: str) -> Any:
    try:
        return json.loads(json.dumps(value, allow_nan=False))
    except (TypeError, ValueError) as exc:
        raise MetaStoreError(f"{what} is not JSON-serialisable: {exc}") from exc


class InMemoryMetaStore:
    """The ``MetaStore`` protocol on dicts; thread-safe; for unit tests.

    Epoch records are kept as JSON text (``layout``, ``manifests``) and decoded on every
    read, so anything not JSON-serialisable fails here as in the real stores. ``close``
    keeps the data: the same instance can serve a "restarted" coordinator.
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._runtimes: dict[str, RuntimeRecord] = {}
        self._leases: dict[str, Lease] = {}
        self.clock = time.time  # the store's clock (a test may move it)
        self._epochs: dict[tuple[str, str, int], dict[str, Any]] = {}
        self._statuses: dict[tuple[str, str], SinkStatusRecord] = {}

    @property
    def url(self) -> str:
        return "memory://"

    # runtimes ------------------------------------------------------------------------
    def claim(self, runtime: str, sinks: Mapping[str, str], *,
              add: Collection[str] = (), drop: Collection[str] = (),
              holder: str | None = None) -> RuntimeRecord:
        with self._lock:
            if holder is not None:
                current = self.lease(runtime)
                if current is None or current.holder != holder:
                    raise _leases.in_use(runtime, current)
            old = self._runtimes.get(runtime)
            if old is None:
                record = RuntimeRecord(name=runtime, generation=1, sinks=dict(sinks))
            else:
                check_sink_set(runtime, old.sinks, sinks, add, drop)
                gone = set(old.dropped) | (set(old.sinks) - set(sinks))
                record = RuntimeRecord(
                    name=runtime, generation=old.generation + 1, sinks=dict(sinks),
                    dropped=tuple(sorted(gone - set(sinks))), epoch_source=old.epoch_source)
            self._runtimes[runtime] = record
            return copy.deepcopy(record)

    def load(self, runtime: str) -> RuntimeRecord | None:
        with self._lock:
            return copy.deepcopy(self._runtimes.get(runtime))

    def bind_source(self, runtime: str, generation: int, source: Mapping[str, Any]) -> None:
        with self._lock:
            old = self._fence(runtime, generation)
            decoded = _json_round_trip(dict(source), "epoch source")
            self._runtimes[runtime] = RuntimeRecord(
                name=old.name, generation=old.generation, sinks=old.sinks,
                dropped=old.dropped, epoch_source=decoded)

    # the lease -----------------------------------------------------------------------
    def acquire_lease(self, runtime: str, holder: str, owner: Mapping[str, Any],
                      seconds: float, *, replace: str | None = None) -> Lease:
        with self._lock:
            current = self.lease(runtime)
            now = self.clock()
            if current is not None and current.holder not in (holder, replace) \
                    and current.live:
                return current
            token = (0 if current is None else current.token) + (
                0 if current is not None and current.holder == holder else 1)
            lease = Lease(runtime=runtime, holder=holder, owner=_json_round_trip(
                dict(owner), "lease owner"), token=token, expires_at=now + seconds, now=now)
            self._leases[runtime] = lease
            return copy.deepcopy(lease)

    def release_lease(self, runtime: str, holder: str) -> None:
        with self._lock:
            current = self._leases.get(runtime)
            if current is not None and current.holder == holder:
                self._leases[runtime] = dataclasses.replace(current, expires_at=min(
                    current.expires_at, self.clock()))

    def lease(self, runtime: str) -> Lease | None:
        with self._lock:
            current = self._leases.get(runtime)
            return None if current is None else dataclasses.replace(
                copy.deepcopy(current), now=self.clock())

    def _fence(self, runtime: str, generation: int) -> RuntimeRecord:
        record = self._runtimes.get(runtime)
        if record is None:
            raise MetaStoreError(f"runtime {runtime!r} was never claimed", runtime=runtime)
        if generation < record.generation:
            raise FencedError(f"generation {generation} is fenced by generation "
                              f"{record.generation}; this coordinator must stop",
                              runtime=runtime)
        if generation > record.generation:
            raise MetaStoreError(f"generation {generation} was never claimed (current "
                                 f"{record.generation})", runtime=runtime)
        return record

    # epochs --------------------------------------------------------------------------
    def records(self, runtime: str) -> list[EpochRecord]:
        with self._lock:
            rows = [row for (rt, _, _), row in self._epochs.items() if rt == runtime]
            return sorted((_decode(row) for row in rows), key=lambda r: (r.epoch, r.sink))

    def put_open(self, runtime: str, generation: int, epoch: int, attempt: int,
                 sinks: Sequence[str], layout: Mapping[str, Any]) -> None:
        with self._lock:
            record = self._fence(runtime, generation)
            text = json.dumps(_json_round_trip(dict(layout), "layout"))
            for sink in sinks:
                self._check_openable(record, sink, epoch, attempt)
            for sink in sinks:
                self._epochs[(runtime, sink, epoch)] = _row(
                    sink, epoch, attempt, EpochState.OPEN, layout=text)

    def _check_openable(self, record: RuntimeRecord, sink: str, epoch: int,
                        attempt: int) -> None:
        if sink not in record.sinks:
            raise MetaStoreError(f"sink {sink!r} is not in the runtime's sink set",
                                 runtime=record.name, sink=sink, epoch=epoch)
        row = self._epochs.get((record.name, sink, epoch))
        if row is None:
            return
        if row["state"] in (EpochState.PENDING, EpochState.COMMITTED):
            raise MetaStoreError(f"epoch is {row['state'].value}; it cannot be reopened",
                                 runtime=record.name, sink=sink, epoch=epoch)
        if row["attempt"] > attempt:
            raise MetaStoreError(f"attempt {attempt} is below the recorded attempt "
                                 f"{row['attempt']}", runtime=record.name, sink=sink,
                                 epoch=epoch)

    def put_decided(self, runtime: str, generation: int, epoch: int, attempt: int,
                    layout: Mapping[str, Any],
                    manifests: Mapping[str, Sequence[Manifest]]) -> None:
        with self._lock:
            record = self._fence(runtime, generation)
            for sink in manifests:
                self._check_openable(record, sink, epoch, attempt)
            layout_text = json.dumps(_json_round_trip(dict(layout), "layout"))
            for sink, items in manifests.items():
                text = json.dumps(_json_round_trip(list(items), f"manifests of {sink}"))
                self._epochs[(runtime, sink, epoch)] = _row(
                    sink, epoch, attempt, EpochState.PENDING, layout=layout_text,
                    manifests=text)

    def put_pending(self, runtime: str, generation: int, epoch: int, attempt: int,
                    manifests: Mapping[str, Sequence[Manifest]]) -> None:
        with self._lock:
            self._fence(runtime, generation)
            encoded = {}
            for sink, items in manifests.items():
                row = self._epochs.get((runtime, sink, epoch))
                if row is None or row["state"] != EpochState.OPEN or row["attempt"] != attempt:
                    raise MetaStoreError(f"epoch is not OPEN at attempt {attempt}",
                                         runtime=runtime, sink=sink, epoch=epoch)
                decoded = _json_round_trip(list(items), f"manifests of sink {sink!r}")
                encoded[sink] = json.dumps(decoded)
            for sink, text in encoded.items():
                row = self._epochs[(runtime, sink, epoch)]
                self._epochs[(runtime, sink, epoch)] = _row(
                    sink, epoch, attempt, EpochState.PENDING, layout=row["layout"],
                    manifests=text)

    def put_committed(self, runtime: str, generation: int, epoch: int, sink: str, *,
                      marked: bool = True) -> None:
        with self._lock:
            self._fence(runtime, generation)
            row = self._epochs.get((runtime, sink, epoch))
            if row is None or row["state"] not in (EpochState.PENDING, EpochState.COMMITTED):
                state = None if row is None else row["state"].value
                raise MetaStoreError(f"only a PENDING epoch can be committed, found {state}",
                                     runtime=runtime, sink=sink, epoch=epoch)
            self._epochs[(runtime, sink, epoch)] = {**row, "state": EpochState.COMMITTED,
                                                    "marked": marked,
                                                    "updated_at": time.time()}
            self._prune_committed(runtime, sink)

    def _prune_committed(self, runtime: str, sink: str) -> None:
        committed = [e for (rt, s, e), row in self._epochs.items()
                     if rt == runtime and s == sink and row["state"] == EpochState.COMMITTED]
        newest = max(committed)
        marked = max((e for e in committed if self._epochs[(runtime, sink, e)]["marked"]),
                     default=None)
        for epoch in committed:
            if epoch not in (newest, marked):
                del self._epochs[(runtime, sink, epoch)]

    def put_aborted(self, runtime: str, generation: int, epoch: int, attempt: int) -> None:
        with self._lock:
            self._fence(runtime, generation)
            keys = [k for k in self._epochs if k[0] == runtime and k[2] == epoch]
            for key in keys:
                state = self._epochs[key]["state"]
                if state in (EpochState.PENDING, EpochState.COMMITTED):
                    raise MetaStoreError(f"epoch is {state.value}; it only rolls forward",
                                         runtime=runtime, sink=key[1], epoch=epoch)
            for key in keys:
                row = self._epochs[key]
                if row["state"] == EpochState.OPEN and row["attempt"] == attempt:
                    self._epochs[key] = {**row, "state": EpochState.ABORTED,
                                         "updated_at": time.time()}

    def delete_aborted(self, runtime: str, generation: int, epoch: int) -> None:
        with self._lock:
            self._fence(runtime, generation)
            for key in [k for k, row in self._epochs.items()
                        if k[0] == runtime and k[2] == epoch
                        and row["state"] == EpochState.ABORTED]:
                del self._epochs[key]

    # status --------------------------------------------------------------------------
    def set_sink_status(self, runtime: str, generation: int, sink: str, state: str,
                        error: str | None = None) -> None:
        with self._lock:
            self._fence(runtime, generation)
            old = self._statuses.get((runtime, sink))
            history = [] if old is None else list(old.history)
            if old is None or old.state != state:
                history.append({"time": time.time(), "state": state, "error": error})
            self._statuses[(runtime, sink)] = SinkStatusRecord(
                sink=sink, state=state, last_error=error, history=history[-HISTORY_LIMIT:])

    def sink_statuses(self, runtime: str) -> dict[str, SinkStatusRecord]:
        with self._lock:
            return {sink: copy.deepcopy(status)
                    for (rt, sink), status in self._statuses.items() if rt == runtime}

    def close(self) -> None:
        """Nothing to release; the data stays for the next user of this instance."""




def _row(sink: str, epoch: int, attempt: int, state: EpochState, *, layout: str = "{}",
         manifests: str | None = None) -> dict[str, Any]:
    return {"sink": sink, "epoch": epoch, "attempt": attempt, "state": state,
            "layout": layout, "manifests": manifests, "updated_at": time.time(),
            "marked": True}


def _decode(row: dict[str, Any]) -> EpochRecord:
    manifests = None if row["manifests"] is None else json.loads(row["manifests"])
    return EpochRecord(sink=row["sink"], epoch=row["epoch"], attempt=row["attempt"],
                       state=row["state"], layout=json.loads(row["layout"]),
                       manifests=manifests, updated_at=row["updated_at"],
                       marked=bool(row.get("marked", True)))
