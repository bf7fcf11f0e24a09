"""Scoped tables: rows that belong to one scope (one API key), with a time to live, byte caps,
counts (for a cap on their number, `count`) and fair per-scope eviction, declared once per
table (`ScopedTable`) and shared by every store-backed object (responses, conversations,
files, batches).

A row is read only in its own scope (a row of another scope does not exist), and only while
it is younger than the time to live (its `age` column: creation, or last change). `evict()`
deletes the expired rows, then, for a table under the byte caps (`capped`), each scope's oldest
while the scope holds more than its cap, so one key's traffic never evicts another's; the whole
table's cap is a backstop that evicts fairly (`fairness.fair_level`), from the scopes holding
the most. A row's parts (`children`) go with it, in the same transaction.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from deepinfer_server.store.database import Database, Step
from deepinfer_server.store.fairness import fair_level

#: Parameters of a statement (the store's `?` placeholders).
Params = tuple[Any, ...]


@dataclass(frozen=True)
class Caps:
    """The byte caps of a table's rows: `max_bytes` for all of them (the backstop),
    `scope_max_bytes` for one scope's."""

    max_bytes: int
    scope_max_bytes: int


@dataclass(frozen=True)
class ScopedTable:
    """A table of rows owned by a scope: `id` and `scope` columns, and `age` (what the time to
    live counts from); `size`: the column of each row's bytes (None: no byte caps);
    `children`: (table, column of the row's ID) of its parts; `cleanup`: statements run after
    a delete (what no row refers to any more); `evictable`: a condition a row must meet to be
    evicted at all (with `evictable_params`); `capped`: the store's byte caps apply to it (its
    `size` counted per scope), else only its time to live."""

    name: str
    age: str = "created_at"
    size: str | None = "bytes"
    capped: bool = False
    children: tuple[tuple[str, str], ...] = ()
    cleanup: tuple[str, ...] = ()
    evictable: str | None = None
    evictable_params: Params = ()

    def live(self, row_id: str, scope: str, oldest: float) -> tuple[str, Params]:
        """The condition (and its parameters) of one row of `scope` still alive."""
        return f"id = ? AND scope = ? AND {self.age} >= ?", (row_id, scope, oldest)

    def older_than(
        self, moment: float, last: str | None = None, scope: str | None = None
    ) -> tuple[str, Params]:
        """The condition of the rows older than `moment` (and, with `last`, those of that age
        whose ID sorts up to `last`), of one scope or of all, and not kept (`evictable`)."""
        where = f"{self.age} < ?"
        params: Params = (moment,)
        if last is not None:
            where += f" OR ({self.age} = ? AND id <= ?)"
            params = (moment, moment, last)
        if scope is not None:
            where = f"scope = ? AND ({where})"
            params = (scope, *params)
        if self.evictable is not None:
            where = f"({where}) AND {self.evictable}"
            params = (*params, *self.evictable_params)
        return where, params

    def delete_steps(self, where: str, params: Sequence[Any]) -> list[Step]:
        """The statements that delete the rows matching `where`, their parts, then what no row
        refers to any more; the count of rows deleted is the step at `len(children)`."""
        return [
            *(
                Step(
                    f"DELETE FROM {child} WHERE {column} IN (SELECT id FROM {self.name} "
                    f"WHERE {where})",
                    params,
                )
                for child, column in self.children
            ),
            Step(f"DELETE FROM {self.name} WHERE {where}", params),
            *(Step(statement) for statement in self.cleanup),
        ]

    async def delete(self, db: Database, where: str, params: Sequence[Any]) -> int:
        """Delete the rows matching `where` with their parts (one transaction); how many."""
        changed = await db.write(self.delete_steps(where, params), frees=True)
        return changed[len(self.children)]

    def page(self, scope: str, after: str | None, limit: int) -> tuple[str, Params]:
        """The end of a query of `scope`'s rows (after its conditions): a page of `limit` rows
        past the row `after` (from the first without it), newest first."""
        order = f" ORDER BY {self.age} DESC, id DESC LIMIT ?"
        if after is None:
            return order, (limit,)
        return (
            f" AND ({self.age}, id) < (SELECT {self.age}, id FROM {self.name} "
            f"WHERE id = ? AND scope = ?){order}",
            (after, scope, limit),
        )

    async def count(
        self, db: Database, scope: str, where: str = "1 = 1", params: Sequence[Any] = ()
    ) -> int:
        """How many rows of `scope` match `where` (for a cap on their number)."""
        rows = await db.fetch(
            f"SELECT COUNT(*) FROM {self.name} WHERE scope = ? AND {where}", (scope, *params)
        )
        return int(rows[0][0])

    async def evict(self, db: Database, oldest: float, caps: Caps | None = None) -> int:
        """Delete the rows older than `oldest`, then, with `caps` (and a `size` column), each
        scope's oldest while it exceeds its cap (module docstring); how many were deleted."""
        deleted = await self.delete(db, *self.older_than(oldest))
        if caps is None or self.size is None:
            return deleted
        rows = await db.fetch(f"SELECT scope, SUM({self.size}) FROM {self.name} GROUP BY scope")
        usage = {str(scope): int(size) for scope, size in rows}
        level = min(caps.scope_max_bytes, fair_level(usage, caps.max_bytes))
        for scope in sorted(scope for scope, size in usage.items() if size > level):
            cutoff = await db.fetch(self._size_cutoff(), (scope, level))
            if cutoff:
                moment, last = cutoff[0]
                deleted += await self.delete(db, *self.older_than(float(moment), str(last), scope))
        return deleted

    def _size_cutoff(self) -> str:
        """The newest row of a scope past which its bytes exceed a cap (it and older ones go)."""
        order = f"{self.age} DESC, id DESC"
        return (
            f"SELECT {self.age}, id FROM (SELECT {self.age}, id, SUM({self.size}) OVER "
            f"(ORDER BY {order}) AS newer FROM {self.name} WHERE scope = ?) AS ranked "
            f"WHERE newer > ? ORDER BY {order} LIMIT 1"
        )
