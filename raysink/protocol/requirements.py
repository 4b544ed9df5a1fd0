"""The range of each dependency raysink works with, in one table, and the check that
turns a release outside its range into a :class:`~raysink.errors.DependencyVersionError`
naming the package, the version found and the range.

Why a check of our own: pip keeps the ranges at install time, but a Ray cluster's image,
a ``--no-deps`` install or a later ``pip install ray==X`` can put another release beside
raysink; without the check that shows as an ``ImportError`` or ``AttributeError`` deep in
a writer, long after the start. The core packages (``ray``, ``pyarrow``, ``numpy``) are
checked when ``raysink`` is imported; each extra's packages when raysink first imports
them (``deltalake`` when a ``DeltaSink`` first touches its table, RayDP and pyspark when a
Spark session starts, ...), so an extra that is not used is never looked at.

``pyproject.toml``'s ranges are these (``tests/unit/test_versions.py`` compares them, and
``constraints/oldest.txt`` holds each range's low end, which ``make compat`` runs).
``RAYSINK_SKIP_VERSION_CHECK=1`` turns the check off (a development build of Ray, say).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from functools import cache
from importlib import metadata

from raysink.errors import DependencyVersionError

__all__ = ["EXTRAS", "RANGES", "Range", "check_extra", "in_range", "release"]

SKIP_ENV = "RAYSINK_SKIP_VERSION_CHECK"


@dataclass(frozen=True)
class Range:
    """One dependency: its distribution name, ``low <= version < high``, and the extra of
    ``pyproject.toml`` that brings it in (``None``: a core dependency)."""

    package: str
    low: str
    high: str
    extra: str | None = None
    pip_extras: str = ""  # the package's own extras pyproject asks for ("default" of Ray)

    @property
    def spec(self) -> str:
        """The range as pyproject writes it: ``>=2.41,<3``."""
        return f">={self.low},<{self.high}"


RANGES: tuple[Range, ...] = (
    # Ray Data's Datasink is generic and hands on_write_complete a WriteResult of the
    # write tasks' returns from 2.41 on (2.38-2.40 hand it the result blocks).
    Range("ray", "2.41", "3", pip_extras="default"),
    Range("pyarrow", "17", "27"),
    Range("numpy", "1.26", "3"),
    # RayDP 1.6.4 has ObjectStoreWriter.prepareRecoverableRDD, the recoverable handoff
    # raysink.spark.handoff calls (1.6.3 has not: every write(df) failed); before 1.6.3 it
    # capped pyarrow below 15 (1.6.1) or protobuf at 3.20.3 (1.6.2).
    Range("raydp", "1.6.4", "1.7", extra="spark"),
    # Delta's Spark connector 3.3 (raysink.spark.packages.DELTA) is built on Spark 3.5.3:
    # on 3.5.0 its session extension misses a Spark class (NoClassDefFoundError).
    Range("pyspark", "3.5.3", "3.6", extra="spark"),
    Range("pandas", "2.0", "3", extra="spark"),
    # deltalake before 1.6 drops commit_properties' app transactions in
    # create_write_transaction: the epoch marker of every Delta commit would be lost;
    # before 1.6.4 it takes no RemoveAction, which compaction commits (1.6.4-5 yanked).
    Range("deltalake", "1.6.6", "2", extra="delta"),
    Range("pyiceberg", "0.11", "0.13", extra="iceberg", pip_extras="sql-sqlite"),
    # psycopg 3.2.0's [binary] extra asks for psycopg-binary 3.2.0.dev1, never published.
    Range("psycopg", "3.2.1", "4", extra="postgres", pip_extras="binary"),
    Range("confluent-kafka", "2.6", "3", extra="kafka"),
)
"""Every dependency's range; pyproject.toml's are the same."""

EXTRAS: tuple[str, ...] = tuple(dict.fromkeys(r.extra for r in RANGES if r.extra))
"""The extras of pyproject.toml (``all`` brings in every one)."""


def release(version: str) -> tuple[int, ...]:
    """The numeric release of a version string: ``2.38.0rc1`` and ``2.38.0+local`` are
    ``(2, 38, 0)``; trailing zeros dropped so ``2.38`` and ``2.38.0`` compare equal."""
    match = re.match(r"\s*v?(\d+(?:\.\d+)*)", version)
    if match is None:
        raise ValueError(f"not a version: {version!r}")
    parts = [int(p) for p in match.group(1).split(".")]
    while len(parts) > 1 and parts[-1] == 0:
        parts.pop()
    return tuple(parts)


def in_range(version: str, wanted: Range) -> bool:
    """Whether ``version`` lies in ``low <= version < high`` (pre-releases count as their
    release)."""
    return release(wanted.low) <= release(version) < release(wanted.high)


def _installed(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def check(wanted: Range, found: str | None) -> None:
    """Raise :class:`DependencyVersionError` when ``found`` lies outside ``wanted``
    (``None``: not installed, which the caller's own import reports)."""
    if found is None or in_range(found, wanted):
        return
    extra = f"raysink[{wanted.extra}]" if wanted.extra else "raysink"
    raise DependencyVersionError(
        f"{extra} needs {wanted.package}{wanted.spec} but {wanted.package} {found} is "
        f"installed; install a release in the range (pip install "
        f"'{wanted.package}{wanted.spec}'), or a raysink whose range holds {found} "
        f"(set {SKIP_ENV}=1 to run anyway, untested)",
        package=wanted.package, found=found, wanted=wanted.spec)


@cache
def check_extra(extra: str | None) -> None:
    """Check the installed release of every package of ``extra`` (``None``: the core
    packages) against its range, once per process; raises
    :class:`DependencyVersionError` for the first one outside."""
    if os.environ.get(SKIP_ENV, "") not in ("", "0"):
        return
    for wanted in RANGES:
        if wanted.extra == extra:
            check(wanted, _installed(wanted.package))
