"""open_store: the Responses store at a `--response-store` URL (`config.response_store`)."""

from __future__ import annotations

from pathlib import Path

from deepinfer_server.store.sql import ResponseStore
from deepinfer_server.store.sqlite import SqliteDatabase


def open_store(url: str, *, ttl: float, max_bytes: int) -> ResponseStore:
    """The store at `url` (not connected yet: `await store.open()`)."""
    if url.startswith("sqlite://"):
        return ResponseStore(
            SqliteDatabase(Path(url.removeprefix("sqlite://"))), ttl=ttl, max_bytes=max_bytes
        )
    from deepinfer_server.store.postgres import PostgresDatabase  # the optional extra

    return ResponseStore(PostgresDatabase(url), ttl=ttl, max_bytes=max_bytes)
