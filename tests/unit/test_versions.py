"""Dependency ranges in one place: raysink's table (``raysink.protocol.requirements``),
pyproject.toml and constraints/oldest.txt agree, and a release outside its range is a
``DependencyVersionError`` naming the package, the version found and the range: at
``import raysink`` for the core packages, at first use for an extra's."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

import raysink
from raysink.cli import main
from raysink.errors import ConfigError, DependencyVersionError
from raysink.protocol import requirements
from raysink.protocol.requirements import RANGES, Range, check_extra, in_range, release

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
_REQ = re.compile(r"^([A-Za-z0-9_.-]+)(?:\[([a-z0-9,-]+)\])?(.*)$")


def _pyproject() -> dict[str, object]:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def _ranges_of(specs: list[str], extra: str | None) -> set[tuple[str, str, str, str | None]]:
    found = set()
    for spec in specs:
        match = _REQ.match(spec.replace(" ", ""))
        assert match is not None, spec
        name, extras, wanted = match.groups()
        if name == "raysink":  # `all` = raysink[every extra]
            continue
        found.add((name, extras or "", wanted, extra))
    return found


def test_pyproject_declares_the_tables_ranges() -> None:
    project = _pyproject()["project"]
    assert isinstance(project, dict)
    declared = _ranges_of(project["dependencies"], None)
    for extra, specs in project["optional-dependencies"].items():
        if extra not in ("all", "dev"):
            declared |= _ranges_of(specs, extra)
    table = {(r.package, r.pip_extras, r.spec, r.extra) for r in RANGES}
    assert declared == table


def test_all_brings_in_every_extra() -> None:
    project = _pyproject()["project"]
    assert isinstance(project, dict)
    (spec,) = project["optional-dependencies"]["all"]
    assert set(spec.split("[", 1)[1].rstrip("]").split(",")) == set(requirements.EXTRAS)


def test_oldest_constraints_pin_each_range_at_its_low_end() -> None:
    lines = [line.split("#", 1)[0].strip()
             for line in (REPO / "constraints" / "oldest.txt").read_text().splitlines()]
    pins = dict(line.split("==", 1) for line in lines if line)
    for wanted in RANGES:
        assert wanted.package in pins, wanted.package
        assert release(pins[wanted.package]) == release(wanted.low), wanted.package


def test_the_version_is_written_once() -> None:
    assert _pyproject()["project"]["dynamic"] == ["version"]  # type: ignore[index]
    assert re.fullmatch(r"\d+\.\d+\.\d+", raysink.__version__)
    changelog = (REPO / "CHANGELOG.md").read_text()
    assert f"## {raysink.__version__}" in changelog


def test_raysink_version_prints_it(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"raysink {raysink.__version__}"


@pytest.mark.parametrize(("version", "inside"), [
    ("2.41.0", True), ("2.41", True), ("2.60.0", True), ("2.99.1rc1", True),
    ("2.40.0", False), ("2.9.3", False), ("3.0.0", False), ("3.0.0.dev0", False),
    ("2.41.0+local", True),
])
def test_in_range_compares_releases_numerically(version: str, inside: bool) -> None:
    assert in_range(version, Range("ray", "2.41", "3")) is inside


def test_an_old_release_is_an_error_naming_package_found_and_range(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(requirements, "_installed",
                        lambda package: "0.25.5" if package == "deltalake" else None)
    check_extra.cache_clear()
    try:
        with pytest.raises(DependencyVersionError) as caught:
            check_extra("delta")
        error = caught.value
        assert isinstance(error, ConfigError)
        assert (error.package, error.found, error.wanted) == ("deltalake", "0.25.5", ">=1.6.6,<2")
        assert "raysink[delta] needs deltalake>=1.6.6,<2" in str(error)
        assert "deltalake 0.25.5 is installed" in str(error)
        check_extra("kafka")  # another extra is not looked at through deltalake
        monkeypatch.setenv(requirements.SKIP_ENV, "1")
        check_extra("delta")  # turned off on purpose
    finally:
        check_extra.cache_clear()


def test_a_sinks_first_use_checks_its_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the sink's own lazy import (what a DeltaSink or KafkaSink calls first), not a
    late AttributeError in the writer."""
    from raysink.sinks.delta._table import deltalake_module
    from raysink.sinks.kafka._config import kafka_module

    monkeypatch.setattr(requirements, "_installed",
                        lambda package: {"deltalake": "0.18.2",
                                         "confluent-kafka": "3.1.0"}.get(package))
    check_extra.cache_clear()
    try:
        with pytest.raises(DependencyVersionError, match=r"deltalake 0\.18\.2"):
            deltalake_module()
        with pytest.raises(DependencyVersionError, match=r"confluent-kafka>=2\.6,<3"):
            kafka_module()
    finally:
        check_extra.cache_clear()


