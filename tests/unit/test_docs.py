"""The bad-input catalogue cites tests that exist: the doc cannot drift from the suite."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CATALOGUE = ROOT / "docs" / "bad_input.md"
_CITED = re.compile(r"`(tests/[\w/]+\.py)::(\w+)`")


def _citations() -> list[tuple[str, str]]:
    return sorted(set(_CITED.findall(CATALOGUE.read_text())))


def _test_names(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {node.name for node in ast.walk(tree)
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)}


def test_the_catalogue_cites_tests() -> None:
    assert len(_citations()) >= 30


@pytest.mark.parametrize(("module", "name"), _citations())
def test_cited_test_exists(module: str, name: str) -> None:
    path = ROOT / module
    assert path.is_file(), f"docs/bad_input.md cites {module}, which does not exist"
    assert name in _test_names(path), f"docs/bad_input.md cites {module}::{name}, not there"
