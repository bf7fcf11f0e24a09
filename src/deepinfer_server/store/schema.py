"""The store's schema: every table module's DDL, and its version.

A new store-backed object declares its tables in a module of its own (`*_tables.py`) and adds
them to `SCHEMA` here, and its scoped table to `SCOPED_TABLES`; `root.StoreRoot` creates them
when it opens the database (every statement is `IF NOT EXISTS`, so a store made by an older
version gains the new tables) and evicts each scoped table's old rows.
"""

from __future__ import annotations

from deepinfer_server.store.batch_tables import BATCH_TABLES, BATCHES, FILES
from deepinfer_server.store.conversation_tables import CONVERSATION_TABLES, CONVERSATIONS
from deepinfer_server.store.response_tables import RESPONSE_TABLES, RESPONSES
from deepinfer_server.store.scoped import ScopedTable

SCHEMA_VERSION = "6"
#: Versions this server opens and brings to SCHEMA_VERSION (2 added the image blobs, 3 the
#: background runs and their events, 4 the conversations and the batch jobs' tables
#: (`conversation_tables.py`, `batch_tables.py`), 5 the marks of batch lines' writes
#: (`batch_line_effects`), 6 the bytes of each batch (`batch_bytes`, counted in a key's store
#: quota: a batch stored before counts nothing): an older store has none of them, and its
#: tables are unchanged). A server of an older version refuses a newer store: one that did not
#: check the marks would answer a batch line twice, one that did not count batches' bytes
#: would let a key pass its quota.
UPGRADES = frozenset({"1", "2", "3", "4", "5"})

SCHEMA = (
    # The schema version and the salt of the scope hashes.
    "CREATE TABLE IF NOT EXISTS store_meta (name TEXT PRIMARY KEY, value TEXT NOT NULL)",
    *RESPONSE_TABLES,
    *CONVERSATION_TABLES,
    *BATCH_TABLES,
)
#: The tables whose rows `root.StoreRoot.evict_periodically` evicts (with their parts).
SCOPED_TABLES: tuple[ScopedTable, ...] = (RESPONSES, CONVERSATIONS, BATCHES, FILES)
