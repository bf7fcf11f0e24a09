"""The tables of conversations: their DDL, created with the rest of the store's schema
(`schema.SCHEMA`); the queries are `conversations.py`.

`conversations`: its scope, creation and last-change times, metadata, the bytes its items take,
the position its next item takes. `conversation_items`: every item, by position, and whether
this server generated it (a turn's input and output, whose reasoning is trusted when it returns
to a prompt, as a stored response's is; items a client adds are not).
"""

from __future__ import annotations

from deepinfer_server.store.scoped import ScopedTable

CONVERSATION_TABLES = (
    """CREATE TABLE IF NOT EXISTS conversations (
        id TEXT PRIMARY KEY,
        scope TEXT NOT NULL,
        created_at DOUBLE PRECISION NOT NULL,
        updated_at DOUBLE PRECISION NOT NULL,
        metadata TEXT NOT NULL,
        bytes BIGINT NOT NULL,
        next_position INTEGER NOT NULL
    )""",
    "CREATE INDEX IF NOT EXISTS conversations_by_age ON conversations (updated_at, id)",
    """CREATE TABLE IF NOT EXISTS conversation_items (
        conversation_id TEXT NOT NULL,
        position INTEGER NOT NULL,
        item_id TEXT NOT NULL,
        generated INTEGER NOT NULL,
        body TEXT NOT NULL,
        PRIMARY KEY (conversation_id, position)
    )""",
    "CREATE INDEX IF NOT EXISTS conversation_items_by_id "
    "ON conversation_items (conversation_id, item_id)",
)
#: Conversations live for the time to live past their last change, under caps of their own (of
#: the responses' sizes: a key's conversations never evict its responses, nor the reverse);
#: their items go with them.
CONVERSATIONS = ScopedTable(
    "conversations",
    age="updated_at",
    capped=True,
    children=(("conversation_items", "conversation_id"),),
)
