"""Start and stop the RayDP Spark session raysink feeds from.

``init_spark()`` runs Spark on Ray through RayDP with what Java 17 and a virtual
environment need, and returns the ``SparkSession``:

* the ``--add-opens`` set Java 17 needs, for the RayDP app master
  (``spark.ray.raydp_app_master.extraJavaOptions``), the driver and the executors,
  merged in front of any options the caller gives;
* ``PYSPARK_PYTHON`` pointing at the running interpreter, which must hold before Ray
  starts (Spark's Python workers are started by Ray's raylet and inherit its
  environment). When ``init_spark`` starts Ray itself it sets it; when Ray is already
  running without it, that is a :class:`~raysink.errors.ConfigError`;
* enough logical CPUs for the executors when it starts Ray itself (RayDP hangs waiting
  for resources when executors do not fit in ``num_cpus``);
* the session time zone UTC and Arrow enabled, unless ``configs`` says otherwise;
* Spark packages (``packages=`` or ``spark.jars.packages``) checked against this Spark,
  resolved from Maven Central once and cached (``raysink.spark.packages``), and handed
  to the session as local jars that the driver loads and every executor fetches.

Only one RayDP session lives in a process. ``stop_spark()`` ends it and may be called
any number of times; it leaves Ray running (``ray.shutdown()`` stops that).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Iterable, Mapping
from typing import Any

import ray
from pyspark.sql import SparkSession

from raysink.errors import ConfigError
from raysink.spark import packages as spark_packages

__all__ = ["JAVA_17_OPTIONS", "active_spark", "init_spark", "stop_spark"]

logger = logging.getLogger(__name__)

_ADD_OPENS = (
    "java.base/java.lang",
    "java.base/java.lang.invoke",
    "java.base/java.lang.reflect",
    "java.base/java.io",
    "java.base/java.math",
    "java.base/java.net",
    "java.base/java.nio",
    "java.base/java.text",
    "java.base/java.time",
    "java.base/java.util",
    "java.base/java.util.concurrent",
    "java.base/java.util.concurrent.atomic",
    "java.base/java.util.regex",
    "java.base/java.security",
    "java.base/jdk.internal.misc",
    "java.base/jdk.internal.ref",
    "java.base/sun.nio.ch",
    "java.base/sun.nio.cs",
    "java.base/sun.security.action",
    "java.base/sun.util.calendar",
)

#: The JVM options every RayDP JVM (app master, driver, executors) gets on Java 17.
JAVA_17_OPTIONS: str = " ".join(
    [f"--add-opens={package}=ALL-UNNAMED" for package in _ADD_OPENS]
    + ["-Dio.netty.tryReflectionSetAccessible=true"]
)

_JAVA_OPTION_KEYS = (
    "spark.ray.raydp_app_master.extraJavaOptions",
    "spark.driver.extraJavaOptions",
    "spark.executor.extraJavaOptions",
)

_DEFAULT_CONFIGS: Mapping[str, str] = {
    "spark.sql.session.timeZone": "UTC",
    "spark.sql.execution.arrow.pyspark.enabled": "true",
}

_EXTENSIONS_KEY = "spark.sql.extensions"
_MIN_JAVA = 17
_INSTALL_JAVA = "install Java 17 (`apt-get install openjdk-17-jre-headless`)"
_MIN_RAY_CPUS = 8
_ENV_CHECK_TIMEOUT = 60.0

_lock = threading.RLock()
_session: SparkSession | None = None
# The SIGINT handler before the session started: PySpark installs one that cancels the
# context's jobs, and leaves it after the context stopped, when Ctrl-C then raises
# ``AttributeError: 'NoneType' object has no attribute 'sc'`` instead of
# KeyboardInterrupt. ``stop_spark`` puts this one back.
_sigint_before: list[Any] = []


def init_spark(
    app_name: str = "raysink",
    *,
    executors: int = 2,
    executor_cores: int = 1,
    executor_memory: str = "1g",
    configs: Mapping[str, str] | None = None,
    packages: Iterable[str] = (),
) -> SparkSession:
    """Start RayDP on the connected Ray (or a new local one) and return its session.

    ``configs`` are extra Spark settings; they override raysink's defaults, except that
    the ``extraJavaOptions`` keys are merged after the Java 17 flags rather than replacing
    them. ``packages`` are Maven coordinates of Spark packages (``raysink.spark.packages``
    names Delta's, Iceberg's and Spark's Kafka connector for this Spark), joined with any
    ``spark.jars.packages`` in ``configs``; the first session on a machine downloads them
    into the cache (``spark.jars.ivy``, by default ``~/.cache/raysink/ivy``), later ones
    reuse it. Raises :class:`~raysink.errors.ConfigError` when Java is missing or older
    than 17, when Ray runs without ``PYSPARK_PYTHON`` pointing at this interpreter, when
    the sizes are invalid, when a package is malformed, built for another Spark or Scala,
    or cannot be resolved, or when a RayDP session is already running.
    """
    import raydp

    _check_sizes(executors, executor_cores)
    check_java()
    given = dict(configs or {})
    coordinates = spark_packages.parse_packages(
        [*packages, given.pop(spark_packages.PACKAGES_KEY, "")])
    with _lock:
        global _session
        _ensure_ray(executors * executor_cores)
        if _session is not None:
            raise ConfigError(
                f"a RayDP Spark session {_session.sparkContext.appName!r} is already running "
                "in this process; call raysink.spark.stop_spark() before init_spark() again"
            )
        _remember_sigint()
        _session = raydp.init_spark(
            app_name,
            executors,
            executor_cores,
            executor_memory,
            fault_tolerant_mode=True,
            configs=spark_configs(with_packages(given, coordinates)),
        )
        logger.info("RayDP Spark session %r started with %d executors", app_name, executors)
        return _session


def stop_spark() -> None:
    """Stop the RayDP session started by :func:`init_spark`; safe to call again."""
    import raydp

    with _lock:
        global _session
        _session = None
        try:
            raydp.stop_spark()
        finally:
            _restore_sigint()


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _remember_sigint() -> None:
    """Note the SIGINT handler in place before PySpark installs its own (main thread
    only: signal handlers belong to it)."""
    if _in_main_thread() and not _sigint_before:
        _sigint_before.append(signal.getsignal(signal.SIGINT))


def _restore_sigint() -> None:
    """Put back the SIGINT handler :func:`_remember_sigint` noted, so Ctrl-C after the
    session stopped is a KeyboardInterrupt again."""
    if _in_main_thread() and _sigint_before:
        signal.signal(signal.SIGINT, _sigint_before.pop())


def active_spark() -> SparkSession | None:
    """The session :func:`init_spark` started, or ``None`` when none is running."""
    return _session


def spark_configs(configs: Mapping[str, str] | None = None) -> dict[str, str]:
    """raysink's Spark settings with ``configs`` applied over them (Java options merged)."""
    given = dict(configs or {})
    merged = {**_DEFAULT_CONFIGS, **given}
    for key in _JAVA_OPTION_KEYS:
        merged[key] = " ".join(part for part in (JAVA_17_OPTIONS, given.get(key, "")) if part)
    return merged


def with_packages(configs: Mapping[str, str],
                  coordinates: tuple[spark_packages.Coordinate, ...]) -> dict[str, str]:
    """``configs`` with the resolved jars of ``coordinates`` added to ``spark.jars`` and
    the session settings their connectors need (Delta's SQL extension and catalog) where
    ``configs`` lacks them."""
    merged = dict(configs)
    if not coordinates:
        return merged
    jars = spark_packages.resolve_packages(coordinates, merged)
    merged["spark.jars"] = ",".join(part for part in (merged.get("spark.jars"), *jars) if part)
    for key, value in spark_packages.session_settings(coordinates).items():
        if key == _EXTENSIONS_KEY and merged.get(key):
            listed = merged[key].split(",")
            merged[key] = ",".join(listed + [v for v in value.split(",") if v not in listed])
        else:
            merged.setdefault(key, value)
    return merged


def check_java() -> None:
    """Raise :class:`ConfigError` unless every ``java`` Spark will start is 17 or newer.

    The Spark driver runs ``$JAVA_HOME/bin/java`` when ``JAVA_HOME`` is set, and RayDP's
    app master always runs ``java`` from ``PATH``; both are checked.
    """
    on_path = shutil.which("java")
    if on_path is None:
        raise ConfigError(f"no `java` on PATH: RayDP needs Java 17 or newer; {_INSTALL_JAVA}")
    candidates = [on_path]
    java_home = os.environ.get("JAVA_HOME")
    if java_home:
        candidates.insert(0, os.path.join(java_home, "bin", "java"))
    for java in candidates:
        major = java_major_version(java)
        if major < _MIN_JAVA:
            raise ConfigError(
                f"{java} is Java {major}, got an older Java than RayDP needs (17 or newer); "
                f"{_INSTALL_JAVA} and put it first on PATH / in JAVA_HOME"
            )


def java_major_version(java: str) -> int:
    """The major version ``java -version`` reports (8 for ``1.8.0_292``)."""
    try:
        done = subprocess.run(
            [java, "-version"], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ConfigError(f"cannot run {java!r} ({exc}); {_INSTALL_JAVA}") from exc
    found = re.search(r'version "(\d+)(?:\.(\d+))?', done.stderr + done.stdout)
    if done.returncode != 0 or found is None:
        raise ConfigError(
            f"{java!r} -version failed (exit {done.returncode}): "
            f"{(done.stderr or done.stdout).strip()[:200]!r}; {_INSTALL_JAVA}"
        )
    major = int(found.group(1))
    return int(found.group(2) or 0) if major == 1 else major


def _check_sizes(executors: int, executor_cores: int) -> None:
    if executors < 1:
        raise ConfigError(f"executors must be at least 1, got {executors!r}")
    if executor_cores < 1:
        raise ConfigError(f"executor_cores must be at least 1, got {executor_cores!r}")


def _ensure_ray(executor_cpus: int) -> None:
    """Start a local Ray sized for the executors, or check the running one's environment."""
    if not ray.is_initialized():
        os.environ["PYSPARK_PYTHON"] = sys.executable
        ray.init(num_cpus=max(_MIN_RAY_CPUS, executor_cpus + 4))
        return
    _check_pyspark_python(os.environ.get("PYSPARK_PYTHON"), where="this driver's environment")
    _check_pyspark_python(_worker_pyspark_python(), where="the Ray workers' environment")


def _check_pyspark_python(value: str | None, *, where: str) -> None:
    if value is not None and os.path.abspath(value) == os.path.abspath(sys.executable):
        return
    raise ConfigError(
        f"Ray is running but PYSPARK_PYTHON in {where} is {value!r}, not this interpreter "
        f"{sys.executable!r}: Spark's Python workers would start without raysink's packages. "
        f"Set os.environ['PYSPARK_PYTHON'] = sys.executable before ray.init(), "
        "or let init_spark() start Ray"
    )


@ray.remote(num_cpus=0, max_retries=0)
def _read_pyspark_python() -> str | None:
    return os.environ.get("PYSPARK_PYTHON")


def _worker_pyspark_python() -> str | None:
    """``PYSPARK_PYTHON`` as Ray's workers (and so the Spark executors) see it.

    Workers inherit the raylet's environment, fixed when Ray started; setting the variable
    in the driver afterwards does not reach them. When the check cannot finish in time,
    the driver's value is trusted.
    """
    ref = _read_pyspark_python.remote()
    ready, _ = ray.wait([ref], timeout=_ENV_CHECK_TIMEOUT)
    if not ready:
        ray.cancel(ref)
        return os.environ.get("PYSPARK_PYTHON")
    value: str | None = ray.get(ref)
    return value
