"""The driver's lease (``raysink.driver.lease``) over the in-memory meta store, without Ray.

Who holds a lease is told apart by what its holder said of itself: a holder in this
process namespace is known alive or gone from its pid and start time; one elsewhere only
by whether it renews before its lease expires.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from raysink.driver.lease import LeaseKeeper, _owner, _started, owner_gone
from raysink.errors import RuntimeInUseError
from raysink.testing import InMemoryMetaStore

RUNTIME = "rt"
ELSEWHERE = {"host": "elsewhere", "pid": 4242, "namespace": "another machine"}


def test_a_process_of_this_namespace_is_gone_once_it_exits() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        owner = {**_owner(), "pid": child.pid, "started": _started(child.pid)}
        assert not owner_gone(owner)
    finally:
        child.kill()
        child.wait()
    assert owner_gone(owner)
    assert not owner_gone(_owner())  # this process
    assert not owner_gone(ELSEWHERE)  # cannot tell: another namespace
    assert owner_gone({**_owner(), "started": "1"})  # this pid, but another process


def test_a_live_holder_here_refuses_at_once_and_close_frees_the_lease() -> None:
    store = InMemoryMetaStore()
    first = LeaseKeeper(store, RUNTIME, seconds=30.0)
    lease = first.acquire()
    assert (lease.holder, lease.token, lease.owner["pid"]) == (first.holder, 1, os.getpid())
    second = LeaseKeeper(store, RUNTIME, seconds=30.0)
    started = time.monotonic()
    with pytest.raises(RuntimeInUseError, match=f"pid {os.getpid()} on host .*this very "
                                                "process") as info:
        second.acquire()
    assert time.monotonic() - started < 5.0  # it did not wait for the 30 s lease
    assert info.value.holder is not None and info.value.holder["pid"] == os.getpid()
    first.close()
    assert second.acquire().token == 2
    second.close()


def test_a_gone_holder_here_is_replaced_at_once() -> None:
    store = InMemoryMetaStore()
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    gone = {**_owner(), "pid": child.pid, "started": "0"}
    store.acquire_lease(RUNTIME, "killed", gone, 3600.0)
    keeper = LeaseKeeper(store, RUNTIME, seconds=30.0)
    lease = keeper.acquire()
    assert (lease.holder, lease.token) == (keeper.holder, 2)
    keeper.close()


def test_a_holder_elsewhere_is_waited_for_until_its_lease_expires() -> None:
    store = InMemoryMetaStore()
    store.acquire_lease(RUNTIME, "elsewhere", ELSEWHERE, 0.6)
    keeper = LeaseKeeper(store, RUNTIME, seconds=2.0)
    lease = keeper.acquire()  # it stopped renewing: its lease expires, then it is ours
    assert (lease.holder, lease.token) == (keeper.holder, 2)
    keeper.close()


def test_a_holder_elsewhere_that_renews_refuses_the_start() -> None:
    store = InMemoryMetaStore()
    store.acquire_lease(RUNTIME, "elsewhere", ELSEWHERE, 0.6)
    real = store.acquire_lease

    def renewing(runtime: str, holder: str, *args: object, **kwargs: object) -> object:
        real(runtime, "elsewhere", ELSEWHERE, 0.6)  # the holder renews meanwhile
        return real(runtime, holder, *args, **kwargs)  # type: ignore[arg-type]

    store.acquire_lease = renewing  # type: ignore[method-assign]
    with pytest.raises(RuntimeInUseError, match="pid 4242 on host elsewhere until"):
        LeaseKeeper(store, RUNTIME, seconds=2.0).acquire()


def test_a_lease_longer_than_the_wait_refuses_the_start_at_once() -> None:
    store = InMemoryMetaStore()
    store.acquire_lease(RUNTIME, "elsewhere", ELSEWHERE, 600.0)
    with pytest.raises(RuntimeInUseError, match=r"elsewhere until .*, (599|600)\.\d s from now"):
        LeaseKeeper(store, RUNTIME, seconds=2.0).acquire()


def test_a_lease_lost_to_another_driver_is_reported() -> None:
    """The keeper renews every quarter of its lease; when another driver took the lease
    meanwhile (this one was stalled past it), ``lost`` says so and nothing is released."""
    store = InMemoryMetaStore()
    keeper = LeaseKeeper(store, RUNTIME, seconds=0.4)
    keeper.acquire()
    store.acquire_lease(RUNTIME, "successor", ELSEWHERE, 60.0, replace=keeper.holder)
    deadline = time.monotonic() + 10.0
    while keeper.lost is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert keeper.lost is not None and "lost the runtime's lease" in str(keeper.lost)
    keeper.close()
    lease = store.lease(RUNTIME)
    assert lease is not None and lease.holder == "successor" and lease.live
