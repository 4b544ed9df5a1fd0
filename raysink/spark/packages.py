"""Spark packages (Maven coordinates) for raysink's RayDP sessions, resolved once and cached.

``init_spark(packages=...)`` (or ``spark.jars.packages`` in its ``configs``) loads Spark
connectors such as Delta's, Iceberg's or Spark's own Kafka source::

    resolve_packages(coordinates)      checked against this Spark (its Scala binary version,
        |                              its release line), then looked up in the cache:
        |   cached                     the jar list a former resolution stored (no Ivy run)
        |   not cached                 Spark's own resolver (Ivy, through ``spark-submit
        |                              --packages``) in a subprocess, under a file lock:
        |                              downloads from Maven Central into the cache, stores the
        |                              jar list; what it cannot resolve is a ConfigError
        v                              naming the coordinates and what Ivy said
    spark.jars = the resolved jars     local files handed to RayDP's session

How the jars reach each JVM: the driver is started by ``spark-submit`` in client mode,
which puts ``spark.jars`` on the driver's class path. RayDP's executors (Ray Java actors)
start with RayDP's, Spark's and Ray's jars only; each executor fetches every
``spark.jars`` entry from the driver's file server before its first task and adds it to
its task class loader, on any node of a Ray cluster, again after a restart. (The jars
could also go on the executors' own class path through ``raydp.executor.extraClassPath``,
but that needs the same local path on every node.)

The cache is Ivy's home for Spark (``spark.jars.ivy``), by default
``~/.cache/raysink/ivy`` (``$RAYSINK_IVY_HOME`` or ``$XDG_CACHE_HOME`` move it): Ivy
keeps the downloaded artifacts under ``cache/`` and copies the jars of each resolution to
``jars/``; raysink keeps the jar list of each resolved set under ``resolved/``. A second
session with the same packages reads that list and starts no resolver; only the first
use on a machine reaches Maven Central (``spark.jars.repositories`` adds repositories).

Modules Spark itself ships (the Hadoop client jars) are excluded unless
``spark.jars.excludes`` is given: Spark's own copy is first on every class path, so a
second copy would only be downloaded and fetched by every executor, never loaded.
"""

from __future__ import annotations

import fcntl
import glob
import hashlib
import json
import logging
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import pyspark

from raysink.errors import ConfigError

__all__ = [
    "DELTA",
    "ICEBERG",
    "KAFKA",
    "SQLITE_JDBC",
    "Coordinate",
    "default_ivy_home",
    "parse_packages",
    "resolve_packages",
    "scala_binary_version",
    "session_settings",
]

logger = logging.getLogger(__name__)

SPARK_VERSION: str = pyspark.__version__
_SPARK_LINE = ".".join(SPARK_VERSION.split(".")[:2])

#: Delta Lake's Spark connector for Spark 3.5 (Delta 3.x is the line built on Spark 3.5).
DELTA = "io.delta:delta-spark_2.12:3.3.2"
#: Iceberg's Spark runtime for Spark 3.5 and Scala 2.12.
ICEBERG = "org.apache.iceberg:iceberg-spark-runtime-3.5_2.12:1.10.1"
#: Spark's own Kafka source and sink, of the same release as the installed pyspark.
KAFKA = f"org.apache.spark:spark-sql-kafka-0-10_2.12:{SPARK_VERSION}"
#: The SQLite JDBC driver, for Iceberg's JDBC catalog over a pyiceberg SQLite catalog.
SQLITE_JDBC = "org.xerial:sqlite-jdbc:3.47.1.0"

