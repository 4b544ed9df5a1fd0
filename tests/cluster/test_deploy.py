"""The README's deploy path, run for real: ``ray start --head``, ``ray job submit``.

A Ray head is started on this machine the way ``cluster.yaml`` starts one (token
authentication on, ``PYSPARK_PYTHON`` and ``PATH`` naming this environment), but in a
temporary directory of its own with ports of its own, so nothing else on the machine joins
it. ``examples/cluster_job.py`` is submitted with ``--working-dir`` (the checkout,
uploaded by Ray; ``.gitignore`` keeps the virtual environment out), writes a DataFrame
through Spark into a Parquet directory with its decisions in the PostgreSQL meta store;
the table holds every row once. The meta store URL on the command line carries no
password (Ray keeps a job's command line in its job table): the password comes from a
``PGPASSFILE`` in the head's environment, as the README advises. The same epoch
submitted again is reported skipped and writes nothing. The head is stopped by the pid
of its ``ray start --block`` process (never ``ray stop``, which ends every Ray on the
machine), and any process left under its directory is killed by pid.

``ray up cluster.yaml`` is not run: the cluster launcher's local provider reaches its
nodes over SSH, and this machine has no SSH server (README, "Running on a cluster").
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pyarrow.dataset as ds
import pytest

from tests.support.postgres import PostgresServer

pytestmark = pytest.mark.timeout(420)

_REPO = Path(__file__).resolve().parents[2]
_BIN = Path(sys.executable).parent
ROWS = 20_000


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


class Head:
    """A Ray head of its own: ``ray start --head --block`` in a new session."""

    def __init__(self, root: Path, env: dict[str, str]) -> None:
        self.root = root
        (gcs, self.dashboard, client, manager, objects, agent, agent_grpc, runtime_env,
         metrics) = _free_ports(9)
        self.env = {**os.environ, "PATH": f"{_BIN}:{os.environ.get('PATH', '')}",
                    "PYSPARK_PYTHON": sys.executable, "RAY_AUTH_MODE": "token",
                    "RAY_AUTH_TOKEN": secrets.token_hex(32), "RAY_TMPDIR": str(root),
                    "RAY_USAGE_STATS_ENABLED": "0", **env}
        self.env.pop("RAY_ADDRESS", None)
        self._log = (root / "head.log").open("wb")
        self.proc = subprocess.Popen(
            [str(_BIN / "ray"), "start", "--head", "--block", f"--temp-dir={root / 'ray'}",
             f"--port={gcs}", f"--dashboard-port={self.dashboard}",
             "--dashboard-host=127.0.0.1", "--include-dashboard=true",
             f"--ray-client-server-port={client}", f"--node-manager-port={manager}",
             f"--object-manager-port={objects}", f"--dashboard-agent-listen-port={agent}",
             f"--dashboard-agent-grpc-port={agent_grpc}",
             f"--runtime-env-agent-port={runtime_env}", f"--metrics-export-port={metrics}",
             "--num-cpus=4", "--object-store-memory=200000000", "--disable-usage-stats"],
            cwd=root, env=self.env, stdout=self._log, stderr=subprocess.STDOUT,
            start_new_session=True)

    @property
    def address(self) -> str:
        return f"http://127.0.0.1:{self.dashboard}"

    def wait_ready(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            done = subprocess.run([str(_BIN / "ray"), "job", "list", "--address", self.address],
                                  env=self.env, capture_output=True, text=True, check=False)
            if done.returncode == 0:
                return
            assert self.proc.poll() is None, self._tail()
            assert time.monotonic() < deadline, f"the job server never answered\n{self._tail()}"
            time.sleep(2)

    def submit(self, *args: str, agent_wait: float = 120.0) -> subprocess.CompletedProcess[str]:
        """``ray job submit`` of the example job. The head's job agent may register after
        the job server answers: a submit refused with "No available agent" (nothing was
        submitted; Ray says to try again later) is sent again, up to ``agent_wait`` s
        (CI at 7db1514, load 25)."""
        deadline = time.monotonic() + agent_wait
        while True:
            done = subprocess.run(
                [str(_BIN / "ray"), "job", "submit", "--address", self.address,
                 "--working-dir", str(_REPO), "--", "python", "examples/cluster_job.py",
                 *args], env=self.env, capture_output=True, text=True, check=False,
                timeout=360)
            if ("No available agent to submit job" not in done.stdout + done.stderr
                    or time.monotonic() > deadline):
                return done
            time.sleep(3)

    def _tail(self) -> str:
        return (self.root / "head.log").read_text(errors="replace")[-3000:]

    def stop(self) -> None:
        """SIGTERM to ``ray start --block`` (it ends what it started), then SIGKILL by pid
        whatever still runs under this head's directory."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
        for proc in _leftovers(str(self.root)):
            proc.kill()
        psutil.wait_procs(_leftovers(str(self.root)), timeout=30)


def _leftovers(marker: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            if marker in " ".join(proc.info["cmdline"] or ()):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


@pytest.fixture
def head(pg_server: PostgresServer) -> Iterator[Head]:
    root = Path(tempfile.mkdtemp(prefix="rsd-", dir="/tmp"))  # short: socket paths
    passfile = root / "pgpass"
    passfile.write_text(f"{pg_server.host}:{pg_server.port}:raysink:raysink:"
                        f"{pg_server.password('raysink')}\n")
    passfile.chmod(0o600)
    started = Head(root, {"PGPASSFILE": str(passfile)})
    try:
        started.wait_ready()
        yield started
    finally:
        started.stop()
        assert not _leftovers(str(root)), "processes of the test's Ray head left running"
        shutil.rmtree(root, ignore_errors=True)


def test_job_submitted_to_a_head_writes_once_and_a_resubmit_is_skipped(
        head: Head, pg_server: PostgresServer, tmp_path: Path) -> None:
    table = tmp_path / "orders"
    metastore = pg_server.dsn(password="")  # the password: the head's PGPASSFILE
    assert pg_server.password("raysink") not in metastore
    args = ["--metastore", metastore, "--table", str(table), "--name", "deploy_test",
            "--epoch", "1", "--rows", str(ROWS), "--partitions", "4", "--executors", "1",
            "--executor-cores", "1", "--executor-memory", "512m"]
    first = head.submit(*args)
    assert first.returncode == 0, first.stdout[-4000:] + first.stderr[-4000:]
    assert "skipped=False" in first.stdout and "committed=True" in first.stdout
    ids = ds.dataset(str(table), format="parquet").to_table(columns=["id"]).column("id")
    assert sorted(ids.to_pylist()) == list(range(ROWS))

    again = head.submit(*args)
    assert again.returncode == 0, again.stdout[-4000:] + again.stderr[-4000:]
    assert "skipped=True" in again.stdout and "last committed epoch 1" in again.stdout
    assert pg_server.password("raysink") not in first.stdout + again.stdout
    assert pg_server.password("raysink") not in first.stderr + again.stderr
    ids = ds.dataset(str(table), format="parquet").to_table(columns=["id"]).column("id")
    assert sorted(ids.to_pylist()) == list(range(ROWS))
