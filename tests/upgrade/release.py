"""The previous releases, as the wheels they were released as, each installed into an
environment of its own, and a driver process of one whose whole Ray can be ended by pid.

The wheels are kept in ``tests/upgrade/releases/`` with ``releases.json`` naming, per tag,
the version, the commit, the wheel's SHA-256 and the meta store schema version it writes:
a clone needs neither the tags nor the history to test an upgrade from them (CI's clone has
no tags). ``python -m tests.upgrade.release store TAG`` makes one: ``git archive TAG`` into
a fresh directory (the tagged tree, nothing of the work tree), then ``python -m build
--wheel`` on it with ``SOURCE_DATE_EPOCH`` at the tag's commit time, and records it.
``python -m tests.upgrade.release check`` builds every stored tag found in the clone again
the same way and compares the package files (their paths and hashes in the wheel's
``RECORD``) with the stored wheel's: the stored wheel is what its tag builds.

``previous_release(tag)`` checks the stored wheel's hash and installs it into a virtual
environment of its own (``python -m venv --without-pip`` from the interpreter this venv
was made from) whose ``site-packages`` holds a ``.pth`` line naming this interpreter's
``site-packages`` (Ray, pyarrow, the targets' clients: the dependencies, not installed
twice; the release's own ``site-packages`` comes first, so its raysink is the one imported,
and ``.pth`` files of the named directory are not run, so an editable raysink there is not
seen) and the wheel installed ``--no-deps`` by ``pip --python``. It is kept under
``~/.cache/raysink/upgrade/<tag>-<sha256>`` (``RAYSINK_UPGRADE_CACHE`` moves it) and
reused, its ``.pth`` line written again at every use (``make upgrade`` runs from a fresh
venv each time); ``fresh=True`` installs it again.

``OldDriver`` runs ``tests/upgrade/old_driver.py`` with that environment's interpreter,
from a directory outside the source tree and without ``PYTHONPATH``, so it and its Ray
workers import the previous release. Its Ray keeps its files in a directory of its own;
``kill()`` SIGKILLs the driver, then every process whose command line names that
directory (its GCS, raylet and workers, orphaned by the driver's death), by pid.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
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
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
OLD_DRIVER = Path(__file__).resolve().with_name("old_driver.py")
RELEASES = Path(__file__).resolve().with_name("releases")
INDEX = RELEASES / "releases.json"


@dataclass(frozen=True)
class Release:
    """A previous release, installed: ``python`` imports it."""

    tag: str
    version: str
    commit: str
    schema: int
    wheel: Path
    python: Path


def stored_releases() -> dict[str, dict[str, Any]]:
    """``releases.json``: per tag, its version, commit, wheel, sha256 and schema."""
    found: dict[str, dict[str, Any]] = json.loads(INDEX.read_text())
    return found


def _cache() -> Path:
    default = Path.home() / ".cache" / "raysink" / "upgrade"
    return Path(os.environ.get("RAYSINK_UPGRADE_CACHE", default))


def _run(*args: str | Path, cwd: Path | None = None,
         env: dict[str, str] | None = None) -> str:
    done = subprocess.run([str(a) for a in args], cwd=cwd, capture_output=True, text=True,
                          timeout=900, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, args))} failed ({done.returncode}):\n"
                           f"{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    return done.stdout


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


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
    """The release ``tag`` names, its stored wheel checked and installed (or found
    installed)."""
    entry = stored_releases()[tag]
    wheel = RELEASES / entry["wheel"]
    found = _sha256(wheel)
    if found != entry["sha256"]:
        raise RuntimeError(f"{wheel} has sha256 {found}, releases.json says "
                           f"{entry['sha256']}: store it again "
                           f"(python -m tests.upgrade.release store {tag})")
    home = _cache() / f"{tag}-{found[:12]}"
    with _locked(home.with_suffix(".lock")):
        done = home / "installed.json"
        if fresh or not _installed(done):
            shutil.rmtree(home, ignore_errors=True)
            home.mkdir(parents=True)
            python, package = _make_env(home / "venv", wheel)
            done.write_text(json.dumps({"python": str(python), "package": str(package)}))
        python = Path(json.loads(done.read_text())["python"])
        _point_at_dependencies(python)
    return Release(tag=tag, version=entry["version"], commit=entry["commit"],
                   schema=int(entry["schema"]), wheel=wheel, python=python)


def _installed(done: Path) -> bool:
    """Whether an environment made before still holds its release's own raysink."""
    if not done.exists():
        return False
    found = json.loads(done.read_text())
    return "package" in found and Path(found["package"], "__init__.py").exists()


def _make_env(venv: Path, wheel: Path) -> tuple[Path, Path]:
    """The environment's interpreter and the raysink package installed in it.

    ``--ignore-installed``: pip sees the dependencies' directory too, where a raysink of
    the same version (this one, installed from its wheel) would make it skip the
    install; it must neither skip nor remove that one."""
    base = getattr(sys, "_base_executable", sys.executable)
    _run(base, "-m", "venv", "--without-pip", venv)
    python = venv / "bin" / "python"
    purelib = _point_at_dependencies(python)
    _run(sys.executable, "-m", "pip", "--python", python, "install", "--no-deps",
         "--ignore-installed", "--no-index", "--quiet", wheel)
    package = purelib / "raysink"
    if not (package / "__init__.py").exists():
        raise RuntimeError(f"installing {wheel.name} left no raysink in {purelib}")
    return python, package


