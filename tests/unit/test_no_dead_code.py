"""Every public function, class and method of the package has a caller in the package.

A name-level check: a public name defined in ``raysink`` must appear somewhere else in
``raysink`` (a call, an attribute, a string naming a remote method, an ``__all__``
entry). It cannot see a method that shares its name with a live one, but it does catch
code nothing calls any more. Tests do not count as callers.
"""

from __future__ import annotations

import ast
import re
from collections import Counter
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "raysink"

# Kept on purpose, with the reason; anything else without a caller is dead code.
WAIVED = {
    # called by Ray Data, not by raysink (ray.data.Datasink's contract)
    "EpochDatasink.get_name",
    # called by pyiceberg's write_file and location provider (a compacted file's name/place)
    "_PartitionPlace.to_path",
    "_NamedTask.generate_data_file_filename",
}


def _public_definitions() -> list[tuple[Path, int, str]]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in tree.body:
            kinds = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
            if isinstance(node, kinds) and not node.name.startswith("_"):
                found.append((path, node.lineno, node.name))
            if isinstance(node, ast.ClassDef):
                found += [(path, sub.lineno, f"{node.name}.{sub.name}") for sub in node.body
                          if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef))
                          and not sub.name.startswith("_")]
    return found


def test_every_public_name_has_a_caller_in_the_package() -> None:
    text = "\n".join(p.read_text() for p in sorted(PACKAGE.rglob("*.py")))
    words = Counter(re.findall(r"\w+", text))
    dead = []
    for path, line, qualified in _public_definitions():
        if words[qualified.rsplit(".", 1)[-1]] <= 1 and qualified not in WAIVED:
            dead.append(f"{path.relative_to(PACKAGE.parent)}:{line} {qualified}")
    assert not dead, "public code nothing in raysink calls:\n" + "\n".join(dead)
