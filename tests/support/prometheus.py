"""A throwaway Prometheus for tests, started by the test itself.

``PrometheusServer`` runs Debian's ``prometheus`` binary (``scripts/setup.sh`` installs the
package) on 127.0.0.1 on a free port, with its storage in a fresh directory under
``/tmp``, scraping ``targets`` and evaluating ``rule_files`` every ``interval``. It is
stopped by its own pid. ``query``, ``series`` and ``alerts`` speak Prometheus's HTTP API.

``ray_metrics_targets()`` gives the metrics export address of every live node of the Ray
the test process is connected to (Ray's per-node metrics agent serves them whether or not
Ray's dashboard runs).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from tests.support.ports import server_port

__all__ = ["PrometheusServer", "promtool", "ray_metrics_targets", "require_prometheus"]

_SETUP_HINT = "run scripts/setup.sh (it installs Debian's prometheus package, with promtool)"


def require_prometheus() -> tuple[str, str]:
    """The paths of ``prometheus`` and ``promtool``; a clear failure when missing."""
    found = shutil.which("prometheus"), shutil.which("promtool")
    if None in found:
        pytest.fail(f"prometheus or promtool is not installed; {_SETUP_HINT}", pytrace=False)
    return found[0] or "", found[1] or ""


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    """Run ``promtool`` with ``args``."""
    _, tool = require_prometheus()
    return subprocess.run([tool, *args], capture_output=True, text=True, timeout=60,
                          check=False)


def ray_metrics_targets() -> list[str]:
    """``host:port`` of each live Ray node's metrics export endpoint (one node: this
    machine's, on 127.0.0.1)."""
    import ray

    ports = sorted({int(n["MetricsExportPort"]) for n in ray.nodes() if n["Alive"]})
    return [f"127.0.0.1:{port}" for port in ports]


class PrometheusServer:
    """One Prometheus; ``start()``, then queries, then ``stop()`` (idempotent)."""

    def __init__(self, targets: Sequence[str], rule_files: Sequence[Path] = (), *,
                 interval: str = "1s") -> None:
        self.binary, _ = require_prometheus()
        self.port = server_port()
        self.root = Path(tempfile.mkdtemp(prefix="raysink-prom-", dir="/tmp"))
        self.targets, self.rule_files, self.interval = list(targets), list(rule_files), interval
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _config(self) -> str:
        config = {
            "global": {"scrape_interval": self.interval, "evaluation_interval": self.interval},
            "rule_files": [str(p) for p in self.rule_files],
            "scrape_configs": [{"job_name": "ray", "static_configs": [
                {"targets": self.targets}]}],
        }
        return json.dumps(config, indent=2)  # YAML reads JSON

    def start(self, timeout: float = 30.0) -> None:
        (self.root / "prometheus.yml").write_text(self._config())
        log = open(self.root / "prometheus.log", "wb")  # noqa: SIM115 (the child keeps it)
        self._process = subprocess.Popen(
            [self.binary, f"--config.file={self.root / 'prometheus.yml'}",
             f"--storage.tsdb.path={self.root / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            stdout=log, stderr=subprocess.STDOUT, cwd=self.root)
        log.close()
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(OSError), \
                    urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as answer:
                if answer.status == 200:
                    return
            if self._process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"prometheus did not start: {self.log_tail()}")
            time.sleep(0.2)

    def log_tail(self, lines: int = 20) -> str:
        with contextlib.suppress(OSError):
            text = (self.root / "prometheus.log").read_text(errors="replace")
            return "\n".join(text.splitlines()[-lines:])
        return ""

    def stop(self) -> None:
        """Stop the server (SIGTERM to its pid, SIGKILL after 10 s) and remove its files."""
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)
        shutil.rmtree(self.root, ignore_errors=True)

    def _get(self, path: str, **params: str) -> Any:
        query = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}{path}?{query}", timeout=10) as answer:
            body = json.loads(answer.read())
        if body.get("status") != "success":
            raise AssertionError(f"prometheus answered {body}")
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query: ``[{"metric": {...}, "value": [t, "v"]}, ...]``."""
        data = self._get("/api/v1/query", query=expr)
        if data["resultType"] != "vector":
            raise AssertionError(f"{expr} gave a {data['resultType']}, not a vector")
        result: list[dict[str, Any]] = data["result"]
        return result

    def series(self, match: str) -> list[dict[str, str]]:
        result: list[dict[str, str]] = self._get("/api/v1/series", **{"match[]": match})
        return result

    def alerts(self) -> list[dict[str, Any]]:
        """The active alerts (pending or firing) with their labels and state."""
        result: list[dict[str, Any]] = self._get("/api/v1/alerts")["alerts"]
        return result
