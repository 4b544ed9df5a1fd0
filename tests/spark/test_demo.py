"""``raysink demo`` end to end in its own process (it starts and stops its own Ray and
RayDP), small sizes; then ``raysink status`` on the meta store it left."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pyarrow.dataset as ds


def _raysink(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "raysink.cli", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=400, check=False)


def test_demo_streams_every_event_exactly_once(tmp_path: Path) -> None:
    workdir = tmp_path / "demo"
    done = _raysink("demo", "--events", "30000", "--batches", "3", "--workdir", str(workdir),
                    cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "every event id present exactly once: yes" in out
    assert "rows written        30,000 order events" in out
    assert "epochs              3 (one per micro-batch; epochs 1-3)" in out
    assert "p50" in out and "p99" in out
    assert "\r" not in out  # not a terminal: no progress bar drawn
    assert "WARN" not in done.stderr and "Traceback" not in done.stderr

    from deltalake import DeltaTable

    ids = DeltaTable(str(workdir / "table")).to_pyarrow_table(columns=["order_id"])
    assert sorted(ids["order_id"].to_pylist()) == list(range(30000))
    assert ds.dataset(str(workdir / "input"), format="parquet").count_rows() == 30000

    status = _raysink("status", "demo-orders", "--metastore",
                      f"sqlite:///{workdir / 'meta' / 'demo.db'}", cwd=tmp_path)
    assert status.returncode == 0, status.stderr
    assert "last committed epoch  3" in status.stdout
    assert "main (delta): paused" in status.stdout
