"""The chaos trial log read back for ``--chaos-resume``: a long run in pieces."""

from __future__ import annotations

import json
from pathlib import Path

from tests.chaos.checker import Check
from tests.chaos.harness import TrialResult
from tests.chaos.resume import finished, result_from_dict


def _result(name: str, lost: int = 0) -> TrialResult:
    return TrialResult(spec={"name": name, "fault": "writer_point"}, fired=True,
                       recovery_seconds=1.5, seconds=12.0, notes=["n"],
                       checks=[Check(sink="main", rows_expected=10, rows_seen=10 - lost,
                                     lost=lost, problems=["lost"] if lost else [])],
                       phases={"checked": 11.0})


def test_a_result_reads_back_as_it_was_written() -> None:
    original = _result("t1", lost=3)
    again = result_from_dict(json.loads(json.dumps(original.as_dict())))
    assert again == original and not again.ok


def test_only_trials_of_this_commit_count(tmp_path: Path) -> None:
    log = tmp_path / "trials-seed7.jsonl"
    lines = [{**_result("t1").as_dict(), "commit": "abc"},
             {**_result("t2").as_dict(), "commit": "old"},
             {**_result("t3").as_dict(), "commit": "abc"}]
    log.write_text("\n".join(json.dumps(line) for line in lines) + "\n{\"cut sho")
    found = finished(log, "abc", ["t1", "t2", "t4"])
    assert sorted(found) == ["t1"]  # t2 ran on other code, t3 is not in the plan
    assert finished(log, "abc+dirty", ["t1"]) == {}  # uncommitted code: run again
    assert finished(tmp_path / "none.jsonl", "abc", ["t1"]) == {}


def test_an_earlier_commit_given_counts_for_its_passed_trials_only(tmp_path: Path) -> None:
    """``--chaos-resume-from old``: a harness change that cannot alter a passed trial.
    Its failed trials run again; a line of this commit wins over an earlier one."""
    log = tmp_path / "trials-seed7.jsonl"
    failed = {**_result("t2").as_dict(), "commit": "old", "failure": "AssertionError: x"}
    lines = [{**_result("t1").as_dict(), "commit": "old"}, failed,
             {**_result("t3").as_dict(), "commit": "other"},
             {**_result("t4").as_dict(), "commit": "old"},
             {**_result("t4", lost=1).as_dict(), "commit": "abc"}]
    log.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    found = finished(log, "abc", ["t1", "t2", "t3", "t4"], ["old"])
    assert sorted(found) == ["t1", "t4"] and not found["t4"].ok
    assert sorted(finished(log, "abc", ["t1", "t2", "t3", "t4"])) == ["t4"]
