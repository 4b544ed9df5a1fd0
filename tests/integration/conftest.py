"""The integration layer's shared fixtures (``ray_session`` and ``pg_server`` come from
``tests/conftest.py``).

``name``    a runtime name no other test or session uses; its fault arms removed afterwards
``meta``    a SQLite meta store URL in the test's ``tmp_path``
``schema``  a fresh PostgreSQL schema owned by ``raysink``, dropped afterwards (any prepared
            transaction left in the database rolled back first)
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from raysink.testing import disarm_faults
from tests.integration.real_targets import pg_schema
from tests.support.postgres import PostgresServer


@pytest.fixture
def name(request: pytest.FixtureRequest) -> Iterator[str]:
    module = request.module.__name__.rsplit(".", 1)[-1].removeprefix("test_")
    runtime = f"{module[:12].replace('_', '-')}-{uuid.uuid4().hex[:8]}"
    yield runtime
    disarm_faults(runtime)


@pytest.fixture
def meta(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'meta.db'}"


@pytest.fixture
def schema(pg_server: PostgresServer) -> Iterator[str]:
    yield from pg_schema(pg_server)

