"""Spark packages: coordinates checked against this Spark, and the session settings a
resolved set brings (a stored resolution, so no resolver runs here; the resolver itself,
against Maven Central, is in ``tests/spark/test_packages.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from raysink.errors import ConfigError
from raysink.spark import packages as sp
from raysink.spark.session import with_packages


@pytest.mark.parametrize(("text", "match"), [
    # not group:artifact:version
    ("io.delta:delta-spark_2.12", "groupId:artifactId:version"),
    ("io.delta:delta-spark_2.12:3.3.2:extra", "groupId:artifactId:version"),
    ("io.delta::3.3.2", "groupId:artifactId:version"),
    ("io.delta:delta spark_2.12:3.3.2", "groupId:artifactId:version"),
    # built for Scala 2.13 while pyspark 3.5 runs 2.12: the message names the right artifact
    ("io.delta:delta-spark_2.13:3.3.2", "'delta-spark_2.12'"),
    # Spark's own module of another release
    ("org.apache.spark:spark-sql-kafka-0-10_2.12:3.5.1", f"use version '{sp.SPARK_VERSION}'"),
    # a runtime built for another Spark line
    ("org.apache.iceberg:iceberg-spark-runtime-3.4_2.12:1.10.1", "built for Spark 3.4"),
    # Delta's release line for another Spark (4.x is built on Spark 4.0)
    ("io.delta:delta-spark_2.12:4.0.0", "needs its 3.x releases"),
])
def test_packages_for_another_spark_are_refused(text: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        sp.parse_packages([text])


def test_the_named_packages_fit_this_spark() -> None:
    assert sp.scala_binary_version() == "2.12"
    found = sp.parse_packages([f"{sp.DELTA},{sp.ICEBERG}", f" {sp.KAFKA} ", sp.DELTA,
                               sp.SQLITE_JDBC, ""])
    assert [str(c) for c in found] == [sp.DELTA, sp.ICEBERG, sp.KAFKA, sp.SQLITE_JDBC]


def _stored(ivy: Path, packages: list[str], jars: list[str]) -> None:
    """A resolution record as a former resolution leaves it, for the default settings."""
    coordinates = sp.parse_packages(packages)
    key = sp._resolution_key(coordinates, {"spark.jars.excludes": sp._SPARK_SHIPS})
    (ivy / "resolved").mkdir(parents=True)
    (ivy / "resolved" / f"{key}.json").write_text(json.dumps({"jars": jars}))


def test_resolved_jars_and_delta_settings_join_the_callers(tmp_path: Path) -> None:
    jars = []
    for name in ("delta.jar", "storage.jar"):
        (tmp_path / name).write_bytes(b"")
        jars.append(str(tmp_path / name))
    _stored(tmp_path / "ivy", [sp.DELTA], jars)
    given = {"spark.jars.ivy": str(tmp_path / "ivy"), "spark.jars": "/opt/mine.jar",
             "spark.sql.extensions": "my.Extension"}
    merged = with_packages(given, sp.parse_packages([sp.DELTA]))
    assert merged["spark.jars"] == ",".join(["/opt/mine.jar", *jars])
    assert merged["spark.sql.extensions"] == "my.Extension,io.delta.sql.DeltaSparkSessionExtension"
    assert merged["spark.sql.catalog.spark_catalog"].endswith("DeltaCatalog")
    assert given["spark.jars"] == "/opt/mine.jar"  # the caller's mapping is left alone
    assert with_packages({"a": "b"}, ()) == {"a": "b"}


def test_a_stored_resolution_missing_a_jar_is_not_used(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    _stored(tmp_path / "ivy", [sp.DELTA], [str(tmp_path / "gone.jar")])
    coordinates = sp.parse_packages([sp.DELTA])
    monkeypatch.setenv("SPARK_HOME", str(tmp_path / "no-spark"))  # no resolver can run
    with pytest.raises(ConfigError, match="cannot run Spark's resolver"):
        sp.resolve_packages(coordinates, {"spark.jars.ivy": str(tmp_path / "ivy")})


def test_the_default_cache_follows_the_environment(monkeypatch: pytest.MonkeyPatch,
                                                   tmp_path: Path) -> None:
    monkeypatch.delenv("RAYSINK_IVY_HOME", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert sp.default_ivy_home() == tmp_path / "raysink" / "ivy"
    monkeypatch.setenv("RAYSINK_IVY_HOME", str(tmp_path / "mine"))
    assert sp.default_ivy_home() == tmp_path / "mine"
