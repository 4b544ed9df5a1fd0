"""The integration layer's shared fixtures (``ray_session``, ``pg_server`` and ``name``,
a runtime name of the test's own, come from ``tests/conftest.py``), and its modules'
order: the costliest first (``tests.support.schedule``), so that parallel workers do not
end the layer on one long module.

``meta``    a SQLite meta store URL in the test's ``tmp_path``
``schema``  a fresh PostgreSQL schema owned by ``raysink``, dropped afterwards (any prepared
            transaction left in the database rolled back first)
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.real_targets import pg_schema
from tests.support.postgres import PostgresServer
from tests.support.schedule import load_costs, module_of, reorder


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    layer = [i for i, item in enumerate(items) if "integration" in Path(str(item.path)).parts]
    reorder(items, layer, lambda item: module_of(item.nodeid), load_costs())


@pytest.fixture
def meta(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'meta.db'}"


@pytest.fixture
def schema(pg_server: PostgresServer) -> Iterator[str]:
    yield from pg_schema(pg_server)