PACKAGES_KEY = "spark.jars.packages"
_IVY_KEY = "spark.jars.ivy"
_EXCLUDES_KEY = "spark.jars.excludes"
# the settings that change what a resolution yields (part of its cache key)
_RESOLUTION_KEYS = (_EXCLUDES_KEY, "spark.jars.repositories", "spark.jars.ivySettings")
# shipped with Spark (pyspark's jars/) and dragged in by Spark's Kafka package
_SPARK_SHIPS = "org.apache.hadoop:hadoop-client-runtime,org.apache.hadoop:hadoop-client-api"
_RESOLVE_TIMEOUT = 900.0
_JARS_LINE = "RAYSINK_RESOLVED_JARS "
_COORDINATE = re.compile(r"[A-Za-z0-9_.\-]+")
_SCALA_SUFFIX = re.compile(r"_(2\.1[0-9]|3)$")
_SPARK_LINE_IN_NAME = re.compile(r"-(\d+\.\d+)_(?:2\.1[0-9]|3)$")
# a connector's release lines per Spark line: (group, artifact prefix) -> Spark line -> prefix
_RELEASE_LINES: Mapping[tuple[str, str], Mapping[str, str]] = {
    ("io.delta", "delta-spark_"): {"3.5": "3.", "3.4": "2.4.", "4.0": "4."},
}
# session settings a connector needs, applied when the caller set none of them
_SESSION_SETTINGS: Mapping[tuple[str, str], Mapping[str, str]] = {
    ("io.delta", "delta-spark_"): {
        "spark.sql.extensions": "io.delta.sql.DeltaSparkSessionExtension",
        "spark.sql.catalog.spark_catalog": "org.apache.spark.sql.delta.catalog.DeltaCatalog",
    },
}


@dataclass(frozen=True, kw_only=True, slots=True)
class Coordinate:
    """One Maven coordinate ``group:artifact:version``."""

    group: str
    artifact: str
    version: str

    @classmethod
    def parse(cls, text: str) -> Coordinate:
        parts = text.strip().split(":")
        if len(parts) != 3 or not all(_COORDINATE.fullmatch(p) for p in parts):
            raise ConfigError(
                f"a Spark package is a Maven coordinate 'groupId:artifactId:version', got "
                f"{text!r} (e.g. {DELTA!r})"
            )
        return cls(group=parts[0], artifact=parts[1], version=parts[2])

    def __str__(self) -> str:
        return f"{self.group}:{self.artifact}:{self.version}"

    def is_of(self, group: str, artifact_prefix: str) -> bool:
        return self.group == group and self.artifact.startswith(artifact_prefix)


def parse_packages(packages: Iterable[str]) -> tuple[Coordinate, ...]:
    """The coordinates in ``packages`` (each may hold several, comma-separated), in order,
    each once, checked against this Spark (:func:`check_compatible`)."""
    found: dict[str, Coordinate] = {}
    for entry in packages:
        for text in entry.split(","):
            if text.strip():
                coordinate = Coordinate.parse(text)
                check_compatible(coordinate)
                found.setdefault(str(coordinate), coordinate)
    return tuple(found.values())


def check_compatible(coordinate: Coordinate) -> None:
    """Raise :class:`ConfigError` when ``coordinate`` is built for another Scala binary
    version, another Spark line, or (Spark's own modules) another Spark release."""
    scala = scala_binary_version()
    suffix = _SCALA_SUFFIX.search(coordinate.artifact)
    if suffix is not None and suffix.group(1) != scala:
        fixed = coordinate.artifact[: suffix.start()] + f"_{scala}"
        raise ConfigError(
            f"Spark package {str(coordinate)!r} is built for Scala {suffix.group(1)}; "
            f"pyspark {SPARK_VERSION} runs Scala {scala}: use the {fixed!r} artifact"
        )
    if coordinate.group == "org.apache.spark" and coordinate.version != SPARK_VERSION:
        raise ConfigError(
            f"Spark package {str(coordinate)!r} is of Spark {coordinate.version}, got it for "
            f"pyspark {SPARK_VERSION}: use version {SPARK_VERSION!r}"
        )
    line = _SPARK_LINE_IN_NAME.search(coordinate.artifact)
    if line is not None and line.group(1) != _SPARK_LINE:
        raise ConfigError(
            f"Spark package {str(coordinate)!r} is built for Spark {line.group(1)}; pyspark "
            f"{SPARK_VERSION} needs the artifact for Spark {_SPARK_LINE}"
        )
    _check_release_line(coordinate)


