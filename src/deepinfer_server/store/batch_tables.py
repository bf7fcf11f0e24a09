"""The tables of batch jobs (OpenAI's Files and Batches, Anthropic's Message Batches): their
DDL, created with the rest of the store's schema (`schema.SCHEMA`); the queries are `batches.py`.

`files`: an uploaded file, or a batch's output or error file, its content as text. `batches`:
one row per batch (its scope, kind, endpoint, status and the time it reached each status).
`batch_lines`: one row per request of a batch, its request body (None for a malformed line),
its status (`pending` until answered) and result, and, while a process works on it, the process
(`claimed_by`), the claim (`claim`) and when its lease ends (`lease_until`).
`batch_bytes`: the bytes a batch keeps (its requests, its lines' results, the marks of their
writes), counted against its scope's store quota with its files (`quota.py`).
`batch_line_effects`: a line whose answer wrote to the store (a Responses line's stored response
or conversation turn), written in the same transaction as those writes, with the body answered
(`batch_effects.py`): its key makes a second answer of the line fail, writing nothing.
"""

from __future__ import annotations

from deepinfer_server.store.lease import Lease
from deepinfer_server.store.scoped import ScopedTable

#: Statuses of a batch still at work (the others are final).
ACTIVE_STATUSES = ("validating", "in_progress", "finalizing", "cancelling")

BATCH_TABLES = (
    """CREATE TABLE IF NOT EXISTS files (
        id TEXT PRIMARY KEY,
        scope TEXT NOT NULL,
        created_at DOUBLE PRECISION NOT NULL,
        purpose TEXT NOT NULL,
        filename TEXT NOT NULL,
        bytes BIGINT NOT NULL,
        content TEXT NOT NULL
    )""",
    "CREATE INDEX IF NOT EXISTS files_by_scope ON files (scope, created_at, id)",
    """CREATE TABLE IF NOT EXISTS batches (
        id TEXT PRIMARY KEY,
        scope TEXT NOT NULL,
        kind TEXT NOT NULL,
        created_at DOUBLE PRECISION NOT NULL,
        expires_at DOUBLE PRECISION NOT NULL,
        endpoint TEXT NOT NULL,
        input_file_id TEXT,
        metadata TEXT,
        status TEXT NOT NULL,
        in_progress_at DOUBLE PRECISION,
        finalizing_at DOUBLE PRECISION,
        completed_at DOUBLE PRECISION,
        failed_at DOUBLE PRECISION,
        expired_at DOUBLE PRECISION,
        cancelling_at DOUBLE PRECISION,
        cancelled_at DOUBLE PRECISION,
        output_file_id TEXT,
        error_file_id TEXT
    )""",
    "CREATE INDEX IF NOT EXISTS batches_by_scope ON batches (scope, kind, created_at, id)",
    "CREATE INDEX IF NOT EXISTS batches_by_status ON batches (status)",
    """CREATE TABLE IF NOT EXISTS batch_lines (
        batch_id TEXT NOT NULL,
        line INTEGER NOT NULL,
        custom_id TEXT NOT NULL,
        body TEXT,
        status TEXT NOT NULL,
        result TEXT,
        claimed_by TEXT,
        claim TEXT,
        lease_until DOUBLE PRECISION,
        PRIMARY KEY (batch_id, line)
    )""",
    "CREATE INDEX IF NOT EXISTS batch_lines_by_status ON batch_lines (batch_id, status)",
    "CREATE INDEX IF NOT EXISTS batch_lines_by_owner ON batch_lines (claimed_by)",
    """CREATE TABLE IF NOT EXISTS batch_line_effects (
        batch_id TEXT NOT NULL,
        line INTEGER NOT NULL,
        body TEXT NOT NULL,
        PRIMARY KEY (batch_id, line)
    )""",
    """CREATE TABLE IF NOT EXISTS batch_bytes (
        batch_id TEXT PRIMARY KEY,
        scope TEXT NOT NULL,
        bytes BIGINT NOT NULL
    )""",
    "CREATE INDEX IF NOT EXISTS batch_bytes_by_scope ON batch_bytes (scope)",
)

#: Files live for the store's time to live. Their `bytes` count against the store's caps, which
#: refuse an upload past them (`files.FileStore.upload_file`); they are never evicted for room.
FILES = ScopedTable("files")
#: Batches live for the store's time to live once ended (one still at work is kept whatever its
#: age: its completion window ends it); their lines go with them. Their bytes (`batch_bytes`)
#: count against the store's quota (`quota.py`), which refuses a new batch past it; they are
#: never evicted for room.
BATCHES = ScopedTable(
    "batches",
    size=None,
    children=(
        ("batch_lines", "batch_id"),
        ("batch_line_effects", "batch_id"),
        ("batch_bytes", "batch_id"),
    ),
    evictable="status NOT IN (?, ?, ?, ?)",
    evictable_params=ACTIVE_STATUSES,
)
#: A batch line a process answers: its lease ends at `lease_until` (`services/batch_runner.py`).
LINE_LEASE = Lease("batch_lines", holder="claimed_by", time="lease_until", ends=True)
