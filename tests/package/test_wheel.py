"""The package installs clean: ``python -m build`` makes a wheel and an sdist, and a fresh
virtual environment with ``pip install 'raysink-*.whl[all]'`` (its dependencies at the
oldest releases, ``constraints/oldest.txt``, as ``make compat`` runs) imports raysink from
its own site-packages, not this source tree, prints the version, exports the dashboard
the wheel carries and runs ``raysink demo`` end to end (Ray, RayDP, Delta).

Marked ``slow`` (minutes: a venv and a RayDP session): ``make compat`` runs it
(``scripts/compat.sh``), with the ``build`` package in its venv."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import raysink

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]


def _run(args: list[str | Path], cwd: Path, timeout: float = 600,
         env: dict[str, str] | None = None) -> str:
    done = subprocess.run([str(a) for a in args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, check=False, env=env)
    assert done.returncode == 0, f"{args}:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    return done.stdout


def _clean_env() -> dict[str, str]:
    """This environment without anything pointing at the source tree."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYSPARK_PYTHON", "RAYSINK_FAULT_DIR")}
    env.pop("PYSPARK_DRIVER_PYTHON", None)
    return env


def test_the_wheel_installs_clean_and_runs_the_demo(tmp_path: Path) -> None:
    dist = tmp_path / "dist"
    _run([sys.executable, "-m", "build", "--outdir", dist, REPO], cwd=tmp_path)
    version = raysink.__version__
    (wheel,) = dist.glob(f"raysink-{version}-*.whl")
    (sdist,) = dist.glob(f"raysink-{version}.tar.gz")
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = {f"raysink/dashboards/{p.name}"
               for p in (REPO / "raysink" / "dashboards").iterdir()
               if p.suffix in (".json", ".yaml")}
    assert {"raysink/dashboards/raysink.json", "raysink/dashboards/alerts.yaml"} <= shipped
    assert shipped | {"raysink/py.typed", "raysink/protocol/requirements.py"} <= names
    assert not any(name.startswith("tests/") for name in names)
    assert sdist.stat().st_size > 0

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", venv], cwd=tmp_path)
    python, env = venv / "bin" / "python", _clean_env()
    _run([python, "-m", "pip", "install", "-q", "-c", REPO / "constraints" / "oldest.txt",
          f"{wheel}[all]"], cwd=tmp_path, timeout=900, env=env)

    where = _run([python, "-c", "import raysink; print(raysink.__file__)"], cwd=tmp_path,
                 env=env).strip()
    assert Path(where).is_relative_to(venv), where
    assert _run([venv / "bin" / "raysink", "--version"], cwd=tmp_path,
                env=env).strip() == f"raysink {version}"
    board = json.loads(_run([venv / "bin" / "raysink", "dashboard", "export", "-"],
                            cwd=tmp_path, env=env))
    assert board["panels"]

    out = _run([venv / "bin" / "raysink", "demo", "--events", "20000", "--batches", "2",
                "--workdir", tmp_path / "demo"], cwd=tmp_path, env=env)
    assert "every event id present exactly once: yes" in out
