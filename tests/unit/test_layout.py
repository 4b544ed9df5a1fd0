"""The package keeps the layout ``raysink``'s docstring maps: packages by the process they
run in, no module over 600 lines, at most 10 modules loose at the top of the package (each
named in the map), and the runtime's actors called only through the typed clients of
``raysink.protocol.clients``, never by a method name mypy cannot see."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "raysink"
MAX_LINES = 600
MAX_LOOSE = 10
CLIENTS = PACKAGE / "protocol" / "clients.py"
# the actor classes whose methods only the clients call
ACTORS = {PACKAGE / "coordinator" / "coordinator.py": "CoordinatorActor",
          PACKAGE / "coordinator" / "stream_calls.py": "StreamCalls",
          PACKAGE / "coordinator" / "maintenance.py": "MaintenanceCalls",
          PACKAGE / "coordinator" / "standby.py": "StandbyCoordinatorActor",
          PACKAGE / "writer" / "writer.py": "SinkWriterActor"}


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _map() -> str:
    doc = ast.get_docstring(ast.parse((PACKAGE / "__init__.py").read_text()))
    assert doc is not None
    return doc


def test_no_module_over_600_lines() -> None:
    lines = {str(path.relative_to(REPO)): len(path.read_text().splitlines())
             for path in _modules()}
    assert {path: n for path, n in lines.items() if n > MAX_LINES} == {}


def test_few_modules_are_loose_and_the_map_names_each() -> None:
    loose = sorted(path.stem for path in PACKAGE.glob("*.py") if path.stem != "__init__")
    assert len(loose) <= MAX_LOOSE, loose
    doc = _map()
    named = [m for m in loose if re.search(rf"(?<![\w.]){m}\b|raysink\.{m}\b", doc)]
    assert sorted(set(loose) - set(named)) == []


def test_the_map_names_every_package() -> None:
    packages = sorted(path.parent.name for path in PACKAGE.glob("*/__init__.py"))
    doc = _map()
    assert [p for p in packages if f"raysink.{p}" not in doc] == []


def _actor_methods() -> set[str]:
    methods: set[str] = set()
    for path, name in ACTORS.items():
        tree = ast.parse(path.read_text())
        cls = next(node for node in tree.body
                   if isinstance(node, ast.ClassDef) and node.name == name)
        methods |= {node.name for node in cls.body
                    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
                    and not node.name.startswith("_")}
    return methods


def _remote_calls(tree: ast.AST, methods: set[str]) -> list[tuple[int, str]]:
    """``x.<method>.remote(...)`` of an actor method, or ``getattr(x, ...).remote(...)``."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "remote"):
            continue
        target = node.func.value
        if isinstance(target, ast.Attribute) and target.attr in methods:
            found.append((node.lineno, f".{target.attr}.remote"))
        elif (isinstance(target, ast.Call) and isinstance(target.func, ast.Name)
              and target.func.id == "getattr"):
            found.append((node.lineno, "getattr(...).remote"))
    return found


def test_actors_are_called_only_through_the_typed_clients() -> None:
    methods = _actor_methods()
    assert {"open_epoch", "status", "write", "finish", "ping", "take_over"} <= methods
    calls = {f"{path.relative_to(REPO)}:{line}": what
             for path in _modules() if path != CLIENTS
             for line, what in _remote_calls(ast.parse(path.read_text()), methods)}
    assert calls == {}


def test_the_check_finds_a_call_by_method_and_by_name() -> None:
    tree = ast.parse("handle.status.remote()\ngetattr(handle, 'status').remote()\n"
                     "task.remote(1)\nactor.getRDDPartition.remote(1)\n")
    assert sorted(_remote_calls(tree, {"status"})) == [(1, ".status.remote"),
                                               (2, "getattr(...).remote")]


def _imports(path: Path) -> set[str]:
    modules: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            modules.add(node.module)
        elif isinstance(node, ast.Import):
            modules |= {alias.name for alias in node.names}
    return modules


def test_the_actors_packages_never_import_the_drivers() -> None:
    """What runs in a writer or the coordinator (the sinks too) does not reach into the
    driver's package (the driver imports theirs: it creates the actors)."""
    found = {f"{path.relative_to(REPO)}: {module}"
             for package in ("writer", "coordinator", "sinks")
             for path in sorted((PACKAGE / package).rglob("*.py"))
             for module in _imports(path) if module.startswith("raysink.driver")}
    assert found == set()


LAYERED = ("postgres", "kafka")
"""The sink packages whose docstring draws their modules in layers."""


def _layers(name: str) -> dict[str, int]:
    """Each module of ``raysink.sinks.<name>`` by its layer in the package's docstring
    (0 the top); modules on one line share a layer."""
    package = PACKAGE / "sinks" / name
    modules = {path.stem for path in package.glob("_*.py") if path.stem != "__init__"}
    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text()))
    assert doc is not None and "in layers" in doc
    block = doc.split("in layers", 1)[1].split("::", 1)[1].split("\n\n", 2)[1]
    layers: dict[str, int] = {}
    for line in block.splitlines():
        names = [n for n in re.findall(r"(?<!\w)_[a-z]+", line) if n in modules]
        if names:
            level = len(set(layers.values()))
            layers.update(dict.fromkeys(names, level))
    assert set(layers) == modules, f"every module of {name} has its layer"
    return layers


@pytest.mark.parametrize("name", LAYERED)
def test_the_layered_sink_packages_import_downward_only(name: str) -> None:
    """No module imports one drawn at or above its own layer, also not for type checking
    only (a cycle read through ``TYPE_CHECKING`` is still a cycle)."""
    layers = _layers(name)
    prefix = f"raysink.sinks.{name}"
    upward: list[str] = []
    for module, level in layers.items():
        tree = ast.parse((PACKAGE / "sinks" / name / f"{module}.py").read_text())
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom) or not node.module:
                continue
            if node.module == prefix:
                imported = [alias.name for alias in node.names]
            elif node.module.startswith(prefix + "."):
                imported = [node.module.rsplit(".", 1)[1]]
            else:
                continue
            upward += [f"{module} imports {other}" for other in imported
                       if other in layers and layers[other] <= level and other != module]
    assert upward == []
