"""The Responses store: stored responses and their items, on SQLite or PostgreSQL.

Persistence only: this package knows rows, scopes and expiry, never the Responses protocol
(the API layer decides what is stored and how it is resolved). Every call is async and never
blocks the event loop (aiosqlite runs SQLite on a thread of its own; psycopg is asynchronous).
"""

from deepinfer_server.store.records import BrokenHistory, ItemPage, ResponseTooLarge, StoredResponse
from deepinfer_server.store.responses import ResponseStore

__all__ = ["BrokenHistory", "ItemPage", "ResponseStore", "ResponseTooLarge", "StoredResponse"]
