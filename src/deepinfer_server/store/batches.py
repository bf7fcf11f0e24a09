"""BatchStore: the queries of batch jobs (tables in `batch_tables.py`), on the Responses
store's database, the same on SQLite and PostgreSQL.

Files and batches are scoped like stored responses: a row read in another scope does not
exist. A batch's lines are claimed a few at a time by the process that runs them, with a lease
it renews (`renew`); a line whose lease ended (its process died) is claimed again by any
process. Claiming is one `UPDATE ... WHERE` that re-checks the line is free, so two processes
(or replicas on PostgreSQL, whose UPDATE re-reads a row another transaction changed) never hold
one line at once, and a result is written only by the claim that holds it, so every line is
answered once.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from deepinfer_server.store.batch_tables import ACTIVE_STATUSES, BATCHES, FILES, LINE_LEASE
from deepinfer_server.store.database import Step
from deepinfer_server.store.lease import LEASE
from deepinfer_server.store.records import JsonObject
from deepinfer_server.store.root import StoreRoot
from deepinfer_server.store.scoped import evict_periodically

#: The statuses whose time the `batches` table keeps (`<status>_at`).
_TIMED = frozenset(
    {"in_progress", "finalizing", "completed", "failed", "expired", "cancelling", "cancelled"}
)
#: A line not answered yet.
PENDING = "pending"


@dataclass(frozen=True)
class FileRow:
    """A stored file, without its content."""

    id: str
    created_at: float
    purpose: str
    filename: str
    bytes: int


@dataclass(frozen=True)
class NewLine:
    """One request of a new batch: its body, or (a malformed line) its result already."""

    custom_id: str
    body: dict[str, Any] | None
    status: str = PENDING
    result: dict[str, Any] | None = None


@dataclass(frozen=True)
class BatchRow:
    """A stored batch, with its lines counted by status."""

    id: str
    scope: str
    kind: str
    created_at: float
    expires_at: float
    endpoint: str
    input_file_id: str | None
    metadata: dict[str, Any] | None
    status: str
    #: The time it reached each status it went through (`<status>` → seconds).
    times: dict[str, float]
    output_file_id: str | None
    error_file_id: str | None
    #: Its lines by status (`pending`, `succeeded`, `errored`, `canceled`, `expired`).
    counts: dict[str, int]


@dataclass(frozen=True)
class ClaimedLine:
    """A line a process holds: answer it, then `record` with its claim."""

    batch_id: str
    line: int
    custom_id: str
    body: dict[str, Any]
    claim: str


@dataclass(frozen=True)
class LineResult:
    """A line as it ended (or `pending`, not answered)."""

    line: int
    custom_id: str
    status: str
    result: dict[str, Any] | None


_BATCH_COLUMNS = (
    "id, scope, kind, created_at, expires_at, endpoint, input_file_id, metadata, status, "
    + ", ".join(f"{status}_at" for status in sorted(_TIMED))
    + ", output_file_id, error_file_id"
)


class BatchStore:
    """The batch jobs of every process (and replica) sharing the Responses store's database."""

    def __init__(self, store: StoreRoot) -> None:
        self._store = store
        self._db = store.database

    async def scope_salt(self) -> bytes:
        """The salt of the store's scope hashes."""
        return await self._store.scope_salt()

    # Files.

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
            await self._db.write([self._file_step(scope, row, content)])
        return row

    @staticmethod
    def _file_step(scope: str, row: FileRow, content: str) -> Step:
        return Step(
            "INSERT INTO files (id, scope, created_at, purpose, filename, bytes, content) "
            "VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (id) DO NOTHING",
            (row.id, scope, row.created_at, row.purpose, row.filename, row.bytes, content),
        )

    async def files(
        self, scope: str, purpose: str | None, after: str | None, limit: int
    ) -> list[FileRow]:
        """A scope's files, newest first, past the file `after` (a page of `limit`)."""
        sql = "SELECT id, created_at, purpose, filename, bytes FROM files WHERE scope = ?"
        params: list[Any] = [scope]
        if purpose is not None:
            sql += " AND purpose = ?"
            params.append(purpose)
        page, past = FILES.after(scope, after)
        sql += page
        params += past
        sql += " ORDER BY created_at DESC, id DESC LIMIT ?"
        params.append(limit)
        async with self._store.connection("list files"):
            rows = await self._db.fetch(sql, params)
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

    # Batches.

    async def active_count(self, scope: str) -> int:
        """How many of a scope's batches are still at work."""
        async with self._store.connection("count batches"):
            rows = await self._db.fetch(
                "SELECT COUNT(*) FROM batches WHERE scope = ? AND status IN (?, ?, ?, ?)",
                (scope, *ACTIVE_STATUSES),
            )
        return int(rows[0][0])

    async def add_batch(
        self,
        scope: str,
        kind: str,
        endpoint: str,
        input_file_id: str | None,
        metadata: dict[str, Any] | None,
        window: float,
        lines: Sequence[NewLine],
        batch_id: str,
    ) -> None:
        """Store a new batch (`validating`) and its lines, in one transaction."""
        now = time.time()
        steps = [
            Step(
                "INSERT INTO batches (id, scope, kind, created_at, expires_at, endpoint, "
                "input_file_id, metadata, status) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    batch_id,
                    scope,
                    kind,
                    now,
                    now + window,
                    endpoint,
                    input_file_id,
                    None if metadata is None else orjson.dumps(metadata).decode(),
                    "validating",
                ),
            )
        ]
        if lines:
            steps.append(
                Step(
                    "INSERT INTO batch_lines (batch_id, line, custom_id, body, status, result) "
                    "VALUES (?, ?, ?, ?, ?, ?)",
                    [
                        (
                            batch_id,
                            index,
                            line.custom_id,
                            None if line.body is None else orjson.dumps(line.body).decode(),
                            line.status,
                            None if line.result is None else orjson.dumps(line.result).decode(),
                        )
                        for index, line in enumerate(lines)
                    ],
                    many=True,
                )
            )
        async with self._store.connection("store a batch", write=True):
            await self._db.write(steps)

    async def batch(self, scope: str | None, batch_id: str) -> BatchRow | None:
        """A batch of `scope` (None: of any scope, for the runner), or None."""
        sql = f"SELECT {_BATCH_COLUMNS} FROM batches WHERE id = ?"
        params: list[Any] = [batch_id]
        if scope is not None:
            sql += " AND scope = ?"
            params.append(scope)
        async with self._store.connection("read a batch"):
            rows = await self._db.fetch(sql, params)
            if not rows:
                return None
            counts = await self._counts([batch_id])
        return _batch_row(rows[0], counts.get(batch_id, {}))

    async def batches(self, scope: str, kind: str, after: str | None, limit: int) -> list[BatchRow]:
        """A scope's batches of `kind`, newest first, past the batch `after`."""
        sql = f"SELECT {_BATCH_COLUMNS} FROM batches WHERE scope = ? AND kind = ?"
        params: list[Any] = [scope, kind]
        page, past = BATCHES.after(scope, after)
        sql += page
        params += past
        sql += " ORDER BY created_at DESC, id DESC LIMIT ?"
        params.append(limit)
        async with self._store.connection("list batches"):
            rows = await self._db.fetch(sql, params)
            counts = await self._counts([row[0] for row in rows])
        return [_batch_row(row, counts.get(row[0], {})) for row in rows]

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
        column = f", {status}_at = ?" if status in _TIMED else ""
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
                [
                    Step(
                        "DELETE FROM batch_lines WHERE batch_id IN (SELECT id FROM batches "
                        "WHERE id = ? AND scope = ?)",
                        (batch_id, scope),
                    ),
                    Step("DELETE FROM batches WHERE id = ? AND scope = ?", (batch_id, scope)),
                ],
                frees=True,
            )
        return changed[-1] > 0

    # Lines.

    async def claim(
        self, batch_id: str, owner: str, limit: int, lease: float = LEASE
    ) -> list[ClaimedLine]:
        """Claim up to `limit` unanswered lines nobody holds (or whose lease ended) for
        `owner` until `lease` seconds from now; the lines claimed."""
        now = time.time()
        claim = uuid.uuid4().hex
        assign, values = LINE_LEASE.take(owner, LINE_LEASE.stamp(now, lease))
        free, cutoff = LINE_LEASE.free(LINE_LEASE.cutoff(now, lease))
        async with self._store.connection("claim batch lines", write=True):
            await self._db.write(
                [
                    Step(
                        f"UPDATE batch_lines SET {assign}, claim = ? "
                        f"WHERE batch_id = ? AND status = ? AND {free} AND line IN ("
                        "SELECT line FROM batch_lines WHERE batch_id = ? AND status = ? "
                        f"AND {free} ORDER BY line LIMIT ?)",
                        (
                            *values,
                            claim,
                            batch_id,
                            PENDING,
                            *cutoff,
                            batch_id,
                            PENDING,
                            *cutoff,
                            limit,
                        ),
                    )
                ]
            )
            rows = await self._db.fetch(
                "SELECT line, custom_id, body FROM batch_lines WHERE batch_id = ? AND claim = ? "
                "AND status = ? ORDER BY line",
                (batch_id, claim, PENDING),
            )
        return [
            ClaimedLine(batch_id, int(row[0]), str(row[1]), orjson.loads(row[2]), claim)
            for row in rows
        ]

    async def renew(self, lines: Sequence[ClaimedLine], lease: float = LEASE) -> None:
        """The process holding `lines` still works on them: their lease ends `lease` from now
        (a line its process no longer runs is left to its lease: it is claimed again)."""
        if not lines:
            return
        assign, values = LINE_LEASE.renew(LINE_LEASE.stamp(time.time(), lease))
        async with self._store.connection("renew batch lines", write=True):
            await self._db.write(
                [
                    Step(
                        f"UPDATE batch_lines SET {assign} WHERE claim IN ("
                        + ", ".join("?" * len(lines))
                        + ") AND status = ?",
                        (*values, *(line.claim for line in lines), PENDING),
                    )
                ]
            )

    async def release(self, line: ClaimedLine) -> None:
        """Give a claimed line back unanswered (it is claimed again later)."""
        async with self._store.connection("release a batch line", write=True):
            await self._db.write(
                [
                    Step(
                        f"UPDATE batch_lines SET {LINE_LEASE.release()}, claim = NULL "
                        "WHERE batch_id = ? AND line = ? AND claim = ?",
                        (line.batch_id, line.line, line.claim),
                    )
                ]
            )

    async def record(self, line: ClaimedLine, status: str, result: JsonObject) -> bool:
        """A claimed line's answer; False (nothing written) when the claim no longer holds it."""
        async with self._store.connection("record a batch line", write=True):
            changed = await self._db.write(
                [
                    Step(
                        f"UPDATE batch_lines SET status = ?, result = ?, {LINE_LEASE.release()} "
                        "WHERE batch_id = ? AND line = ? AND claim = ? AND status = ?",
                        (
                            status,
                            orjson.dumps(result).decode(),
                            line.batch_id,
                            line.line,
                            line.claim,
                            PENDING,
                        ),
                    )
                ]
            )
        return changed[0] > 0

    async def held(self, batch_id: str) -> int:
        """How many of a batch's unanswered lines some process holds under a live lease."""
        live, cutoff = LINE_LEASE.live(LINE_LEASE.cutoff(time.time()))
        async with self._store.connection("read batch lines"):
            rows = await self._db.fetch(
                f"SELECT COUNT(*) FROM batch_lines WHERE batch_id = ? AND status = ? AND {live}",
                (batch_id, PENDING, *cutoff),
            )
        return int(rows[0][0])

    async def results(self, batch_id: str) -> list[LineResult]:
        """Every line of a batch, in order."""
        async with self._store.connection("read batch lines"):
            rows = await self._db.fetch(
                "SELECT line, custom_id, status, result FROM batch_lines WHERE batch_id = ? "
                "ORDER BY line",
                (batch_id,),
            )
        return [
            LineResult(
                int(r[0]), str(r[1]), str(r[2]), None if r[3] is None else orjson.loads(r[3])
            )
            for r in rows
        ]

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
        steps = [self._file_step(batch.scope, row, content) for row, content in files]
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
            return await BATCHES.evict(db, before) + await FILES.evict(db, before)

    async def evict_periodically(self, interval: float) -> None:
        """`evict()` past the store's time to live every `interval` seconds, until cancelled
        (a failure is logged and tried again next time)."""
        await evict_periodically(lambda: self.evict(time.time() - self._store.ttl), interval)


def _batch_row(row: Sequence[Any], counts: dict[str, int]) -> BatchRow:
    timed = sorted(_TIMED)
    times = {
        status: float(value)
        for status, value in zip(timed, row[9 : 9 + len(timed)], strict=True)
        if value is not None
    }
    return BatchRow(
        id=str(row[0]),
        scope=str(row[1]),
        kind=str(row[2]),
        created_at=float(row[3]),
        expires_at=float(row[4]),
        endpoint=str(row[5]),
        input_file_id=row[6],
        metadata=None if row[7] is None else orjson.loads(row[7]),
        status=str(row[8]),
        times=times,
        output_file_id=row[9 + len(timed)],
        error_file_id=row[10 + len(timed)],
        counts=counts,
    )
