"""A long chaos run in pieces: ``--chaos-resume`` runs only the plan's trials the trial log
does not hold yet for this very code, and reports on all of them.

Every line of ``trials-seed<N>.jsonl`` carries the commit it ran on (``git rev-parse
HEAD``, ``+dirty`` with uncommitted changes). A resumed session counts the lines of the
current commit only, and only when the tree is clean: trials of other code are run again,
so the report always describes one version of raysink.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest

from tests.chaos.checker import Check
from tests.chaos.harness import TrialResult

__all__ = ["code_of_session", "code_version", "finished", "result_from_dict"]

_REPO = Path(__file__).resolve().parents[2]
_VERSION = pytest.StashKey[str]()


def code_of_session(config: pytest.Config) -> str:
    """The commit this session's trials run on, asked once per session."""
    return config.stash.setdefault(_VERSION, code_version())


def code_version(repo: Path = _REPO) -> str:
    """The commit the trials run on, with ``+dirty`` when the tree has changes."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(repo), *args], capture_output=True,
                              text=True, check=False, timeout=30).stdout.strip()

    head = git("rev-parse", "HEAD") or "unknown"
    return head + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def result_from_dict(line: dict[str, Any]) -> TrialResult:
    """A trial's result as the trial log holds it."""
    return TrialResult(
        spec=line["spec"], fired=bool(line["fired"]),
        recovery_seconds=line.get("recovery_seconds"), seconds=float(line["seconds"]),
        errors=list(line.get("errors", [])), notes=list(line.get("notes", [])),
        checks=[Check(**check) for check in line.get("checks", [])],
        failure=line.get("failure"), phases=dict(line.get("phases", {})))


def finished(log: Path, version: str, names: Iterable[str],
             passed_on: Iterable[str] = ()) -> dict[str, TrialResult]:
    """The results the log holds for ``names`` on code ``version`` (the last line of each
    trial wins); none for a dirty tree. ``passed_on``: earlier commits whose *passed*
    trials count as well (``--chaos-resume-from``: a harness change that cannot alter a
    trial that passed, such as more patience after the sixth failed driver call); their
    failed trials run again."""
    wanted, earlier = set(names), set(passed_on)
    if version.endswith("+dirty") or not log.exists():
        return {}
    found: dict[str, TrialResult] = {}
    for text in log.read_text().splitlines():
        try:
            line = json.loads(text)
        except ValueError:
            continue  # a line cut short by a run that was stopped
        name = line.get("spec", {}).get("name")
        if name not in wanted:
            continue
        commit = line.get("commit")
        if commit == version or (commit in earlier and not line.get("failure")
                                 and name not in found):
            found[name] = result_from_dict(line)
    return found
