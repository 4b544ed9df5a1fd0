"""Spark's resolver against Maven Central, into a fresh cache: one package that does not
exist is a ``ConfigError`` naming it; (``slow``) a package is downloaded once and then read
from the cache with no resolver run (the default run's sessions use the cache ``make
setup`` filled, and ``tests/unit/test_spark_packages.py`` reads a stored resolution).
No Spark session: one ``spark-submit`` JVM per resolution."""

from __future__ import annotations

from pathlib import Path

import pytest

from raysink.errors import ConfigError
from raysink.spark import packages as sp

pytestmark = pytest.mark.timeout(300)

SMALL = "com.google.code.findbugs:jsr305:3.0.2"  # 20 kB, no dependencies


@pytest.mark.slow
def test_a_package_is_downloaded_once_then_read_from_the_cache(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ivy = tmp_path / "ivy"
    coordinates = sp.parse_packages([SMALL])
    jars = sp.resolve_packages(coordinates, {"spark.jars.ivy": str(ivy)})
    assert [Path(j).name for j in jars] == ["com.google.code.findbugs_jsr305-3.0.2.jar"]
    assert Path(jars[0]).parent == ivy / "jars"
    assert list((ivy / "cache" / "com.google.code.findbugs" / "jsr305").glob("jars/*.jar"))

    # a second session: the stored list, with no resolver (none could run now)
    monkeypatch.setenv("SPARK_HOME", str(tmp_path / "no-spark"))
    assert sp.resolve_packages(coordinates, {"spark.jars.ivy": str(ivy)}) == jars


def test_an_unresolvable_package_is_a_config_error(tmp_path: Path) -> None:
    ivy = tmp_path / "ivy"
    missing = "io.delta:delta-spark_2.12:3.0.99"  # no such release
    with pytest.raises(ConfigError, match=r"io\.delta#delta-spark_2\.12;3\.0\.99: not found"):
        sp.resolve_packages(sp.parse_packages([missing]), {"spark.jars.ivy": str(ivy)})
    assert not list(ivy.glob("resolved/*.json"))
    assert (ivy / "last-resolution.log").is_file()
