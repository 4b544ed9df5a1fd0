"""The driver's lease of its runtime: one live driver per runtime name and meta store.

``LeaseKeeper`` runs in the driver (``SinkRuntime.start`` until ``close``)::

    acquire()   before any actor starts: take the lease in the meta store, or
                RuntimeInUseError naming who holds it and until when
    (thread)    renew it every ``seconds / 4``; a renewal that finds the lease taken by
                another driver makes ``lost`` say so (every later call of the runtime
                raises it), and a failed one is tried again at the next turn
    close()     stop renewing and release it: the next start takes it at once

A driver that dies (SIGKILL, its machine lost) stops renewing; its successor takes the
lease over:

* at once when the holder ran in this machine's process namespace and its process is
  gone (the pid is not running, or runs another program since: the start time differs);
* else once the lease expired: a start waits for that, up to its own ``seconds`` (10 s by
  default), and gives up with ``RuntimeInUseError`` as soon as the holder renews (it is
  alive) or the lease would outlast the wait.

Beyond the start, a coordinator claims a generation only for the lease's holder
(``MetaStore.claim(..., holder=)``): once a successor took the lease over, the old
driver cannot start a coordinator, and the successor's new generation fences every meta
store write of the old one.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from functools import cache
from typing import Any

from raysink.coordinator.metastore import _leases
from raysink.coordinator.metastore.base import Lease, MetaStore
from raysink.errors import MetaStoreError, RuntimeInUseError

__all__ = ["LEASE_SECONDS", "LeaseKeeper", "owner_gone"]

log = logging.getLogger(__name__)

LEASE_SECONDS = 10.0
"""How long a lease lasts without renewal: the longest a killed driver's successor on
another machine waits for it (``SinkRuntime(lease_timeout=...)``)."""


class LeaseKeeper:
    """The lease of ``runtime`` in ``store`` for this driver (it owns ``store`` and
    closes it in ``close``)."""

    def __init__(self, store: MetaStore, runtime: str, seconds: float = LEASE_SECONDS
                 ) -> None:
        self._store = store
        self.runtime = runtime
        self.seconds = seconds
        self.holder = uuid.uuid4().hex
        self.owner = _owner()
        self.lease: Lease | None = None
        self.lost: RuntimeInUseError | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self) -> Lease:
        """Take the lease (waiting for one a gone driver left, see the module), then keep
        it renewed. ``RuntimeInUseError`` when a live driver holds it."""
        first: Lease | None = None
        replace: str | None = None
        while True:
            lease = self._store.acquire_lease(self.runtime, self.holder, self.owner,
                                              self.seconds, replace=replace)
            if lease.holder == self.holder:
                break
            if owner_gone(lease.owner):
                log.info("%s: the lease holder %s is gone; taking its lease over",
                         self.runtime, lease.describe())
                replace = lease.holder
                continue
            if _alive_here(lease.owner) or lease.expires_at - lease.now > self.seconds \
                    or (first is not None and lease.expires_at > first.expires_at):
                here = _alive_here(lease.owner) and lease.owner.get("pid") == os.getpid()
                raise _leases.in_use(self.runtime, lease, here=here)
            if first is None:
                first = lease
                log.warning("%s: waiting for the lease held by %s (a killed driver's lease "
                            "expires; a live one is renewed)", self.runtime, lease.describe())
            time.sleep(min(0.5, max(0.05, lease.expires_at - lease.now)))
        self.lease = lease
        self._thread = threading.Thread(target=self._renew, name=f"raysink-lease-{self.runtime}",
                                        daemon=True)
        self._thread.start()
        return lease

    def _renew(self) -> None:
        while not self._stop.wait(self.seconds / 4):
            try:
                lease = self._store.acquire_lease(self.runtime, self.holder, self.owner,
                                                  self.seconds)
            except MetaStoreError as exc:
                log.warning("%s: renewing the lease failed (%s); trying again", self.runtime,
                            exc)
                continue
            if lease.holder != self.holder:
                self.lost = RuntimeInUseError(
                    f"this driver lost the runtime's lease (it was not renewed in time) to "
                    f"{lease.describe()}: that driver runs the runtime now. Close this one",
                    runtime=self.runtime, holder=lease.owner, until=lease.expires_at)
                log.error("%s", self.lost)
                return
            self.lease = lease

    def close(self) -> None:
        """Stop renewing, release the lease and close the store (idempotent)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        try:
            if self.lease is not None and self.lost is None:
                self._store.release_lease(self.runtime, self.holder)
        except MetaStoreError as exc:
            log.warning("%s: releasing the lease failed (%s); it expires in %.0f s",
                        self.runtime, exc, self.seconds)
        finally:
            self.lease = None
            self._store.close()


# --------------------------------------------------------------------------- who holds


def _owner() -> dict[str, Any]:
    """What this driver says of itself in its lease."""
    owner: dict[str, Any] = {"host": socket.gethostname(), "pid": os.getpid(),
                             "namespace": _namespace(), "started": _started(os.getpid())}
    try:
        import ray

        if ray.is_initialized():
            owner["ray"] = ray.get_runtime_context().gcs_address
    except Exception:  # Ray's address is for people to read; the lease works without it
        log.debug("no Ray address for the lease", exc_info=True)
    return owner


@cache
def _namespace() -> str | None:
    """This machine's boot and this process's pid namespace: pids mean the same process
    only where this matches (``None`` where it cannot be read: no ``/proc``)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as handle:
            boot = handle.read().strip()
        return f"{boot}/{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return None


def _started(pid: int) -> str | None:
    """The start time of process ``pid`` (clock ticks since boot), ``None`` when no such
    process runs (or ``/proc`` cannot tell)."""
    try:
        with open(f"/proc/{int(pid)}/stat") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError, ValueError):
        return None
    return fields[19] if len(fields) > 19 else None


def _same_namespace(owner: dict[str, Any]) -> bool:
    namespace = _namespace()
    return namespace is not None and owner.get("namespace") == namespace


def owner_gone(owner: dict[str, Any]) -> bool:
    """Whether the lease's holder is known to be gone: it ran in this process namespace
    and its process no longer does (no such pid, or one started at another time)."""
    pid, recorded = owner.get("pid"), owner.get("started")
    if not _same_namespace(owner) or not isinstance(pid, int):
        return False
    started = _started(pid)
    return started is None or (recorded is not None and started != recorded)


def _alive_here(owner: dict[str, Any]) -> bool:
    """Whether the lease's holder is a live process of this namespace."""
    pid, recorded = owner.get("pid"), owner.get("started")
    return (_same_namespace(owner) and isinstance(pid, int) and recorded is not None
            and _started(pid) == recorded)
