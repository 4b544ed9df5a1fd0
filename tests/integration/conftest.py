"""The integration layer's shared fixtures (``ray_session``, ``pg_server`` and ``name``,
a runtime name of the test's own, come from ``tests/conftest.py``).

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


@pytest.fixture
def meta(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'meta.db'}"


@pytest.fixture
def schema(pg_server: PostgresServer) -> Iterator[str]:
    yield from pg_schema(pg_server)