def _point_at_dependencies(python: Path) -> Path:
    """Have the release's environment find its dependencies in this interpreter's
    ``site-packages``, written at every use: the environment is cached, the interpreter
    running the test is not (``make upgrade`` makes a fresh one each time). Returns the
    environment's own ``site-packages``."""
    purelib = Path(_run(python, "-c", "import sysconfig; print(sysconfig.get_paths()"
                                      "['purelib'])").strip())
    deps = sysconfig.get_paths()["purelib"]
    (purelib / "_raysink_upgrade_deps.pth").write_text(f"{deps}\n")
    return purelib


def build_from_tag(tag: str, out: Path) -> tuple[str, Path]:
    """The wheel ``tag`` builds (its commit, the wheel in ``out``): ``git archive`` of the
    tag, ``python -m build --wheel`` with ``SOURCE_DATE_EPOCH`` at the commit's time."""
    commit = _run("git", "-C", REPO, "rev-parse", f"{tag}^{{commit}}").strip()
    when = _run("git", "-C", REPO, "log", "-1", "--format=%ct", commit).strip()
    with tempfile.TemporaryDirectory(prefix="raysink-release-") as scratch:
        source = Path(scratch) / "src"
        source.mkdir()
        archive = subprocess.run(["git", "-C", str(REPO), "archive", "--format=tar", commit],
                                 capture_output=True, check=True, timeout=120).stdout
        subprocess.run(["tar", "-x", "-C", str(source)], input=archive, check=True,
                       timeout=120)
        env = {**os.environ, "SOURCE_DATE_EPOCH": when}
        _run(sys.executable, "-m", "build", "--wheel", "--outdir", out, source, env=env)
    wheels = sorted(out.glob("raysink-*.whl"))
    if len(wheels) != 1:
        raise RuntimeError(f"building {tag} ({commit}) made {wheels}, not one raysink wheel")
    return commit, wheels[0]


def package_files(wheel: Path) -> dict[str, str]:
    """The package's files in ``wheel`` and their hashes, from its ``RECORD`` (the
    ``.dist-info`` metadata is left out: its form follows the build backend's version)."""
    with zipfile.ZipFile(wheel) as archive:
        (record,) = [n for n in archive.namelist() if n.endswith(".dist-info/RECORD")]
        lines = archive.read(record).decode().splitlines()
    files = {}
    for line in lines:
        path, digest, _ = line.rsplit(",", 2)
        if digest and ".dist-info/" not in path:
            files[path] = digest
    return files


def _schema_of(wheel: Path) -> int:
    """The meta store schema version the release writes, asked of its own code (imported
    from the wheel in a process of its own); 1 before the version was kept."""
    with zipfile.ZipFile(wheel) as archive:
        if "raysink/coordinator/metastore/_versions.py" not in archive.namelist():
            return 1
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from raysink.coordinator."
            "metastore._versions import SCHEMA_VERSION; print(SCHEMA_VERSION)")
    return int(_run(sys.executable, "-c", code, wheel, cwd=Path(tempfile.gettempdir()),
                    env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"}).strip())


def store(tag: str) -> dict[str, Any]:
    """Build ``tag`` and keep its wheel in ``releases/``, recorded in ``releases.json``."""
    with tempfile.TemporaryDirectory(prefix="raysink-dist-") as out:
        commit, built = build_from_tag(tag, Path(out))
        RELEASES.mkdir(exist_ok=True)
        wheel = RELEASES / built.name
        shutil.copyfile(built, wheel)
    version = wheel.name.split("-")[1]
    entry = {"version": version, "commit": commit, "wheel": wheel.name,
             "sha256": _sha256(wheel), "schema": _schema_of(wheel)}
    index = stored_releases() if INDEX.exists() else {}
    index[tag] = entry
    INDEX.write_text(json.dumps(dict(sorted(index.items())), indent=2) + "\n")
    return entry


def check() -> list[str]:
    """Every stored tag this clone has, built again and compared with its stored wheel;
    returns what differs (a line each) and prints what it did."""
    problems = []
    for tag, entry in stored_releases().items():
        known = subprocess.run(["git", "-C", str(REPO), "rev-parse", "-q", "--verify",
                                f"{tag}^{{commit}}"], capture_output=True, text=True,
                               check=False).stdout.strip()
        if not known:
            print(f"release {tag}: the tag is not in this clone; the stored wheel is "
                  f"checked by its sha256 only")
            continue
        if known != entry["commit"]:
            problems.append(f"{tag} names {known}, releases.json says {entry['commit']}")
            continue
        with tempfile.TemporaryDirectory(prefix="raysink-dist-") as out:
            _, built = build_from_tag(tag, Path(out))
            if package_files(built) != package_files(RELEASES / entry["wheel"]):
                problems.append(f"{tag}: the wheel built from the tag differs from "
                                f"{entry['wheel']}")
            else:
                print(f"release {tag}: built again from {known[:12]}, the same files as "
                      f"{entry['wheel']}")
    return problems


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.upgrade.release")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("store", help="build a tag and keep its wheel").add_argument("tag")
    commands.add_parser("check", help="build every stored tag again and compare")
    args = parser.parse_args(argv)
    if args.command == "store":
        print(json.dumps(store(args.tag), indent=2))
        return 0
    problems = check()
    for problem in problems:
        print(f"release check: {problem}", file=sys.stderr)
    return 1 if problems else 0


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


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
