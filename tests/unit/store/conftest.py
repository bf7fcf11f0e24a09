"""The store suites' backends: SQLite (always) and PostgreSQL (marker `postgres`: a throwaway
cluster from Debian's binaries, one per test module)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.postgres import PostgresServer

#: The PostgreSQL cases start a real server: lane `postgres`, and e2e (not the fast lane).
BACKENDS = ["sqlite", pytest.param("postgres", marks=[pytest.mark.postgres, pytest.mark.e2e])]


@pytest.fixture(scope="module")
def postgres_server() -> Iterator[PostgresServer]:
    server = PostgresServer()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(params=BACKENDS)
def store_url_of(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[[], str]:
    """A fresh store's URL (every call in one test gives the same store)."""
    if request.param == "sqlite":
        url = f"sqlite://{tmp_path / 'responses.sqlite3'}"
    else:
        url = request.getfixturevalue("postgres_server").new_database()
    return lambda: url
