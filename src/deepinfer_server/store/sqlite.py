"""SqliteDatabase: the embedded store, one SQLite file shared by every API server process.

Each process opens its own connection (aiosqlite: the connection lives on a thread of its own,
so no call blocks the event loop). WAL journal: readers never wait for the writer, and a crash
(of the process or the machine) leaves the file consistent; `synchronous=NORMAL` may lose the
last transactions on a power cut, never the file. Writes are short `BEGIN IMMEDIATE`
transactions, so two processes never deadlock upgrading a read lock; one that finds the file
locked retries for up to `BUSY_TIMEOUT_MS` before its request fails with a 503.

A full disk must not stop deletes (the only way to free space through the API), yet SQLite needs
room in its journal to delete. Beside the file, the store keeps `RESERVE_BYTES` of reserved
space (`<file>-reserve`, allocated when the store opens), and checkpoints its journal before
it outgrows half of that; a delete that finds the disk full gives the reserve back, deletes,
and checkpoints the journal (which frees it), then takes the reserve again. A save never
uses the reserve: on a full disk it fails (and the client is told).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sqlite3
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiosqlite

from deepinfer_server.store.database import Step

BUSY_TIMEOUT_MS = 5000
#: Space kept beside the file for deletes on a full disk (module docstring).
RESERVE_BYTES = 8 * 1024 * 1024


class SqliteDatabase:
    """One connection of this process to the store's SQLite file."""

    errors: tuple[type[BaseException], ...] = (sqlite3.Error, OSError, ValueError)

    def __init__(
        self,
        path: Path,
        *,
        busy_timeout_ms: int = BUSY_TIMEOUT_MS,
        reserve_bytes: int = RESERVE_BYTES,
    ) -> None:
        self.path = path
        self.description = f"sqlite:///{path}"
        self._busy_timeout_ms = busy_timeout_ms
        self._reserve = Path(f"{path}-reserve")
        self._reserve_bytes = reserve_bytes
        self._connection: aiosqlite.Connection | None = None
        # One transaction at a time on this connection (the process's requests share it).
        self._write_lock = asyncio.Lock()

    async def open(self) -> None:
        if self._connection is not None:
            return
        # Opened once on a worker thread first: a file that cannot be opened fails here, before
        # aiosqlite starts a thread that would outlive the failure.
        await asyncio.to_thread(_probe, self.path)
        await asyncio.to_thread(self._take_reserve)
        connection = await aiosqlite.connect(self.path, isolation_level=None)
        try:
            await connection.execute(f"PRAGMA busy_timeout = {self._busy_timeout_ms}")
            await connection.execute("PRAGMA journal_mode = WAL")
            await connection.execute("PRAGMA synchronous = NORMAL")
            # The journal is checkpointed (and cut back) before it outgrows half the reserve, so
            # the reserve always has room for a checkpoint on a full disk.
            async with connection.execute("PRAGMA page_size") as cursor:
                row = await cursor.fetchone()
            page_size = int(row[0]) if row else 4096
            journal = max(self._reserve_bytes // 2, 64 * page_size)
            await connection.execute(f"PRAGMA wal_autocheckpoint = {journal // page_size}")
            await connection.execute(f"PRAGMA journal_size_limit = {journal}")
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

    async def write(self, steps: Sequence[Step], *, frees: bool = False) -> list[int]:
        connection = self._open_connection()
        async with self._write_lock:
            try:
                return await self._transaction(connection, steps)
            except sqlite3.OperationalError as exc:
                if not frees or exc.sqlite_errorcode != sqlite3.SQLITE_FULL:
                    raise
                if not await asyncio.to_thread(self._give_reserve_back):
                    raise
            changed = await self._transaction(connection, steps)
            with contextlib.suppress(sqlite3.Error):
                await connection.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            await asyncio.to_thread(self._take_reserve)
            return changed

    @staticmethod
    async def _transaction(connection: aiosqlite.Connection, steps: Sequence[Step]) -> list[int]:
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

    def _take_reserve(self) -> None:
        """Allocate the reserve when it is missing (nothing when the disk has no room)."""
        if self._reserve_bytes <= 0 or self._reserve.exists():
            return
        partial = self._reserve.with_name(self._reserve.name + ".tmp")
        try:
            with partial.open("wb") as file:
                os.posix_fallocate(file.fileno(), 0, self._reserve_bytes)
            partial.replace(self._reserve)
        except OSError:
            partial.unlink(missing_ok=True)

    def _give_reserve_back(self) -> bool:
        """Free the reserve for a delete on a full disk; False when there is none."""
        try:
            self._reserve.unlink()
        except FileNotFoundError:
            return False
        return True

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
