"""ConversationStore: OpenAI's Conversations (`/v1/conversations`) on the Responses store.

Its tables are declared in `conversation_tables.py`: `conversations` (one row each, with the
bytes its items take) and `conversation_items` (every item, by position, and whether this
server generated it).

An append takes its positions from the conversation's row in the same transaction that
inserts the items (`UPDATE` first: PostgreSQL locks the row, SQLite's writer lock holds
anyway), so two turns of one conversation finishing together never take the same position.

Sizes and lifetimes follow the responses store's: a conversation unchanged for its time to
live is neither read nor kept; `evict()` deletes a scope's least recently changed
conversations while their items take more than the scope's cap, and cuts every scope down to
one fair level when all conversations together exceed the store's cap. Conversations count
against caps of their own, of the same sizes as the responses': a key's conversations never
evict its stored responses, nor the reverse.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson

from deepinfer_server.store.conversation_tables import CONVERSATIONS
from deepinfer_server.store.database import Database, Step
from deepinfer_server.store.decoding import decode_all
from deepinfer_server.store.records import Item, JsonObject
from deepinfer_server.store.root import Operations


@dataclass(frozen=True)
class Conversation:
    """A conversation read back (without its items)."""

    id: str
    created_at: float
    metadata: dict[str, str]

    def body(self) -> JsonObject:
        """OpenAI's `conversation` object."""
        return {
            "id": self.id,
            "object": "conversation",
            "created_at": int(self.created_at),
            "metadata": self.metadata,
        }


@dataclass(frozen=True)
class ConversationItems:
    """Items of a conversation, in the order asked; `trusted`: the positions (in `items`) of
    those this server generated."""

    items: list[Item] = field(default_factory=list)
    has_more: bool = False
    trusted: frozenset[int] = frozenset()


def new_conversation_id() -> str:
    """A new conversation's ID (`conv_` and 48 random hex digits)."""
    return f"conv_{secrets.token_hex(24)}"