def _check_release_line(coordinate: Coordinate) -> None:
    for (group, prefix), lines in _RELEASE_LINES.items():
        wanted = lines.get(_SPARK_LINE)
        if coordinate.is_of(group, prefix) and wanted and not coordinate.version.startswith(
                wanted):
            raise ConfigError(
                f"Spark package {str(coordinate)!r}: Spark {_SPARK_LINE} needs its "
                f"{wanted}x releases, got {coordinate.version!r}"
            )


def scala_binary_version() -> str:
    """The Scala binary version (``2.12``) of the installed pyspark's jars."""
    home = spark_home()
    found = glob.glob(os.path.join(home, "jars", "scala-library-*.jar"))
    match = re.search(r"scala-library-(\d+)\.(\d+)", os.path.basename(found[0])) if found else None
    if match is None:
        raise ConfigError(f"no scala-library jar under {home}/jars: is pyspark installed whole?")
    return "3" if match.group(1) == "3" else f"{match.group(1)}.{match.group(2)}"


def spark_home() -> str:
    """Where Spark's scripts and jars are: ``$SPARK_HOME`` or the pyspark package."""
    return os.environ.get("SPARK_HOME") or os.path.dirname(pyspark.__file__)


def default_ivy_home() -> Path:
    """The cache when ``spark.jars.ivy`` is not given: ``$RAYSINK_IVY_HOME``, else
    ``$XDG_CACHE_HOME/raysink/ivy`` (``~/.cache/raysink/ivy``)."""
    if os.environ.get("RAYSINK_IVY_HOME"):
        return Path(os.environ["RAYSINK_IVY_HOME"]).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "raysink" / "ivy"


def session_settings(coordinates: Sequence[Coordinate]) -> dict[str, str]:
    """The session settings the connectors among ``coordinates`` need (Delta's SQL
    extension and catalog), to apply where the caller set none."""
    settings: dict[str, str] = {}
    for (group, prefix), wanted in _SESSION_SETTINGS.items():
        if any(c.is_of(group, prefix) for c in coordinates):
            settings.update(wanted)
    return settings


# --------------------------------------------------------------------------- resolution


def resolve_packages(coordinates: Sequence[Coordinate],
                     configs: Mapping[str, str] | None = None) -> list[str]:
    """The local jars of ``coordinates`` with their dependencies: the cached list, or a
    new resolution by Spark's resolver (downloading what the cache lacks). ``configs``
    may give ``spark.jars.ivy`` (the cache), ``spark.jars.repositories``,
    ``spark.jars.excludes`` and ``spark.jars.ivySettings``. Raises :class:`ConfigError`
    naming what cannot be resolved."""
    if not coordinates:
        return []
    given = dict(configs or {})
    ivy_home = Path(given.get(_IVY_KEY) or default_ivy_home()).expanduser().resolve()
    settings = {k: given[k] for k in _RESOLUTION_KEYS if k in given}
    settings.setdefault(_EXCLUDES_KEY, _SPARK_SHIPS)
    record = ivy_home / "resolved" / f"{_resolution_key(coordinates, settings)}.json"
    jars = _stored_jars(record)
    if jars is not None:
        return jars
    with _locked(ivy_home / "resolve.lock"):
        jars = _stored_jars(record)  # another process may have resolved it meanwhile
        if jars is None:
            jars = _resolve_with_ivy(coordinates, ivy_home, settings)
            _store_jars(record, coordinates, jars)
    return jars


