"""BatchLines: a batch's lines as processes answer them (table `batch_lines` in
`batch_tables.py`), the same on SQLite and PostgreSQL.

A batch's lines are claimed a few at a time by the process that runs them, with a lease it
renews (`renew`; `lease.Lease`); a line whose lease ended (its process died) is claimed again by
any process. Claiming is one `UPDATE ... WHERE` that re-checks the line is free, so two
processes (or replicas on PostgreSQL, whose UPDATE re-reads a row another transaction changed)
never hold one line at once, and a result is written only by the claim that holds it, so every
line is answered once. A line whose answer wrote to the store (a Responses line) wrote it with
a mark of the line (`batch_effects.py`): claimed again, it is recorded from that mark
(`effect`), not answered again.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence

import orjson

from deepinfer_server.store.batch_records import PENDING, ClaimedLine, LineResult, NewLine
from deepinfer_server.store.batch_tables import LINE_LEASE
from deepinfer_server.store.database import Step
from deepinfer_server.store.decoding import off_loop_if_large
from deepinfer_server.store.lease import LEASE
from deepinfer_server.store.records import JsonObject
from deepinfer_server.store.root import Operations

#: The condition that a batch's bytes are counted in its key's quota (`quota.py`): what is
#: stored of it then (its row, its lines) is stored only with them.
COUNTED = "EXISTS (SELECT 1 FROM batch_bytes WHERE batch_id = ?)"


class BatchLines(Operations):
    """The lines of the batches of every process (and replica) sharing the store's database."""

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
        """A claimed line's answer, its bytes counted in its batch's (`quota.py`: always
        stored); False (nothing written) when the claim no longer holds it."""
        text = orjson.dumps(result).decode()
        held = (line.batch_id, line.line, line.claim, PENDING)
        async with self._store.connection("record a batch line", write=True):
            changed = await self._db.write(
                [
                    Step(
                        "UPDATE batch_bytes SET bytes = bytes + ? WHERE batch_id = ? AND EXISTS "
                        "(SELECT 1 FROM batch_lines WHERE batch_id = ? AND line = ? AND "
                        "claim = ? AND status = ?)",
                        (len(text.encode()), line.batch_id, *held),
                    ),
                    Step(
                        f"UPDATE batch_lines SET status = ?, result = ?, {LINE_LEASE.release()} "
                        "WHERE batch_id = ? AND line = ? AND claim = ? AND status = ?",
                        (status, text, *held),
                    ),
                ]
            )
        return changed[1] > 0

    async def effect(self, batch_id: str, line: int) -> JsonObject | None:
        """The body a line's answer stored with its writes (`batch_effects.py`), or None: no
        answer of the line wrote to the store."""
        async with self._store.connection("read batch lines"):
            rows = await self._db.fetch(
                "SELECT body FROM batch_line_effects WHERE batch_id = ? AND line = ?",
                (batch_id, line),
            )
        return orjson.loads(rows[0][0]) if rows else None

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

        def decoded() -> list[LineResult]:
            return [
                LineResult(
                    int(r[0]), str(r[1]), str(r[2]), None if r[3] is None else orjson.loads(r[3])
                )
                for r in rows
            ]

        # A batch's results together may be many megabytes: decoded off the loop then.
        return await off_loop_if_large(sum(len(r[3] or "") for r in rows), decoded)


def insert_lines(batch_id: str, lines: Sequence[NewLine]) -> tuple[list[Step], int]:
    """The statements that store a new batch's lines (none without lines), each only once the
    batch's bytes are counted (`COUNTED`), and those bytes (its requests' and results')."""
    if not lines:
        return [], 0
    rows = [
        (
            batch_id,
            index,
            line.custom_id,
            json_or_none(line.body),
            line.status,
            json_or_none(line.result),
            batch_id,
        )
        for index, line in enumerate(lines)
    ]
    size = sum(sum(len(value.encode()) for value in row[2:6] if value is not None) for row in rows)
    step = Step(
        "INSERT INTO batch_lines (batch_id, line, custom_id, body, status, result) "
        f"SELECT ?, ?, ?, ?, ?, ? WHERE {COUNTED}",
        rows,
        many=True,
    )
    return [step], size


def json_or_none(value: JsonObject | None) -> str | None:
    """A JSON object as text to store (None stays None)."""
    return None if value is None else orjson.dumps(value).decode()
