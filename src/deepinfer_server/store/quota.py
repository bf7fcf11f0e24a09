"""The store quota of what a key keeps itself: its files (`files.py`) and its batches' data
(`batch_bytes` in `batch_tables.py`: a batch's requests, its lines' results and the marks of
their writes), counted together against the store's byte caps (`root.StoreRoot.caps`: one
scope's `scope_max_bytes`, every scope's `max_bytes`).

A write that would pass a cap (an upload, a new batch) is refused in the transaction that
would store it: its first statement (`SERIALIZE`) updates one row every such write updates, so
on PostgreSQL (where a statement sees what committed before it started) the next one waits for
it and then counts what it stored; on SQLite writes are serialized anyway. Two concurrent
writes never both pass a cap one of them fills. What a batch's work records (its results, the
marks, its output files) is always stored, counted when stored: once a key is past its cap its
next upload or batch is refused until it deletes some or its data expires.
"""

from __future__ import annotations

from deepinfer_server.store.database import Step
from deepinfer_server.store.scoped import Caps, Params

#: The first statement of a write under the quota (module docstring): it changes nothing but
#: holds the row's lock until the transaction ends.
SERIALIZE = Step("UPDATE store_meta SET value = value WHERE name = ?", ("scope_salt",))

#: The bytes `scope` keeps (files and batches' data), then every scope's.
_USED = (
    "(SELECT COALESCE(SUM(bytes), 0) FROM files WHERE scope = ?) + "
    "(SELECT COALESCE(SUM(bytes), 0) FROM batch_bytes WHERE scope = ?)"
)
_USED_ALL = (
    "(SELECT COALESCE(SUM(bytes), 0) FROM files) + "
    "(SELECT COALESCE(SUM(bytes), 0) FROM batch_bytes)"
)
#: The SELECT of a scope's and every scope's bytes (`room`).
USAGE = f"SELECT {_USED}, {_USED_ALL}"


def fits(scope: str, size: int, caps: Caps) -> tuple[str, Params]:
    """The condition (and its parameters) that `size` more bytes of `scope` stay within the
    caps."""
    return (
        f"{_USED} + ? <= ? AND {_USED_ALL} + ? <= ?",
        (scope, scope, size, caps.scope_max_bytes, size, caps.max_bytes),
    )


def room(caps: Caps, mine: int, every: int) -> int:
    """How many more bytes a scope holding `mine` may store when every scope holds `every`."""
    return max(0, min(caps.max_bytes - every, caps.scope_max_bytes - mine))
