"""The previous release, built from its git tag and installed into an environment of its
own, and a driver process of it whose whole Ray can be ended by pid.

``previous_release(tag)`` builds the wheel reproducibly: ``git archive <tag>`` into a
fresh directory (the tagged tree, nothing of the work tree), then ``pip wheel --no-deps``
(the tag's own ``pyproject.toml`` and build backend, in pip's isolated build
environment). The environment is a virtual environment of its own (``python -m venv
--without-pip`` from the interpreter this venv was made from) whose ``site-packages``
holds a ``.pth`` line naming this interpreter's ``site-packages`` (Ray, pyarrow, the
targets' clients: the dependencies, not installed twice; ``.pth`` files of that directory
are not run, so this venv's editable raysink is not seen) and the wheel installed
``--no-deps`` by ``pip --python``. Both are kept under ``~/.cache/raysink/upgrade/<tag>-
<commit>`` (``RAYSINK_UPGRADE_CACHE`` moves it) and reused while the tag names the same
commit; ``fresh=True`` builds them again.

``OldDriver`` runs ``tests/upgrade/old_driver.py`` with that environment's interpreter,
from a directory outside the source tree and without ``PYTHONPATH``, so it and its Ray
workers import the previous release. Its Ray keeps its files in a directory of its own;
``kill()`` SIGKILLs the driver, then every process whose command line names that
directory (its GCS, raylet and workers, orphaned by the driver's death), by pid.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
OLD_DRIVER = Path(__file__).resolve().with_name("old_driver.py")


@dataclass(frozen=True)
class Release:
    """A previous release, installed: ``python`` imports it."""

    tag: str
    commit: str
    wheel: Path
    python: Path


def _cache() -> Path:
    default = Path.home() / ".cache" / "raysink" / "upgrade"
    return Path(os.environ.get("RAYSINK_UPGRADE_CACHE", default))


def _run(*args: str | Path, cwd: Path | None = None) -> str:
    done = subprocess.run([str(a) for a in args], cwd=cwd, capture_output=True, text=True,
                          timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, args))} failed ({done.returncode}):\n"
                           f"{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    return done.stdout


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def previous_release(tag: str, *, fresh: bool = False) -> Release:
    """The release ``tag`` names, built and installed (or found built)."""
    commit = _run("git", "-C", REPO, "rev-parse", f"{tag}^{{commit}}").strip()
    home = _cache() / f"{tag}-{commit[:12]}"
    with _locked(home.with_suffix(".lock")):
        done = home / "installed.json"
        if fresh or not done.exists():
            shutil.rmtree(home, ignore_errors=True)
            wheel = _build_wheel(commit, home)
            python = _make_env(home / "venv", wheel)
            done.write_text(json.dumps({"wheel": str(wheel), "python": str(python)}))
        found = json.loads(done.read_text())
    return Release(tag=tag, commit=commit, wheel=Path(found["wheel"]),
                   python=Path(found["python"]))


def _build_wheel(commit: str, home: Path) -> Path:
    source, dist = home / "src", home / "dist"
    source.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", "--format=tar", commit],
                             capture_output=True, check=True, timeout=120).stdout
    subprocess.run(["tar", "-x", "-C", str(source)], input=archive, check=True, timeout=120)
    _run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", dist, source)
    wheels = sorted(dist.glob("raysink-*.whl"))
    if len(wheels) != 1:
        raise RuntimeError(f"building {commit} made {wheels}, not one raysink wheel")
    return wheels[0]


def _make_env(venv: Path, wheel: Path) -> Path:
    base = getattr(sys, "_base_executable", sys.executable)
    _run(base, "-m", "venv", "--without-pip", venv)
    python = venv / "bin" / "python"
    purelib = Path(_run(python, "-c", "import sysconfig; print(sysconfig.get_paths()"
                                      "['purelib'])").strip())
    deps = sysconfig.get_paths()["purelib"]
    (purelib / "_raysink_upgrade_deps.pth").write_text(f"{deps}\n")
    _run(sys.executable, "-m", "pip", "--python", python, "install", "--no-deps",
         "--no-index", "--quiet", wheel)
    return python


class OldDriver:
    """``old_driver.py`` run by ``release``'s interpreter, with a Ray of its own."""

    def __init__(self, release: Release, config: dict[str, Any], directory: Path) -> None:
        self.lines: list[str] = []
        self.ray_dir = tempfile.mkdtemp(prefix="rsup", dir="/tmp")  # short: socket paths
        self._stderr = directory / "old-driver.stderr"
        self._fault_dir = directory / "old-faults"
        self._fault_dir.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items()
               if k not in ("PYTHONPATH", "RAY_ADDRESS", "RAYSINK_FAULT_DIR")}
        env["RAYSINK_FAULT_DIR"] = str(self._fault_dir)
        config = {**config, "ray_dir": self.ray_dir}
        run_in = directory / "old-cwd"
        run_in.mkdir(parents=True, exist_ok=True)
        with open(self._stderr, "wb") as err:
            self.proc = subprocess.Popen(
                [str(release.python), str(OLD_DRIVER), json.dumps(config)], cwd=run_in,
                env=env, stdout=subprocess.PIPE, stderr=err, text=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.strip())

    def wait_for(self, prefix: str, timeout: float) -> str:
        """The first line starting with ``prefix``; ``AssertionError`` naming what the
        driver printed when it does not come (or the driver exits first)."""
        deadline = time.monotonic() + timeout
        while True:
            found = next((line for line in self.lines if line.startswith(prefix)), None)
            if found is not None:
                return found
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise AssertionError(f"the old driver never printed {prefix!r}: "
                                     f"{self.lines[-10:]}\n{self.stderr_tail()}")
            time.sleep(0.05)

    def stderr_tail(self) -> str:
        try:
            return self._stderr.read_text(errors="replace")[-3000:]
        except OSError:
            return ""

    def ray_pids(self) -> list[int]:
        """The processes of the driver's Ray (their command lines name its directory)."""
        return [proc.pid for proc in _matching(lambda cmdline: self.ray_dir in cmdline)]

    def kill(self) -> list[int]:
        """SIGKILL the driver, then what is left of its Ray (Ray's own processes die with
        the driver that started them, its workers with their raylet, not all at once);
        returns the pids this had to end besides the driver."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)
        ended = _kill_matching(lambda cmdline: self.ray_dir in cmdline)
        self._reader.join(timeout=5)
        return ended

    def cleanup(self) -> None:
        if self.proc.poll() is None:
            self.kill()
        else:
            _kill_matching(lambda cmdline: self.ray_dir in cmdline)
        shutil.rmtree(self.ray_dir, ignore_errors=True)


def _kill_matching(match: Callable[[str], bool], rounds: int = 5) -> list[int]:
    """SIGKILL every process whose command line ``match``es, by pid, until none is left
    (a raylet may start a worker while the others die)."""
    import psutil

    ended: list[int] = []
    for _ in range(rounds):
        found = _matching(match)
        if not found:
            break
        for proc in found:
            with contextlib.suppress(psutil.Error):
                proc.kill()
                ended.append(proc.pid)
        psutil.wait_procs(found, timeout=10)
    return ended


def _matching(match: Callable[[str], bool]) -> list[Any]:
    import psutil

    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmdline = " ".join(proc.info.get("cmdline") or ())
        if proc.info["pid"] != os.getpid() and match(cmdline):
            found.append(proc)
    return found
