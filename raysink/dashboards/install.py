"""Where a running Ray head's Grafana reads dashboards, and writing files there.

When Ray's dashboard starts on the head node it writes Grafana's configuration for the
session: ``<session dir>/metrics/grafana/grafana.ini``, a provisioning folder, and its own
dashboards (Default, Data, Serve, Train, ...) in ``<session dir>/metrics/grafana/
dashboards``, which the provisioning points Grafana at. A Grafana started with
``--config <temp dir>/session_latest/metrics/grafana/grafana.ini`` (Ray's instructions)
shows every JSON file in that folder, in the folder "Ray". ``install`` puts raysink's
there, next to Ray's.

Ray deletes and rewrites ``<session dir>/metrics/grafana`` each time the head starts (a
new session dir, too), so the dashboard must be installed again after a head restart; an
import through Grafana's UI (``raysink dashboard export``) stays. Ray's environment
variables that move these folders are honoured as Ray honours them on the head:
``RAY_METRICS_OUTPUT_ROOT`` (instead of ``<session dir>/metrics``) and
``RAY_METRICS_GRAFANA_DASHBOARD_OUTPUT_DIR`` (the dashboards folder itself).
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from raysink.errors import ConfigError

__all__ = ["DASHBOARD_NAME", "Installed", "dashboards_dir", "install", "session_dir",
           "write_if_changed"]

DASHBOARD_NAME = "raysink_grafana_dashboard.json"
_METRICS_ROOT_VAR = "RAY_METRICS_OUTPUT_ROOT"
_DASHBOARDS_VAR = "RAY_METRICS_GRAFANA_DASHBOARD_OUTPUT_DIR"


@dataclass(frozen=True, kw_only=True, slots=True)
class Installed:
    """``path`` written (``changed``: it did not hold this dashboard already);
    ``provisioned``: Ray wrote Grafana's provisioning for the session, so a Grafana
    started with Ray's configuration reads the folder."""

    path: Path
    changed: bool
    provisioned: bool


def _ray_temp_dir() -> Path:
    """Ray's default temp dir on Linux, as ``ray start`` picks it: ``ray`` under
    ``$RAY_TMPDIR``, else ``$TMPDIR``, else ``/tmp``."""
    base = os.environ.get("RAY_TMPDIR") or os.environ.get("TMPDIR") or "/tmp"
    return Path(base) / "ray"


def session_dir(temp_dir: str | Path | None = None) -> Path:
    """The session dir of the Ray head started last on this machine
    (``<temp dir>/session_latest``, resolved). ``ConfigError`` when there is none."""
    root = Path(temp_dir) if temp_dir is not None else _ray_temp_dir()
    latest = root / "session_latest"
    if not latest.exists():
        raise ConfigError(
            f"no Ray session under {root} ({latest} is missing): start the head first "
            "(`ray start --head`), run this on the head node, or pass --temp-dir (Ray's "
            "--temp-dir) or --session-dir")
    return latest.resolve()


def _metrics_root(session: Path) -> Path:
    return Path(os.environ.get(_METRICS_ROOT_VAR) or session / "metrics")


def dashboards_dir(session: Path) -> Path:
    """The folder Ray's Grafana provisioning reads dashboards from, for ``session``."""
    override = os.environ.get(_DASHBOARDS_VAR)
    if override:
        return Path(override)
    return _metrics_root(session) / "grafana" / "dashboards"


def write_if_changed(path: Path, text: str) -> bool:
    """Write ``text`` to ``path`` unless it holds it already (atomically: a reader never
    sees half a file). Returns whether the file changed."""
    if path.is_file() and path.read_text() == text:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as out:
            out.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return True


def install(text: str, session: Path) -> Installed:
    """Put the dashboard ``text`` in ``session``'s dashboards folder; idempotent."""
    if not session.is_dir():
        raise ConfigError(f"no Ray session dir at {session}: pass the session dir of a "
                          "running head (e.g. /tmp/ray/session_latest)")
    path = dashboards_dir(session) / DASHBOARD_NAME
    changed = write_if_changed(path, text)
    provisioned = (_metrics_root(session) / "grafana" / "provisioning").is_dir()
    return Installed(path=path, changed=changed, provisioned=provisioned)
