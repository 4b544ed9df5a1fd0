"""Issue 14 without Ray: the fault hooks' opt-in, the typed-error guard, the watchdog, the
reorder buffer's bound and sink health."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from ray.exceptions import ActorUnavailableError

from raysink.coordinator.health import SinkHealthBook
from raysink.driver.calls import ask, typed_errors
from raysink.errors import EpochFailedError, RaySinkError, RuntimeUnavailableError
from raysink.protocol.clients import Call
from raysink.writer.mailbox import Mailbox, Verdict
from raysink.writer.watchdog import Watchdog

# ----------------------------------------------------------------------------- fault hooks

_HIT = """
import os, sys
import raysink._faults as faults
{prelude}
faults.hit("writer.during_write", runtime="victim", epoch=1)
print("alive", faults.enabled())
"""


def _run_hit(env: dict[str, str], prelude: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", _HIT.format(prelude=prelude)], env=env,
                          capture_output=True, text=True, timeout=120, check=False)


def _plant(directory: Path) -> Path:
    """An arm file as anyone who can write to the directory could leave it: a kill."""
    directory.mkdir(parents=True, exist_ok=True)
    arm = directory / "victim--writer.during_write.json"
    arm.write_text(json.dumps({"action": "kill", "times": 1, "when": {}}))
    return arm


def _env_without_opt_in(tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "RAYSINK_FAULT_DIR"}
    env["TMPDIR"] = str(tmp)  # the system temp dir the old default lived under
    return env


def test_an_arm_file_alone_does_nothing(tmp_path: Path) -> None:
    """A process without the opt-in ignores an arm file in the old default directory
    (``<tmp>/raysink-faults``, writable by anyone who can write to the temp dir)."""
    arm = _plant(tmp_path / "raysink-faults")
    done = _run_hit(_env_without_opt_in(tmp_path))
    assert done.returncode == 0 and "alive False" in done.stdout, done
    assert arm.exists()  # not consumed, not even read


def test_the_opt_in_arms_the_hooks(tmp_path: Path) -> None:
    """The same arm fires (a SIGKILL of the process) where ``RAYSINK_FAULT_DIR`` names its
    directory: the test itself can fail."""
    _plant(tmp_path / "arms")
    env = {**_env_without_opt_in(tmp_path), "RAYSINK_FAULT_DIR": str(tmp_path / "arms")}
    done = _run_hit(env)
    assert done.returncode == -9, done


def test_hooks_touch_no_file_when_off(tmp_path: Path) -> None:
    """Off costs one test of a module constant: no file system call at all."""
    prelude = ("import os\n"
               "def refuse(*a, **k):\n    raise AssertionError('a file was looked at')\n"
               "os.stat = os.lstat = os.open = refuse")
    done = _run_hit(_env_without_opt_in(tmp_path), prelude)
    assert done.returncode == 0 and "alive False" in done.stdout, done


# ----------------------------------------------------------------------------- typed errors


class _Runtime:
    name = "rt"

    @typed_errors(EpochFailedError, "write_arrow")
    def write(self, exc: BaseException) -> None:
        raise exc


def test_typed_errors_keep_raysink_errors_and_wrap_the_rest() -> None:
    raysink = EpochFailedError("bad", runtime="rt")
    with pytest.raises(EpochFailedError) as kept:
        _Runtime().write(raysink)
    assert kept.value is raysink
    ray_error = ActorUnavailableError("The actor is restarting", None)
    with pytest.raises(EpochFailedError, match="write_arrow failed") as wrapped:
        _Runtime().write(ray_error)
    assert wrapped.value.__cause__ is ray_error and wrapped.value.runtime == "rt"


def test_ask_waits_for_a_restarting_actor_then_gives_up_with_a_typed_error() -> None:
    calls: list[int] = []

    def restarting() -> Any:
        calls.append(1)
        if len(calls) < 3:
            raise ActorUnavailableError("The actor is restarting", None)
        return _Ready(7)

    assert ask(Call[int](restarting), what="status", timeout=5, runtime="rt") == 7
    assert len(calls) == 3

    def forever() -> Any:
        raise ActorUnavailableError("The actor is restarting", None)

    with pytest.raises(RuntimeUnavailableError, match="still restarting") as failed:
        ask(Call[int](forever), what="status", timeout=0.5, runtime="rt")
    assert isinstance(failed.value.__cause__, ActorUnavailableError)
    assert isinstance(failed.value, RaySinkError)


class _Ready:
    """Stands for an object ref: ``ray.get`` is patched below to return its value."""

    def __init__(self, value: int) -> None:
        self.value = value


@pytest.fixture(autouse=True)
def _fake_get(monkeypatch: pytest.MonkeyPatch) -> None:
    import ray

    monkeypatch.setattr(ray, "get", lambda ref, timeout=None: ref.value)


# ----------------------------------------------------------------------------- watchdog


def test_watchdog_keeps_warning_while_a_call_hangs(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    dog = Watchdog("rt.main.writer-0", every=5.0, clock=lambda: now[0])
    assert dog.check() is None and dog.busy() is None
    with caplog.at_level(logging.WARNING), dog.watching("flush"):
        for second in range(1, 17):
            now[0] = float(second)
            dog.check()
        assert dog.busy() == {"call": "flush", "seconds": 16.0}
    assert dog.warnings == 3  # at 5, 10 and 15 s
    assert [r.getMessage() for r in caplog.records][-1].endswith(
        "flush has been running for 15 s; the sink may be stuck")
    assert dog.busy() is None


# ----------------------------------------------------------------------------- mailbox


def test_reorder_buffer_refuses_early_messages_over_its_bound() -> None:
    box: Mailbox[str] = Mailbox(max_bytes=100)
    verdicts = [box.offer(1, 0, 0, seq, f"m{seq}", 40)[0] for seq in (1, 2, 3)]
    assert verdicts == [Verdict.ACCEPTED, Verdict.ACCEPTED, Verdict.FULL]
    assert box.waiting_bytes == 80
    # the message needed next is always taken, whatever its size
    assert box.offer(1, 0, 0, 0, "m0", 1_000)[0] is Verdict.ACCEPTED
    claimed = box.take_ready()
    assert claimed is not None and [m for _, m in claimed[1]] == ["m0", "m1", "m2"]
    box.applied(claimed[0], [feed for feed, _ in claimed[1]], 0)
    assert box.waiting_bytes == 0
    assert box.offer(1, 0, 0, 3, "m3", 40)[0] is Verdict.ACCEPTED


# ----------------------------------------------------------------------------- health


def test_sink_health_is_stalled_while_a_writer_or_the_commit_fails() -> None:
    book = SinkHealthBook(["db", "lake"])
    book.started()
    book.writer("db", 1, "SinkUnavailableError: down")
    assert (book["db"].state, book["db"].last_error) == (
        "stalled", "writer 1: SinkUnavailableError: down")
    assert book["lake"].state == "running"
    book.commit_failed("db", ConnectionError("refused"))
    assert book["db"].last_error == "ConnectionError: refused"
    book.writer("db", 1, None)  # the writer reached it again: the commit still fails
    assert (book["db"].state, book["db"].last_error) == ("stalled", "ConnectionError: refused")
    book.writer("db", 0, "SinkUnavailableError: down")
    book.committed("db")  # a commit reached the target: reachable, for the writers too
    assert (book["db"].state, book["db"].last_error) == ("running", None)
    book.paused()
    assert book["db"].state == "paused"
