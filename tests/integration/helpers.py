"""Shared pieces of the integration tests: input tables, reading targets back, killing."""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.dataset as ds

from raysink.errors import SinkUnavailableError
from raysink.reports import ActorProcess
from raysink.testing import fired


def closes_with_epoch_pending() -> Any:
    """``pytest.raises`` for a runtime closed while a decided epoch cannot commit (its
    sink stalled): ``rt.close()`` raises, naming the epoch the next start commits."""
    import pytest

    return pytest.raises(SinkUnavailableError,
                         match=r"is decided but not committed.*next start of runtime")


def epoch_table(epoch: int, rows: int = 500, *, writers_hint: int = 0) -> pa.Table:
    """Rows with globally unique ids: ``epoch * 1_000_000 + i``."""
    ids = [epoch * 1_000_000 + i for i in range(rows)]
    return pa.table({
        "id": pa.array(ids, pa.int64()),
        "customer": pa.array([f"c{i % 37}" for i in range(rows)], pa.string()),
        "amount": pa.array([float(i) * 1.5 for i in range(rows)], pa.float64()),
    })


def read_ids(path: str | Path) -> list[int]:
    """Every id visible to readers of the Parquet directory."""
    if not Path(path).exists():
        return []
    dataset = ds.dataset(str(path), format="parquet")
    if not dataset.files:
        return []
    table = dataset.to_table(columns=["id"])
    return [int(v) for v in table.column("id").to_pylist()]


def assert_exactly(path: str | Path, epochs: list[int], rows: int, *,
                   before: Iterable[int] = ()) -> None:
    """The target holds every input row of ``epochs`` exactly once, what it held
    ``before`` (its ids read then: a runtime shared by a module's tests) as it was, and
    nothing else."""
    seen = Counter(read_ids(path))
    expected = Counter(before) + Counter(e * 1_000_000 + i for e in epochs for i in range(rows))
    doubled = sorted(k for k, v in seen.items() if v > max(expected[k], 1))
    missing = sorted(k for k, v in expected.items() if seen[k] < v)
    extra = sorted(set(seen) - set(expected))
    assert not doubled, f"rows written twice: {doubled[:10]} ({len(doubled)} in all)"
    assert not missing, f"rows lost: {missing[:10]} ({len(missing)} in all)"
    assert not extra, f"rows from nowhere: {extra[:10]} ({len(extra)} in all)"


def writer_owners(path: str | Path, column: str = "customer") -> dict[str, set[str]]:
    """For each value of ``column`` in a Parquet directory, the writers (``-w<k>`` in the
    file names) whose files hold it: keyed routing puts each key on one writer."""
    owners: dict[str, set[str]] = {}
    for fragment in ds.dataset(str(path), format="parquet").get_fragments():
        writer = Path(fragment.path).name.split("-w")[1][:4]
        for value in fragment.to_table(columns=[column]).column(0).to_pylist():
            owners.setdefault(value, set()).add(writer)
    return owners


def run_in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    """Run ``fn`` in a daemon thread; its ``result`` or ``error`` lands in the returned box,
    and ``ended`` (``time.monotonic()``) once it returned either way."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["result"] = fn()
        except BaseException as exc:  # re-raised by the caller
            box["error"] = exc
        finally:
            box["ended"] = time.monotonic()

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, box


def wait_fired(runtime: str, point: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not fired(runtime, point):
        if time.monotonic() > deadline:
            raise AssertionError(f"fault point {point} never fired for {runtime}")
        time.sleep(0.02)


def sigkill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)


def actor_process(rt: Any, role: str = "coordinator", *, sink: str = "main", writer: int = 0,
                  wait: float = 60.0) -> ActorProcess:
    """The runtime's coordinator (or, ``role="writer"``, writer ``writer`` of ``sink``) as
    ``rt.processes()`` shows it, once it answers: up to ``wait`` seconds while Ray
    restarts it."""
    deadline = time.monotonic() + wait
    while True:
        left = deadline - time.monotonic()
        found = [p for p in rt.processes(timeout=max(1.0, min(10.0, left)))
                 if p.role == role and (role != "writer" or (p.sink, p.writer) == (sink, writer))]
        if found and found[0].answered:
            return found[0]
        if left <= 0:
            raise AssertionError(f"{role} {sink}/{writer} of {rt.name} did not answer within "
                                 f"{wait:g} s: {found}")
        time.sleep(0.2)


def actor_pid(rt: Any, role: str = "coordinator", *, sink: str = "main", writer: int = 0,
              wait: float = 60.0) -> int:
    """The process id of ``actor_process(...)``."""
    pid = actor_process(rt, role, sink=sink, writer=writer, wait=wait).pid
    assert pid is not None
    return pid


def unique_name(prefix: str) -> str:
    """A runtime name no other test or session uses, for a runtime a module's tests share
    (the ``name`` fixture is one test's)."""
    return f"{prefix[:20]}-{uuid.uuid4().hex[:8]}"


def end_for_good(rt: Any, *, sink: str = "main", writer: int = 0, wait: float = 30.0) -> None:
    """End writer ``writer`` of ``sink`` with ``ray.kill``: Ray does not restart it (as
    when an actor's restarts ran out). Returns once Ray's GCS lists it dead."""
    import ray

    from raysink.driver import raystate

    handle = rt._actors.writers[sink][writer]
    ray.kill(handle)
    deadline = time.monotonic() + wait
    while raystate.state_of(handle) != "DEAD":
        if time.monotonic() > deadline:
            raise AssertionError(f"writer {writer} of {sink} not dead {wait:g} s after ray.kill")
        time.sleep(0.05)
