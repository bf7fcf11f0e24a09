"""The tables of stored responses: their DDL, created with the rest of the store's schema
(`schema.SCHEMA`); the queries are `responses.py` and `background_runs.py`.

`responses`: one row per stored response (its scope, creation time, the response object, the
response it continues, the bytes it takes). `items`: every input and output item of a response,
by position (inputs first, then outputs). `blobs`: the inline images of a scope's items, kept
once (`blobs.py`), and `response_blobs` which response refers to which. A background response
(`services/background.py`) also has its stream's events in `response_events` and, while it runs, a
row in `background_runs` (the process running it and its last heartbeat).
"""

from __future__ import annotations

from deepinfer_server.store.lease import Lease
from deepinfer_server.store.scoped import ScopedTable

RESPONSE_TABLES = (
    """CREATE TABLE IF NOT EXISTS responses (
        id TEXT PRIMARY KEY,
        scope TEXT NOT NULL,
        created_at DOUBLE PRECISION NOT NULL,
        previous_response_id TEXT,
        input_count INTEGER NOT NULL,
        bytes BIGINT NOT NULL,
        body TEXT NOT NULL
    )""",
    "CREATE INDEX IF NOT EXISTS responses_by_age ON responses (created_at, id)",
    """CREATE TABLE IF NOT EXISTS items (
        response_id TEXT NOT NULL,
        position INTEGER NOT NULL,
        item_id TEXT NOT NULL,
        scope TEXT NOT NULL,
        body TEXT NOT NULL,
        PRIMARY KEY (response_id, position)
    )""",
    "CREATE INDEX IF NOT EXISTS items_by_id ON items (scope, item_id)",
    """CREATE TABLE IF NOT EXISTS blobs (
        scope TEXT NOT NULL,
        hash TEXT NOT NULL,
        data TEXT NOT NULL,
        PRIMARY KEY (scope, hash)
    )""",
    """CREATE TABLE IF NOT EXISTS response_blobs (
        response_id TEXT NOT NULL,
        scope TEXT NOT NULL,
        hash TEXT NOT NULL,
        PRIMARY KEY (response_id, hash)
    )""",
    "CREATE INDEX IF NOT EXISTS response_blobs_by_hash ON response_blobs (scope, hash)",
    # A background response's stream, event by event, for `starting_after` (services/background.py).
    """CREATE TABLE IF NOT EXISTS response_events (
        response_id TEXT NOT NULL,
        sequence_number INTEGER NOT NULL,
        body TEXT NOT NULL,
        PRIMARY KEY (response_id, sequence_number)
    )""",
    # A background response still running: which process runs it (`owner`), and when that
    # process last said it still does (`heartbeat_at`). Deleted when it ends.
    """CREATE TABLE IF NOT EXISTS background_runs (
        response_id TEXT PRIMARY KEY,
        scope TEXT NOT NULL,
        owner TEXT NOT NULL,
        heartbeat_at DOUBLE PRECISION NOT NULL,
        cancel_requested INTEGER NOT NULL DEFAULT 0
    )""",
    "CREATE INDEX IF NOT EXISTS background_runs_by_owner ON background_runs (owner)",
)
#: Stored responses: their items, image references, events and run go with them, and then the
#: blobs no stored response refers to any more.
RESPONSES = ScopedTable(
    "responses",
    capped=True,
    children=tuple(
        (table, "response_id")
        for table in ("items", "response_blobs", "response_events", "background_runs")
    ),
    cleanup=(
        "DELETE FROM blobs WHERE NOT EXISTS (SELECT 1 FROM response_blobs r "
        "WHERE r.scope = blobs.scope AND r.hash = blobs.hash)",
    ),
)
#: A background response's run: its process renews `heartbeat_at` (`services/background.py`).
RUN_LEASE = Lease("background_runs", holder="owner", time="heartbeat_at", ends=False)
