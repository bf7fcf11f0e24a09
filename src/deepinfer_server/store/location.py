"""open_store: the Responses store at a `--response-store` URL (`config.response_store`), and
the start-up check of an SQLite file."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from deepinfer_server.errors import ConfigError
from deepinfer_server.store.database import Database
from deepinfer_server.store.responses import ResponseStore
from deepinfer_server.store.schema import SCHEMA
from deepinfer_server.store.sqlite import SqliteDatabase


def open_store(
    url: str,
    *,
    ttl: float,
    max_bytes: int,
    scope_max_bytes: int | None = None,
    response_max_bytes: int | None = None,
    scope_max_files: int = 10_000,
) -> ResponseStore:
    """The store at `url` (not connected yet: `await store.open()`); the limits as
    `ResponseStore` takes them."""
    database: Database
    if url.startswith("sqlite://"):
        database = SqliteDatabase(Path(url.removeprefix("sqlite://")))
    else:
        from deepinfer_server.store.postgres import PostgresDatabase  # the optional extra

        database = PostgresDatabase(url)
    return ResponseStore(
        database,
        ttl=ttl,
        max_bytes=max_bytes,
        scope_max_bytes=scope_max_bytes,
        response_max_bytes=response_max_bytes,
        scope_max_files=scope_max_files,
    )


def check_store(url: str) -> None:
    """Before anything starts: an SQLite store's file can be created and written, and is not
    damaged (SQLite's `quick_check`); ConfigError saying what to change otherwise. A PostgreSQL
    store is not checked: a database that is down fails only the requests that need it, until
    it is back."""
    if not url.startswith("sqlite://"):
        return
    path = Path(url.removeprefix("sqlite://"))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with sqlite3.connect(path, timeout=5) as connection:
            connection.execute("PRAGMA journal_mode = WAL")
            problems = [row[0] for row in connection.execute("PRAGMA quick_check(5)")]
            if problems != ["ok"]:
                raise sqlite3.DatabaseError("; ".join(problems))
            for statement in SCHEMA:
                connection.execute(statement)
        connection.close()
    except (OSError, sqlite3.OperationalError) as exc:
        raise ConfigError(
            f"cannot open the response store {path}: {exc} (choose a writable --state-dir, "
            "another --response-store, or --response-store none)"
        ) from exc
    except sqlite3.Error as exc:  # what is left: a damaged file (CORRUPT, NOTADB)
        raise ConfigError(
            f"the response store {path} is damaged ({exc}): restore it from a backup, or "
            "move it away to start with an empty store (or choose another --response-store, "
            "or --response-store none)"
        ) from exc