class ConversationStore(Operations):
    """The conversations of every API server process (and replica) sharing `store`'s
    database, with its time to live and caps (module docstring)."""

    async def create(
        self, scope: str, metadata: dict[str, str], items: Sequence[Item]
    ) -> Conversation:
        """A new conversation holding `items` (added by the client)."""
        now = time.time()
        conversation = Conversation(new_conversation_id(), now, metadata)
        steps = [
            Step(
                "INSERT INTO conversations (id, scope, created_at, updated_at, metadata, bytes, "
                "next_position) VALUES (?, ?, ?, ?, ?, 0, 0)",
                (conversation.id, scope, now, now, orjson.dumps(metadata).decode()),
            ),
            *self.append_steps(scope, conversation.id, items, generated=False, now=now),
        ]
        async with self._store.connection("create a conversation", write=True) as db:
            await db.write(steps)
        return conversation

    async def get(self, scope: str, conversation_id: str) -> Conversation | None:
        """The conversation, or None when it is not stored for this scope (or expired)."""
        async with self._store.connection("read a conversation") as db:
            rows = await db.fetch(
                "SELECT id, created_at, metadata FROM conversations "
                "WHERE id = ? AND scope = ? AND updated_at >= ?",
                (conversation_id, scope, self._oldest()),
            )
        if not rows:
            return None
        found, created_at, metadata = rows[0]
        return Conversation(str(found), float(created_at), orjson.loads(metadata))

    async def update(
        self, scope: str, conversation_id: str, metadata: dict[str, str]
    ) -> Conversation | None:
        """Replace the conversation's metadata; None when it is not stored for this scope."""
        async with self._store.connection("update a conversation", write=True) as db:
            changed = await db.write(
                [
                    Step(
                        "UPDATE conversations SET metadata = ?, updated_at = ? "
                        "WHERE id = ? AND scope = ? AND updated_at >= ?",
                        (
                            orjson.dumps(metadata).decode(),
                            time.time(),
                            conversation_id,
                            scope,
                            self._oldest(),
                        ),
                    )
                ]
            )
        if not changed[0]:
            return None
        return await self.get(scope, conversation_id)

    async def delete(self, scope: str, conversation_id: str) -> bool:
        """Delete the conversation and its items; False when it is not stored for this scope."""
        async with self._store.connection("delete a conversation", write=True) as db:
            deleted = await CONVERSATIONS.delete(
                db, *CONVERSATIONS.live(conversation_id, scope, self._oldest())
            )
        return deleted > 0

    async def append(
        self, scope: str, conversation_id: str, items: Sequence[Item], *, generated: bool
    ) -> bool:
        """Add `items` at the end of the conversation (`generated`: a turn's input and
        output); False when it is not stored for this scope."""
        steps = self.append_steps(scope, conversation_id, items, generated=generated)
        if not steps:
            return await self.get(scope, conversation_id) is not None
        async with self._store.connection("add conversation items", write=True) as db:
            changed = await db.write(steps)
        return changed[0] > 0

    def append_steps(
        self,
        scope: str,
        conversation_id: str,
        items: Sequence[Item],
        *,
        generated: bool,
        now: float | None = None,
    ) -> list[Step]:
        if not items:
            return []
        texts = [orjson.dumps(item).decode() for item in items]
        count = len(texts)
        now = time.time() if now is None else now
        # The UPDATE takes the positions (and locks the row); the INSERT numbers the items
        # from the position the conversation had before it.
        return [
            Step(
                "UPDATE conversations SET next_position = next_position + ?, "
                "bytes = bytes + ?, updated_at = ? "
                "WHERE id = ? AND scope = ? AND updated_at >= ?",
                (
                    count,
                    sum(len(text) for text in texts),
                    now,
                    conversation_id,
                    scope,
                    self._oldest(),
                ),
            ),
            Step(
                "INSERT INTO conversation_items (conversation_id, position, item_id, generated, "
                "body) SELECT id, next_position - ?, ?, ?, ? FROM conversations "
                "WHERE id = ? AND scope = ?",
                [
                    (
                        count - index,
                        str(item.get("id", "")),
                        int(generated),
                        text,
                        conversation_id,
                        scope,
                    )
                    for index, (item, text) in enumerate(zip(items, texts, strict=True))
                ],
                many=True,
            ),
        ]

    async def items(
        self,
        scope: str,
        conversation_id: str,
        *,
        after: str | None = None,
        limit: int | None = 20,
        order: Literal["asc", "desc"] = "desc",
    ) -> ConversationItems | None:
        """One page of the conversation's items (`limit` None: all of them); None when the
        conversation is not stored for this scope. `after`: an item ID of the previous page."""
        async with self._store.connection("list conversation items") as db:
            if await self._live(db, scope, conversation_id) is None:
                return None
            where = "conversation_id = ?"
            params: list[Any] = [conversation_id]
            if after is not None:
                cursor = await db.fetch(
                    "SELECT MIN(position) FROM conversation_items "
                    "WHERE conversation_id = ? AND item_id = ?",
                    (conversation_id, after),
                )
                position = cursor[0][0] if cursor else None
                if position is None:
                    return ConversationItems()
                where += " AND position > ?" if order == "asc" else " AND position < ?"
                params.append(position)
            direction = "ASC" if order == "asc" else "DESC"
            sql = (
                f"SELECT body, generated FROM conversation_items WHERE {where} "
                f"ORDER BY position {direction}"
            )
            if limit is not None:
                sql += " LIMIT ?"
                params.append(limit + 1)
            rows = await db.fetch(sql, params)
        page = rows if limit is None else rows[:limit]
        return ConversationItems(
            await decode_all([body for body, _ in page]),
            has_more=limit is not None and len(rows) > limit,
            trusted=frozenset(index for index, (_, made) in enumerate(page) if made),
        )

    async def item(self, scope: str, conversation_id: str, item_id: str) -> Item | None:
        """One item of the conversation (the first with this ID); None when either is not
        stored for this scope."""
        async with self._store.connection("read a conversation item") as db:
            if await self._live(db, scope, conversation_id) is None:
                return None
            rows = await db.fetch(
                "SELECT body FROM conversation_items WHERE conversation_id = ? AND item_id = ? "
                "ORDER BY position LIMIT 1",
                (conversation_id, item_id),
            )
        return orjson.loads(rows[0][0]) if rows else None

    async def delete_item(self, scope: str, conversation_id: str, item_id: str) -> bool | None:
        """Delete an item of the conversation (every one with this ID); None when the
        conversation is not stored for this scope, False when the item is not in it."""
        async with self._store.connection("delete a conversation item", write=True) as db:
            if await self._live(db, scope, conversation_id) is None:
                return None
            changed = await db.write(
                [
                    Step(
                        "UPDATE conversations SET bytes = bytes - COALESCE((SELECT "
                        "SUM(LENGTH(body)) FROM conversation_items WHERE conversation_id = ? "
                        "AND item_id = ?), 0), updated_at = ? WHERE id = ?",
                        (conversation_id, item_id, time.time(), conversation_id),
                    ),
                    Step(
                        "DELETE FROM conversation_items WHERE conversation_id = ? AND item_id = ?",
                        (conversation_id, item_id),
                    ),
                ],
                frees=True,
            )
        return changed[-1] > 0

    async def evict(self) -> int:
        """Delete expired conversations, then each scope's least recently changed while it
        exceeds its cap (module docstring); the number of conversations deleted."""
        return await self._store.evict_table(CONVERSATIONS)

    async def _live(self, db: Database, scope: str, conversation_id: str) -> str | None:
        where, params = CONVERSATIONS.live(conversation_id, scope, self._oldest())
        rows = await db.fetch(f"SELECT id FROM conversations WHERE {where}", params)
        return str(rows[0][0]) if rows else None
