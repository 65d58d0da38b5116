"""The run store the restore tests run against: each of them runs with the journal file and with
PostgreSQL (a real server, tests/conftest.py; skipped, saying why, where none can be started)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from luftpause.runtime.journal import Journal
from luftpause.runtime.store import RunStore


class Stores:
    """Opens one test's run store, as each start of a runtime does."""

    def __init__(self, kind: str, state_dir: Path, url: str | None) -> None:
        self.kind, self.state_dir, self.url = kind, state_dir, url

    def open(self) -> RunStore:
        if self.url is None:
            return Journal(self.state_dir)
        from luftpause.runtime.postgres_store import PostgresStore

        return PostgresStore(self.url)

    def records(self) -> list[dict[str, Any]]:
        """Every record the store holds, read by a store opened for it."""
        store = self.open()
        try:
            return store.records()
        finally:
            store.close()

    def archived(self, handle: str) -> dict[str, Any] | None:
        store = self.open()
        try:
            return store.archived(handle)
        finally:
            store.close()


@pytest.fixture(params=["file", "postgresql"])
def stores(request, tmp_path) -> Stores:
    url = request.getfixturevalue("postgres_url") if request.param == "postgresql" else None
    return Stores(request.param, tmp_path, url)
