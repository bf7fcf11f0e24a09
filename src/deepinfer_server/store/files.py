"""FileStore: OpenAI's Files (uploads, and batches' output and error files), on the store's
database (table `files` in `batch_tables.py`, a scoped table: `FILES`), the same on SQLite and
PostgreSQL.

Uploads count against the store's quota (`quota.py`: one API key's files and batches' data at
most `scope_max_bytes`, every key's at most `max_bytes`), and a key's files against its count
cap (`StoreRoot.scope_max_files`), but are never evicted to make room (a batch may be reading
its input file): an upload that would pass a cap is refused instead (`upload_file`), checked in
the transaction that stores it. Batches' output and error files count too, and are always
stored (the work is done)."""

from __future__ import annotations

import time
import uuid
from typing import Any

from deepinfer_server.store.batch_records import FileRow
from deepinfer_server.store.batch_tables import FILES
from deepinfer_server.store.database import Step
from deepinfer_server.store.quota import SERIALIZE, USAGE, fits, room
from deepinfer_server.store.root import Operations


class FileStore(Operations):
    """The files of every process (and replica) sharing the store's database."""

    async def add_file(
        self, scope: str, purpose: str, filename: str, content: str, file_id: str | None = None
    ) -> FileRow:
        """Store a file; the row stored (a batch's output file has the ID given, stored once)."""
        row = FileRow(
            file_id or f"file-{uuid.uuid4().hex}",
            time.time(),
            purpose,
            filename,
            len(content.encode()),
        )
        async with self._store.connection("store a file", write=True):
            await self._db.write([file_step(scope, row, content)])
        return row

    async def quota_room(self, scope: str) -> int:
        """How many more bytes of files and batches' data `scope` may store under the caps."""
        async with self._store.connection("read the store's usage"):
            rows = await self._db.fetch(USAGE, (scope, scope))
        mine, every = (int(value) for value in rows[0])
        return room(self._store.caps, mine, every)

    async def upload_room(self, scope: str) -> int:
        """How many more bytes of files `scope` may upload under the caps (0 when full, or
        when it holds as many files as it may)."""
        async with self._store.connection("read the files' sizes"):
            rows = await self._db.fetch(
                f"{USAGE}, (SELECT COUNT(*) FROM files WHERE scope = ?)", (scope, scope, scope)
            )
        mine, every, count = (int(value) for value in rows[0])
        if count >= self._store.scope_max_files:
            return 0
        return room(self._store.caps, mine, every)

    async def upload_file(
        self, scope: str, purpose: str, filename: str, content: str, size: int | None = None
    ) -> FileRow | None:
        """Store an uploaded file if it fits under the caps (module docstring): the row
        stored, or None (nothing written) when it would pass one. `size`: the content's
        bytes in UTF-8 when the caller has them (else it is encoded again to count them)."""
        if size is None:
            size = len(content.encode())
        row = FileRow(f"file-{uuid.uuid4().hex}", time.time(), purpose, filename, size)
        condition, params = fits(scope, row.bytes, self._store.caps)
        step = Step(
            "INSERT INTO files (id, scope, created_at, purpose, filename, bytes, content) "
            f"SELECT ?, ?, ?, ?, ?, ?, ? WHERE {condition} AND "
            "(SELECT COUNT(*) FROM files WHERE scope = ?) < ?",
            (
                row.id,
                scope,
                row.created_at,
                purpose,
                filename,
                row.bytes,
                content,
                *params,
                scope,
                self._store.scope_max_files,
            ),
        )
        async with self._store.connection("store a file", write=True):
            changed = await self._db.write([SERIALIZE, step])
        return row if changed[1] > 0 else None

    async def files(
        self, scope: str, purpose: str | None, after: str | None, limit: int
    ) -> list[FileRow]:
        """A scope's files, newest first, past the file `after` (a page of `limit`)."""
        sql = "SELECT id, created_at, purpose, filename, bytes FROM files WHERE scope = ?"
        params: list[Any] = [scope]
        if purpose is not None:
            sql += " AND purpose = ?"
            params.append(purpose)
        page, past = FILES.page(scope, after, limit)
        async with self._store.connection("list files"):
            rows = await self._db.fetch(sql + page, (*params, *past))
        return [FileRow(r[0], float(r[1]), r[2], r[3], int(r[4])) for r in rows]

    async def file(self, scope: str, file_id: str) -> FileRow | None:
        """A file of `scope`, or None."""
        async with self._store.connection("read a file"):
            rows = await self._db.fetch(
                "SELECT id, created_at, purpose, filename, bytes FROM files "
                "WHERE id = ? AND scope = ?",
                (file_id, scope),
            )
        if not rows:
            return None
        row = rows[0]
        return FileRow(str(row[0]), float(row[1]), str(row[2]), str(row[3]), int(row[4]))

    async def file_content(self, scope: str, file_id: str) -> str | None:
        """A file's content, or None."""
        async with self._store.connection("read a file"):
            rows = await self._db.fetch(
                "SELECT content FROM files WHERE id = ? AND scope = ?", (file_id, scope)
            )
        return None if not rows else str(rows[0][0])

    async def delete_file(self, scope: str, file_id: str) -> bool:
        """Delete a file; whether it was there."""
        async with self._store.connection("delete a file", write=True):
            changed = await self._db.write(
                [Step("DELETE FROM files WHERE id = ? AND scope = ?", (file_id, scope))],
                frees=True,
            )
        return changed[0] > 0

    async def evict_files(self, before: float) -> int:
        """Delete the files created before `before`; how many."""
        async with self._store.connection("evict old files", write=True) as db:
            return await FILES.evict(db, before)


def file_step(scope: str, row: FileRow, content: str) -> Step:
    """The statement that stores a file (once: a second with its ID changes nothing)."""
    return Step(
        "INSERT INTO files (id, scope, created_at, purpose, filename, bytes, content) "
        "VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (id) DO NOTHING",
        (row.id, scope, row.created_at, row.purpose, row.filename, row.bytes, content),
    )
