"""Shared fixtures: `tests/support.py` holds the helpers; this file makes them importable, and
holds the fixtures that start a real PostgreSQL server for the run store's tests."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.fixture(scope="session")
def postgres_server():
    """One real PostgreSQL server for the session (support.start_postgres); the tests that need
    it are skipped, saying why, where none can be started."""
    from support import PostgresUnavailable, start_postgres

    try:
        server = start_postgres()
    except PostgresUnavailable as e:
        pytest.skip(f"no PostgreSQL server: {e}")
    yield server
    server.remove()


@pytest.fixture
def postgres_url(postgres_server) -> str:
    """A fresh database on the session's PostgreSQL server."""
    return postgres_server.new_database()
