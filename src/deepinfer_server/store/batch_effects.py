"""LineEffects: what a batch line's answer writes to the store, written once.

A Responses line may write to the store as it is answered: its stored response, its turn
appended to a conversation. Those writes and a row of `batch_line_effects` (the line's batch
and number, under a primary key, with the body answered) are one transaction. So a line
answered twice (its process was killed after the writes and before its result was recorded,
and the line was claimed again once its lease ended; or its lease ended while it still ran)
cannot write twice: the second transaction fails on the key and writes nothing
(`LineAnswered`), and the runner records the body already answered
(`batch_lines.BatchLines.effect`) instead of generating it again. The same on SQLite and
PostgreSQL, whichever process or replica answers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import orjson

from deepinfer_server.errors import StoreUnavailableError
from deepinfer_server.store.database import Step
from deepinfer_server.store.records import JsonObject
from deepinfer_server.store.root import Operations


@dataclass(frozen=True)
class LineIdentity:
    """A batch line: its batch and its number."""

    batch_id: str
    line: int


class LineAnswered(StoreUnavailableError):
    """The line's writes are in the store already (another answer of it wrote them first):
    this answer wrote nothing. A 503, so the runner gives the line back, and records the
    answer stored when it claims the line again."""

    def __init__(self, identity: LineIdentity) -> None:
        super().__init__(
            f"batch {identity.batch_id} line {identity.line} was answered already; "
            "this answer is not stored"
        )


class LineEffects(Operations):
    """The writes of the batch lines' answers (module docstring)."""

    async def commit(
        self, identity: LineIdentity, body: JsonObject, steps: Sequence[Step]
    ) -> list[int]:
        """Run `steps` (the line's writes) with the row that marks the line answered with
        `body`, in one transaction; the rows each of `steps` changed. LineAnswered, with
        nothing written, when the line's writes are stored already."""
        text = orjson.dumps(body).decode()
        mark = Step(
            "INSERT INTO batch_line_effects (batch_id, line, body) VALUES (?, ?, ?)",
            (identity.batch_id, identity.line, text),
        )
        # The mark's bytes count in its batch's (`quota.py`), with the mark or not at all.
        counted = Step(
            "UPDATE batch_bytes SET bytes = bytes + ? WHERE batch_id = ?",
            (len(text.encode()), identity.batch_id),
        )
        async with self._store.connection("store a batch line's answer", write=True) as db:
            try:
                changed = await db.write([mark, counted, *steps])
            except db.errors:
                # The key's violation is the backend's own error: told apart from a failure
                # by the row that caused it.
                if await self._answered(identity):
                    raise LineAnswered(identity) from None
                raise
        return changed[2:]

    async def _answered(self, identity: LineIdentity) -> bool:
        rows = await self._db.fetch(
            "SELECT 1 FROM batch_line_effects WHERE batch_id = ? AND line = ?",
            (identity.batch_id, identity.line),
        )
        return bool(rows)
