"""The node-loss trial's parent without a cluster: a child whose cluster could not start
is started again; a child that failed once its cluster was up fails the trial."""

from __future__ import annotations

from pathlib import Path
from typing import IO, Any

import pytest

from tests.chaos import node_loss
from tests.chaos.harness import TrialResult
from tests.chaos.plan import make_plan

_STARTUP = ("Exception: The current node timed out during startup. This could happen "
            "because some of the raylet failed to startup or the GCS has become overloaded.\n")
_FINISHED = "CLUSTER UP\nDONE 1 True\nLOST 3fa1c2d0 0.412\nDONE 2 True\nRECOVERED 2.5\nALL DONE\n"


def _children(monkeypatch: pytest.MonkeyPatch, runs: list[tuple[str, str, int]]) -> list[int]:
    """Each child run in turn prints (stdout, stderr) and exits with its code."""
    calls: list[int] = []

    def child(config: dict[str, Any], err: IO[bytes]) -> tuple[str, int]:
        stdout, stderr, code = runs[len(calls)]
        calls.append(code)
        err.write(stderr.encode())
        return stdout, code

    monkeypatch.setattr(node_loss, "_child", child)
    return calls


def _spec() -> Any:
    return next(t for t in make_plan(1126, 200) if t.fault == "node_loss")


def test_a_child_whose_cluster_did_not_start_is_started_again(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    calls = _children(monkeypatch, [("", _STARTUP, 1), ("", _STARTUP, 1),
                                    (_FINISHED, "", 0)])
    result = TrialResult(spec={})
    node_loss.run(_spec(), {}, "postgresql://m", tmp_path, result)
    assert calls == [1, 1, 0]
    started_again = [n for n in result.notes if "cluster did not start" in n]
    assert len(started_again) == 2 and "timed out during startup" in started_again[0]
    assert result.fired and result.recovery_seconds == 2.5


def test_a_child_that_failed_after_its_cluster_was_up_fails_the_trial(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    calls = _children(monkeypatch, [("CLUSTER UP\nDONE 1 True\n", "epoch 2 lost\n", 1),
                                    (_FINISHED, "", 0)])
    with pytest.raises(AssertionError, match=r"did not finish \(exit 1\)"):
        node_loss.run(_spec(), {}, "postgresql://m", tmp_path, TrialResult(spec={}))
    assert calls == [1]


def test_a_cluster_that_never_starts_fails_the_trial(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    calls = _children(monkeypatch, [("", _STARTUP, 1)] * node_loss._CLUSTER_TRIES)
    with pytest.raises(AssertionError, match="timed out during startup"):
        node_loss.run(_spec(), {}, "postgresql://m", tmp_path, TrialResult(spec={}))
    assert len(calls) == node_loss._CLUSTER_TRIES
