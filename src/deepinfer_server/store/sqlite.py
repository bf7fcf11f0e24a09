"""SqliteDatabase: the embedded store, one SQLite file shared by every API server process.

Each process opens its own connection (aiosqlite: the connection lives on a thread of its own,
so no call blocks the event loop). WAL journal: readers never wait for the writer, and a crash
(of the process or the machine) leaves the file consistent; `synchronous=NORMAL` may lose the
last transactions on a power cut, never the file. Writes are short `BEGIN IMMEDIATE`
transactions, so two processes never deadlock upgrading a read lock; one that finds the file
locked retries for up to `BUSY_TIMEOUT_MS` before its request fails with a 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiosqlite

from deepinfer_server.store.database import Step

BUSY_TIMEOUT_MS = 5000


class SqliteDatabase:
    """One connection of this process to the store's SQLite file."""

    errors: tuple[type[BaseException], ...] = (sqlite3.Error, OSError, ValueError)

    def __init__(self, path: Path) -> None:
        self.path = path
        self.description = f"sqlite:///{path}"
        self._connection: aiosqlite.Connection | None = None
        # One transaction at a time on this connection (the process's requests share it).
        self._write_lock = asyncio.Lock()

    async def open(self) -> None:
        if self._connection is not None:
            return
        # Opened once on a worker thread first: a file that cannot be opened fails here, before
        # aiosqlite starts a thread that would outlive the failure.
        await asyncio.to_thread(_probe, self.path)
        connection = await aiosqlite.connect(self.path, isolation_level=None)
        try:
            await connection.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
            await connection.execute("PRAGMA journal_mode = WAL")
            await connection.execute("PRAGMA synchronous = NORMAL")
        except BaseException:
            await connection.close()
            raise
        self._connection = connection

    def _open_connection(self) -> aiosqlite.Connection:
        if self._connection is None:
            raise sqlite3.OperationalError("the response store is not open")
        return self._connection

    async def fetch(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        async with self._open_connection().execute(sql, tuple(params)) as cursor:
            return [tuple(row) for row in await cursor.fetchall()]

    async def write(self, steps: Sequence[Step]) -> list[int]:
        connection = self._open_connection()
        async with self._write_lock:
            await connection.execute("BEGIN IMMEDIATE")
            try:
                changed = []
                for step in steps:
                    if step.many:
                        cursor = await connection.executemany(step.sql, step.params)
                    else:
                        cursor = await connection.execute(step.sql, tuple(step.params))
                    changed.append(cursor.rowcount)
                    await cursor.close()
                await connection.execute("COMMIT")
            except BaseException:
                with contextlib.suppress(sqlite3.Error):
                    await connection.execute("ROLLBACK")
                raise
        return changed

    async def create_schema(self, statements: Sequence[str]) -> None:
        await self.write([Step(statement) for statement in statements])

    async def close(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            await connection.close()


def _probe(path: Path) -> None:
    """Create the file's directory and open the file once (raises where SQLite cannot)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    sqlite3.connect(path).close()
