"""The store: stored responses, conversations, files and batch jobs, on SQLite or PostgreSQL.

Persistence only: this package knows rows, scopes and expiry, never the Responses protocol
(the API layer decides what is stored and how it is resolved). Every call is async and never
blocks the event loop (aiosqlite runs SQLite on a thread of its own; psycopg is asynchronous).

One database (`root.StoreRoot`: opening it, the schema, the scope salt, failures as 503s and
/health's view of them), whose root is the `ResponseStore` the API keeps (`state.store`). Every
row belongs to a scope (one API key) and lives for the store's time to live; responses and
conversations also count their bytes against per-scope caps, evicted fairly (`scoped.py`);
files count theirs against caps of the same sizes, which refuse an upload instead (`files.py`).
Rows a process works on for a while are held under a lease (`lease.py`).

To add a store-backed object:

1. One table declaration: a `<object>_tables.py` module with its DDL (`CREATE TABLE IF NOT
   EXISTS`, with `id`, `scope`, the column its age counts from, and `bytes` if caps apply) and
   its `scoped.ScopedTable` (its parts, whether caps apply; a `lease.Lease` if processes hold
   its rows), added to `schema.SCHEMA` and `schema.SCOPED_TABLES` (the root creates the tables
   and evicts old rows; bump `schema.SCHEMA_VERSION`, the old version joining `UPGRADES`).
2. One module of operations: a class on `root.Operations`, built from the root
   (`MyStore(state.store)`), each query inside `self._store.connection(doing)` and using the
   table's `ScopedTable` for live rows (`live`), pages (`after`) and deletes (`delete`).
3. Its routes (`api/routes/`), which build it from the root as above.
"""

from deepinfer_server.store.records import BrokenHistory, ItemPage, ResponseTooLarge, StoredResponse
from deepinfer_server.store.responses import ResponseStore

__all__ = ["BrokenHistory", "ItemPage", "ResponseStore", "ResponseTooLarge", "StoredResponse"]
