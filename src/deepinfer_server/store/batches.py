"""BatchStore: batch jobs (OpenAI's Batches, Anthropic's Message Batches) on the store's
database (tables in `batch_tables.py`), the same on SQLite and PostgreSQL, with their files
(`files.py`) and lines (`batch_lines.py`).

Files and batches are scoped like stored responses: a row read in another scope does not
exist. They live for the store's time to live (a batch still at work whatever its age). A
batch's bytes count against its key's store quota with its files (`quota.py`): a batch that
would pass it is not stored (`add_batch`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

from deepinfer_server.store.batch_lines import COUNTED, BatchLines, insert_lines, json_or_none
from deepinfer_server.store.batch_records import (
    BATCH_COLUMNS,
    PENDING,
    TIMED,
    BatchRow,
    ClaimedLine,
    FileRow,
    LineResult,
    NewLine,
    batch_row,
)
from deepinfer_server.store.batch_tables import ACTIVE_STATUSES, BATCHES
from deepinfer_server.store.database import Step
from deepinfer_server.store.files import FileStore, file_step
from deepinfer_server.store.quota import SERIALIZE, fits
from deepinfer_server.store.records import JsonObject

__all__ = [
    "PENDING",
    "BatchRow",
    "BatchStore",
    "ClaimedLine",
    "FileRow",
    "LineResult",
    "NewLine",
]


class BatchStore(FileStore, BatchLines):
    """The batch jobs of every process (and replica) sharing the store's database: their
    files, batches and lines."""

    async def scope_salt(self) -> bytes:
        """The salt of the store's scope hashes."""
        return await self._store.scope_salt()

    async def active_count(self, scope: str) -> int:
        """How many of a scope's batches are still at work."""
        async with self._store.connection("count batches") as db:
            return await BATCHES.count(db, scope, "status IN (?, ?, ?, ?)", ACTIVE_STATUSES)

    async def add_batch(
        self,
        scope: str,
        kind: str,
        endpoint: str,
        input_file_id: str | None,
        metadata: JsonObject | None,
        window: float,
        lines: Sequence[NewLine],
        batch_id: str,
    ) -> bool:
        """Store a new batch (`validating`) and its lines, in one transaction, if its bytes
        fit in `scope`'s store quota (`quota.py`); whether it did (nothing is written when
        they do not)."""
        now = time.time()
        # Up to --batch-max-lines bodies to encode: off the event loop.
        stored, size = await asyncio.to_thread(insert_lines, batch_id, lines)
        condition, params = fits(scope, size, self._store.caps)
        steps = [
            SERIALIZE,
            Step(
                "INSERT INTO batch_bytes (batch_id, scope, bytes) "
                f"SELECT ?, ?, ? WHERE {condition}",
                (batch_id, scope, size, *params),
            ),
            Step(
                "INSERT INTO batches (id, scope, kind, created_at, expires_at, endpoint, "
                "input_file_id, metadata, status) SELECT ?, ?, ?, ?, ?, ?, ?, ?, ? "
                f"WHERE {COUNTED}",
                (
                    batch_id,
                    scope,
                    kind,
                    now,
                    now + window,
                    endpoint,
                    input_file_id,
                    json_or_none(metadata),
                    "validating",
                    batch_id,
                ),
            ),
            *stored,
        ]
        async with self._store.connection("store a batch", write=True):
            changed = await self._db.write(steps)
        return changed[1] > 0

    async def batch(self, scope: str | None, batch_id: str) -> BatchRow | None:
        """A batch of `scope` (None: of any scope, for the runner), or None."""
        sql = f"SELECT {BATCH_COLUMNS} FROM batches WHERE id = ?"
        params: list[Any] = [batch_id]
        if scope is not None:
            sql += " AND scope = ?"
            params.append(scope)
        async with self._store.connection("read a batch"):
            rows = await self._db.fetch(sql, params)
            if not rows:
                return None
            counts = await self._counts([batch_id])
        return batch_row(rows[0], counts.get(batch_id, {}))

    async def batches(self, scope: str, kind: str, after: str | None, limit: int) -> list[BatchRow]:
        """A scope's batches of `kind`, newest first, past the batch `after`."""
        sql = f"SELECT {BATCH_COLUMNS} FROM batches WHERE scope = ? AND kind = ?"
        page, past = BATCHES.page(scope, after, limit)
        async with self._store.connection("list batches"):
            rows = await self._db.fetch(sql + page, (scope, kind, *past))
            counts = await self._counts([row[0] for row in rows])
        return [batch_row(row, counts.get(row[0], {})) for row in rows]

    async def _counts(self, batch_ids: Sequence[str]) -> dict[str, dict[str, int]]:
        if not batch_ids:
            return {}
        rows = await self._db.fetch(
            "SELECT batch_id, status, COUNT(*) FROM batch_lines WHERE batch_id IN ("
            + ", ".join("?" * len(batch_ids))
            + ") GROUP BY batch_id, status",
            list(batch_ids),
        )
        found: dict[str, dict[str, int]] = {}
        for batch_id, status, count in rows:
            found.setdefault(batch_id, {})[status] = int(count)
        return found

    async def active_batches(self) -> list[tuple[str, str]]:
        """Every batch still at work, of every scope: (ID, status), oldest first."""
        async with self._store.connection("list batches"):
            rows = await self._db.fetch(
                "SELECT id, status FROM batches WHERE status IN (?, ?, ?, ?) "
                "ORDER BY created_at, id",
                ACTIVE_STATUSES,
            )
        return [(str(row[0]), str(row[1])) for row in rows]

    async def move(self, batch_id: str, status: str, *, sources: Sequence[str]) -> bool:
        """Set a batch's status (and its time) if it is in one of `sources`; whether it was."""
        column = f", {status}_at = ?" if status in TIMED else ""
        params: list[Any] = [status]
        if column:
            params.append(time.time())
        async with self._store.connection("update a batch", write=True):
            changed = await self._db.write(
                [
                    Step(
                        f"UPDATE batches SET status = ?{column} WHERE id = ? AND status IN ("
                        + ", ".join("?" * len(sources))
                        + ")",
                        (*params, batch_id, *sources),
                    )
                ]
            )
        return changed[0] > 0

    async def delete_batch(self, scope: str, batch_id: str) -> bool:
        """Delete a finished batch and its lines; whether it was there."""
        async with self._store.connection("delete a batch", write=True):
            changed = await self._db.write(
                BATCHES.delete_steps("id = ? AND scope = ?", (batch_id, scope)), frees=True
            )
        return changed[len(BATCHES.children)] > 0

    async def finish(
        self,
        batch: BatchRow,
        status: str,
        files: Sequence[tuple[FileRow, str]],
        output_file_id: str | None,
        error_file_id: str | None,
    ) -> bool:
        """End a batch (from `finalizing` or `cancelling`) with its output files, in one
        transaction; whether this call ended it (another process may have first)."""
        steps = [file_step(batch.scope, row, content) for row, content in files]
        steps.append(
            Step(
                f"UPDATE batches SET status = ?, {status}_at = ?, output_file_id = ?, "
                "error_file_id = ? WHERE id = ? AND status IN (?, ?)",
                (
                    status,
                    time.time(),
                    output_file_id,
                    error_file_id,
                    batch.id,
                    "finalizing",
                    "cancelling",
                ),
            )
        )
        async with self._store.connection("finish a batch", write=True):
            changed = await self._db.write(steps)
        return changed[-1] > 0

    async def evict(self, before: float) -> int:
        """Delete the files and the ended batches (with their lines) created before `before`
        (the store's time to live); the number of rows deleted. A batch still at work is kept
        whatever its age (its completion window ends it)."""
        async with self._store.connection("evict old batches", write=True) as db:
            batches = await BATCHES.evict(db, before)
        return batches + await self.evict_files(before)
