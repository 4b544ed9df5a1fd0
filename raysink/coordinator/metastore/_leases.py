"""The runtime's lease in the SQL meta stores (see ``base`` for what it means).

One row per runtime in ``raysink_leases``; it is never deleted, so ``token`` keeps growing
over the holders. Every statement runs inside a transaction of ``SqlMetaStore`` whose
read of the row locks it (``lock``: ``FOR UPDATE`` on PostgreSQL; SQLite's ``BEGIN
IMMEDIATE`` holds the whole database), and times come from the database's own clock
(``now``), so the drivers' clocks never meet.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from raysink.coordinator.metastore.base import Lease
from raysink.errors import MetaStoreError, RuntimeInUseError

if TYPE_CHECKING:
    from raysink.coordinator.metastore._sql import Tx

LEASES = "raysink_leases"

DDL = f"""CREATE TABLE IF NOT EXISTS {LEASES} (
        runtime TEXT PRIMARY KEY,
        holder TEXT NOT NULL,
        owner TEXT NOT NULL,
        token BIGINT NOT NULL,
        expires_at DOUBLE PRECISION NOT NULL)"""

SELECT = f"SELECT holder, owner, token, expires_at FROM {LEASES} WHERE runtime = ?"


def read(tx: Tx, runtime: str, now: float, lock: str = "") -> Lease | None:
    """The runtime's lease, locked with ``lock`` appended to the query."""
    row = tx.one(SELECT + lock, runtime)
    if row is None:
        return None
    try:
        owner = json.loads(row[1])
        if not isinstance(owner, dict):
            raise ValueError(f"owner should be a JSON object, got {owner!r:.80}")
    except ValueError as exc:
        raise MetaStoreError(f"the lease row of the runtime in table {LEASES} does not "
                             f"decode ({exc}); delete that row, then start again",
                             runtime=runtime) from exc
    return Lease(runtime=runtime, holder=str(row[0]), owner=owner, token=int(row[2]),
                 expires_at=float(row[3]), now=now)


def acquire(tx: Tx, runtime: str, holder: str, owner: Mapping[str, Any], seconds: float,
            now: float, *, replace: str | None, lock: str = "") -> Lease:
    """Take or renew the lease when it is free for ``holder`` (see ``MetaStore``)."""
    text = json.dumps(dict(owner), sort_keys=True, default=str)
    current = read(tx, runtime, now, lock)
    if current is None:
        if tx.run(f"INSERT INTO {LEASES} (runtime, holder, owner, token, expires_at) "
                  "VALUES (?, ?, ?, 1, ?) ON CONFLICT (runtime) DO NOTHING",
                  runtime, holder, text, now + seconds) == 1:
            return Lease(runtime=runtime, holder=holder, owner=dict(owner), token=1,
                         expires_at=now + seconds, now=now)
        current = read(tx, runtime, now, lock)  # inserted meanwhile by another process
        assert current is not None
    if current.holder != holder and current.live and current.holder != replace:
        return current
    token = current.token if current.holder == holder else current.token + 1
    tx.run(f"UPDATE {LEASES} SET holder = ?, owner = ?, token = ?, expires_at = ? "
           "WHERE runtime = ?", holder, text, token, now + seconds, runtime)
    return Lease(runtime=runtime, holder=holder, owner=dict(owner), token=token,
                 expires_at=now + seconds, now=now)


def release(tx: Tx, runtime: str, holder: str, now: float) -> None:
    tx.run(f"UPDATE {LEASES} SET expires_at = ? WHERE runtime = ? AND holder = ? "
           "AND expires_at > ?", now, runtime, holder, now)


def check_holder(tx: Tx, runtime: str, holder: str, now: float, lock: str = "") -> None:
    """``RuntimeInUseError`` unless ``holder`` has the lease (live or expired, but not
    taken by another)."""
    current = read(tx, runtime, now, lock)
    if current is not None and current.holder == holder:
        return
    raise in_use(runtime, current)


def in_use(runtime: str, lease: Lease | None, *, here: bool = False) -> RuntimeInUseError:
    """The error for a start refused by ``lease`` (``None``: this driver holds none);
    ``here``: its holder is the calling process itself."""
    if lease is None:
        return RuntimeInUseError(
            "this driver holds no lease of the runtime (its lease row is gone); close the "
            "runtime and start it again", runtime=runtime)
    where = ("this very process: close the other SinkRuntime of this name first" if here
             else "close it there, or pick another runtime name (a driver that was killed "
                  "loses the lease when it expires; a new start then takes it over)")
    return RuntimeInUseError(
        f"the runtime is open in another driver: its lease is held by {lease.describe()}; "
        f"{where}", runtime=runtime, holder=lease.owner, until=lease.expires_at)