def _resolution_key(coordinates: Sequence[Coordinate], settings: Mapping[str, str]) -> str:
    text = json.dumps({"packages": sorted(map(str, coordinates)), "settings": settings,
                       "spark": SPARK_VERSION}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def _stored_jars(record: Path) -> list[str] | None:
    """The jar list a former resolution stored, if every jar is still there."""
    try:
        jars = json.loads(record.read_text())["jars"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not isinstance(jars, list) or not all(isinstance(j, str) and os.path.isfile(j)
                                             for j in jars):
        return None
    return jars


def _store_jars(record: Path, coordinates: Sequence[Coordinate], jars: list[str]) -> None:
    record.parent.mkdir(parents=True, exist_ok=True)
    partial = record.with_suffix(f".{os.getpid()}.tmp")
    partial.write_text(json.dumps({"packages": [str(c) for c in coordinates], "jars": jars},
                                  indent=1))
    os.replace(partial, record)


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock on ``path`` between processes (Ivy's cache is not safe for
    concurrent resolutions)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _resolve_with_ivy(coordinates: Sequence[Coordinate], ivy_home: Path,
                      settings: Mapping[str, str]) -> list[str]:
    """Run ``spark-submit --packages`` on a script that prints the ``spark.jars`` Spark
    resolved; its output is kept in ``<ivy home>/last-resolution.log``."""
    packages = ",".join(map(str, coordinates))
    logger.info("resolving Spark packages %s into %s (downloads what the cache lacks)",
                packages, ivy_home)
    confs = {PACKAGES_KEY: packages, _IVY_KEY: str(ivy_home), **settings}
    command = [os.path.join(spark_home(), "bin", "spark-submit")]
    for key, value in confs.items():
        command += ["--conf", f"{key}={value}"]
    command.append(str(Path(__file__).with_name("_print_jars.py")))
    env = {**os.environ, "SPARK_HOME": spark_home(), "PYSPARK_PYTHON": sys.executable}
    env.pop("PYSPARK_GATEWAY_PORT", None)
    env.pop("PYSPARK_GATEWAY_SECRET", None)
    started = time.monotonic()
    try:
        done = subprocess.run(command, capture_output=True, text=True, env=env,
                              timeout=_RESOLVE_TIMEOUT, check=False)
    except subprocess.TimeoutExpired as exc:
        raise ConfigError(f"resolving Spark packages {packages} took over "
                          f"{_RESOLVE_TIMEOUT:.0f} s; is Maven Central reachable?") from exc
    except OSError as exc:
        raise ConfigError(f"cannot run Spark's resolver {command[0]!r} ({exc}): is pyspark "
                          "installed whole, or SPARK_HOME right?") from exc
    log = ivy_home / "last-resolution.log"
    log.write_text(done.stderr + done.stdout)
    jars = _printed_jars(done.stdout)
    if done.returncode != 0 or jars is None:
        raise ConfigError(_resolution_failure(packages, done.stderr + done.stdout, log))
    logger.info("resolved Spark packages %s: %d jars in %.1f s", packages, len(jars),
                time.monotonic() - started)
    return jars


def _printed_jars(stdout: str) -> list[str] | None:
    for line in stdout.splitlines():
        if line.startswith(_JARS_LINE):
            value = json.loads(line.removeprefix(_JARS_LINE)) or ""
            return [_local_path(j) for j in value.split(",") if j]
    return None


def _local_path(jar: str) -> str:
    """A resolved jar's local path (Spark gives ``file:`` URIs)."""
    return urlparse(jar).path if jar.startswith("file:") else jar


def _resolution_failure(packages: str, output: str, log: Path) -> str:
    """What to tell the user when Spark's resolver failed: the coordinates it could not
    resolve and the hosts it could not reach, or the end of its output."""
    unresolved = sorted(set(re.findall(r"unresolved dependency: ([^\s,\]]+: [^,\]]+)", output)))
    unreachable = sorted(set(re.findall(r"Host (\S+) not found", output)))
    if unresolved:
        what = "could not resolve " + "; ".join(unresolved)
    else:
        what = "failed: " + " | ".join(output.strip().splitlines()[-5:])[-600:]
    reach = (f" (hosts not reachable: {', '.join(unreachable)})" if unreachable else "")
    return (
        f"Spark packages {packages}: Spark's resolver {what}{reach}. Check each coordinate "
        f"on Maven Central (group:artifact:version, Scala {scala_binary_version()}, Spark "
        f"{_SPARK_LINE}); give other repositories with spark.jars.repositories. Its whole "
        f"output: {log}"
    )