def test_import_raysink_refuses_a_ray_outside_its_range(tmp_path: Path) -> None:
    """A real ``import raysink`` in a fresh interpreter that sees Ray 2.40.0's metadata
    first on its path: it fails at the import, naming Ray, before any module uses Ray."""
    dist = tmp_path / "ray-2.40.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: ray\nVersion: 2.40.0\n")
    code = "import raysink"
    env = {"PYTHONPATH": f"{tmp_path}:{REPO}", "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode != 0
    assert "DependencyVersionError" in done.stderr
    assert "raysink needs ray>=2.41,<3 but ray 2.40.0 is installed" in done.stderr
    assert "AttributeError" not in done.stderr


def test_every_case_make_compat_names_exists() -> None:
    """A renamed test would leave ``make compat`` failing on a clean clone only."""
    script = (REPO / "scripts" / "compat.sh").read_text()
    cases = re.findall(r"^\s+(tests/[\w/]+\.py(?:::\w+)?)\s*$", script, re.MULTILINE)
    assert len(cases) >= 10
    for case in cases:
        path, _, name = case.partition("::")
        assert (REPO / path).is_file(), case
        if name:
            assert re.search(rf"^def {name}\(", (REPO / path).read_text(), re.MULTILINE), case


# ----------------------------------------------------- guards for the oldest releases


def test_a_taken_actor_name_is_told_on_every_ray_in_range(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Recent Ray raises ActorAlreadyExistsError (a ValueError); Ray 2.41 had no such
    class and raised a plain ValueError saying the name is taken."""
    import ray.exceptions

    from raysink.driver.remote import _name_taken

    taken = ValueError("The name rt.coordinator (namespace=raysink) is already taken. ...")
    assert not _name_taken(ValueError("Actor name cannot be an empty string."))
    if hasattr(ray.exceptions, "ActorAlreadyExistsError"):
        assert _name_taken(ray.exceptions.ActorAlreadyExistsError("rt.coordinator"))
        monkeypatch.delattr(ray.exceptions, "ActorAlreadyExistsError")
    assert _name_taken(taken)
    assert not _name_taken(ValueError("Actor name cannot be an empty string."))


def test_view_columns_hash_like_plain_ones_without_a_view_cast(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """pyarrow 17 cannot cast from string_view or binary_view: the hash goes through
    Python there and must give the same vnodes as the cast does."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from raysink.protocol import vnodes

    views = pa.table({"s": pa.array(["a", "bc", None, ""], pa.string_view()),
                      "b": pa.array([b"x", b"", b"yz", None], pa.binary_view())})
    plain = pa.table({"s": pa.array(["a", "bc", None, ""]),
                      "b": pa.array([b"x", b"", b"yz", None])})
    expected = vnodes.key_hash(plain, ["s", "b"])
    cast = pc.cast

    def no_view_cast(arr: pa.Array, *args: object, **kwargs: object) -> pa.Array:
        if pa.types.is_string_view(arr.type) or pa.types.is_binary_view(arr.type):
            raise pa.ArrowNotImplementedError("Unsupported cast from string_view")
        return cast(arr, *args, **kwargs)

    monkeypatch.setattr(vnodes.pc, "cast", no_view_cast)
    assert vnodes.key_hash(views, ["s", "b"]).tolist() == expected.tolist()
