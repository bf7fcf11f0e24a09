"""ResponseStore: the stored responses' reads, deletes and eviction, the same on SQLite and
PostgreSQL (tables in `response_tables.py`; writes in `response_rows.py` and
`background_runs.py`).

A conversation continued with `previous_response_id` is a chain of responses; its items are
read back by walking the chain (a recursive query), so no response repeats its ancestors'
items. Rows older than the time to live are never read and are deleted by `evict()`.

Sizes are kept per scope (one API key's responses): `evict()` deletes a scope's oldest responses
while that scope holds more than its cap, so one key's traffic never evicts another's; the whole
store's cap is a backstop that evicts fairly, from the scopes holding the most (each is cut down
to one common level, the largest at which the store fits).

Every write is one short transaction. Database failures surface as `StoreUnavailableError`
(503) for the request that needed the store, and nothing else.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import orjson

from deepinfer_server.store.background_runs import BackgroundRuns
from deepinfer_server.store.decoding import decode_all
from deepinfer_server.store.records import BrokenHistory, Item, ItemPage, StoredResponse
from deepinfer_server.store.response_tables import RESPONSES

#: The deepest `previous_response_id` chain read back (a guard; chains are acyclic).
MAX_CHAIN = 100_000

_CHAIN = """
WITH RECURSIVE chain(id, previous_response_id, depth) AS (
    SELECT id, previous_response_id, 0 FROM responses
        WHERE id = ? AND scope = ? AND created_at >= ?
    UNION ALL
    SELECT r.id, r.previous_response_id, chain.depth + 1
        FROM responses r JOIN chain ON r.id = chain.previous_response_id
        WHERE r.scope = ? AND r.created_at >= ? AND chain.depth < ?
)
SELECT id, previous_response_id, depth FROM chain ORDER BY depth DESC
"""


class ResponseStore(BackgroundRuns):
    """The stored responses of every API server process (and replica) that shares `database`,
    and the store's root (`root.StoreRoot`) the other stores share.

    Sizes count response objects and items as JSON. `ttl` (seconds): responses older than this
    are neither read nor kept; `max_bytes`: the whole store's cap; `scope_max_bytes`: one
    scope's cap (default: the whole store's); `response_max_bytes`: the largest response
    stored (default: a scope's cap). Past a cap, `evict()` deletes the oldest (module
    docstring).
    """

    async def response(self, scope: str, response_id: str) -> StoredResponse | None:
        """The response, or None when it is not stored for this scope (or expired)."""
        async with self._failures("read a response"):
            await self._prepare()
            rows = await self._db.fetch(
                "SELECT r.id, r.created_at, r.previous_response_id, r.body, b.heartbeat_at "
                "FROM responses r LEFT JOIN background_runs b ON b.response_id = r.id "
                "WHERE r.id = ? AND r.scope = ? AND r.created_at >= ?",
                (response_id, scope, self.oldest()),
            )
        if not rows:
            return None
        found, created_at, previous, body, heartbeat = rows[0]
        return StoredResponse(
            found,
            float(created_at),
            orjson.loads(body),
            previous,
            None if heartbeat is None else float(heartbeat),
        )

    async def history(self, scope: str, response_id: str) -> list[Item] | None:
        """Every item of the conversation up to and including the response's output, oldest
        first: each response of its `previous_response_id` chain contributes its input items,
        then its output items. None when the response is not stored for this scope; raises
        BrokenHistory when a response it continues is gone."""
        oldest = self.oldest()
        async with self._failures("read a conversation"):
            await self._prepare()
            chain = await self._db.fetch(
                _CHAIN, (response_id, scope, oldest, scope, oldest, MAX_CHAIN)
            )
            if not chain:
                return None
            first_previous = chain[0][1]
            if first_previous is not None:
                raise BrokenHistory(first_previous)
            ids = [row[0] for row in chain]
            rows = await self._db.fetch(
                "SELECT response_id, position, body FROM items WHERE response_id IN ("
                + ", ".join("?" * len(ids))
                + ") ORDER BY response_id, position",
                ids,
            )
            order = {found: index for index, found in enumerate(ids)}
            rows.sort(key=lambda row: (order[row[0]], row[1]))
            return await self._inflated(scope, await decode_all([row[2] for row in rows]))

    async def items(self, scope: str, item_ids: Sequence[str]) -> dict[str, Item]:
        """The stored items with these IDs (inputs or outputs of unexpired responses of this
        scope), by ID; IDs not found are left out."""
        wanted = sorted(set(item_ids))
        if not wanted:
            return {}
        async with self._failures("read items"):
            await self._prepare()
            rows = await self._db.fetch(
                "SELECT i.item_id, i.body FROM items i JOIN responses r ON r.id = i.response_id "
                "WHERE i.scope = ? AND r.created_at >= ? AND i.item_id IN ("
                + ", ".join("?" * len(wanted))
                + ") ORDER BY r.created_at, i.position",
                (scope, self.oldest(), *wanted),
            )
            bodies = await decode_all([body for _, body in rows])
            found = dict(zip((item_id for item_id, _ in rows), bodies, strict=True))
            inflated = await self._inflated(scope, list(found.values()))
        return dict(zip(found, inflated, strict=True))

    async def input_items(
        self,
        scope: str,
        response_id: str,
        *,
        after: str | None = None,
        limit: int = 20,
        order: Literal["asc", "desc"] = "desc",
    ) -> ItemPage | None:
        """One page of the response's own input items; None when the response is not stored
        for this scope. `after`: an item ID of the previous page (pages continue past it)."""
        async with self._failures("list input items"):
            await self._prepare()
            found = await self._db.fetch(
                "SELECT input_count FROM responses WHERE id = ? AND scope = ? AND created_at >= ?",
                (response_id, scope, self.oldest()),
            )
            if not found:
                return None
            count = int(found[0][0])
            low, high = 0, count
            if after is not None:
                cursor = await self._db.fetch(
                    "SELECT MIN(position) FROM items WHERE response_id = ? AND item_id = ? "
                    "AND position < ?",
                    (response_id, after, count),
                )
                position = cursor[0][0] if cursor else None
                if position is None:
                    return ItemPage()
                low, high = (position + 1, count) if order == "asc" else (0, position)
            direction = "ASC" if order == "asc" else "DESC"
            rows = await self._db.fetch(
                "SELECT body FROM items WHERE response_id = ? AND position >= ? AND position < ? "
                f"ORDER BY position {direction} LIMIT ?",
                (response_id, low, high, limit + 1),
            )
            items = await self._inflated(scope, await decode_all([row[0] for row in rows[:limit]]))
        return ItemPage(items, has_more=len(rows) > limit)

    async def delete(self, scope: str, response_id: str) -> bool:
        """Delete the response and its items; False when it is not stored for this scope."""
        async with self._failures("delete a response", write=True):
            await self._prepare()
            deleted = await RESPONSES.delete(
                self._db, *RESPONSES.live(response_id, scope, self.oldest())
            )
        return deleted > 0

    async def evict(self) -> int:
        """Delete expired responses, then each scope's oldest while it exceeds its cap (the
        scope's own, or the level the whole store's cap sets, `fair_level`); the number of
        responses deleted."""
        return await self.evict_table(RESPONSES)
