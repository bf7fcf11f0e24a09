"""StoreRoot: the store's one database, shared by every store-backed object.

It opens the database and creates (or upgrades) the schema every table module declares
(`schema.SCHEMA`), keeps the salt of the scope hashes (`store_meta`), and turns database
failures into `StoreUnavailableError` (503) for the request that needed the store, remembering
the last one of each kind (read, write) for /health until one of the same kind succeeds. The
stores of each object (`responses.ResponseStore`, `conversations.ConversationStore`,
`batches.BatchStore`) run their queries through `connection()`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import AsyncIterator

from deepinfer_server.errors import StoreUnavailableError
from deepinfer_server.store.database import Database, Step
from deepinfer_server.store.schema import SCHEMA, SCHEMA_VERSION, SCOPED_TABLES, UPGRADES
from deepinfer_server.store.scoped import Caps, ScopedTable

logger = logging.getLogger(__name__)


class StoreRoot:
    """The database of every API server process (and replica) that shares `database`, with
    the store's time to live (`ttl`, seconds) and byte caps (`max_bytes`: the whole store's,
    `scope_max_bytes`: one scope's, by default the whole store's; `response_max_bytes`: the
    largest response stored, by default a scope's cap), shared by its tables, and the most
    files one scope may keep (`scope_max_files`)."""

    def __init__(
        self,
        database: Database,
        *,
        ttl: float,
        max_bytes: int,
        scope_max_bytes: int | None = None,
        response_max_bytes: int | None = None,
        scope_max_files: int = 10_000,
    ) -> None:
        self._db = database
        self.ttl = ttl
        self.max_bytes = max_bytes
        self.scope_max_bytes = max_bytes if scope_max_bytes is None else scope_max_bytes
        self.response_max_bytes = (
            self.scope_max_bytes if response_max_bytes is None else response_max_bytes
        )
        self.scope_max_files = scope_max_files
        self._ready = False
        self._salt: bytes | None = None
        #: The last failure of a read and of a write, until one of the same kind succeeds.
        self._failing: dict[str, str] = {}

    @property
    def description(self) -> str:
        """The database, for log lines (without its credentials)."""
        return self._db.description

    @property
    def database(self) -> Database:
        """The database itself (query it within `connection`)."""
        return self._db

    @property
    def caps(self) -> Caps:
        """The byte caps the scoped tables that count bytes share (each has caps of its own,
        of these sizes: a key's conversations never evict its responses, nor the reverse;
        files and batches' data share one, `quota.py`)."""
        return Caps(max_bytes=self.max_bytes, scope_max_bytes=self.scope_max_bytes)

    @property
    def failure(self) -> str | None:
        """Why the store is degraded (its last read or write failed, and none of the same kind
        has succeeded since), or None."""
        return "; ".join(self._failing[kind] for kind in sorted(self._failing)) or None

    async def open(self) -> None:
        """Connect and create the schema (raises StoreUnavailableError when it cannot)."""
        async with self._failures("open", write=True):
            await self._prepare()

    async def close(self) -> None:
        """Close the database (its failures ignored: the process is ending)."""
        with contextlib.suppress(*self._db.errors):
            await self._db.close()

    async def scope_salt(self) -> bytes:
        """The salt of this store's scope hashes, made once per store (shared by replicas)."""
        if self._salt is None:
            async with self._failures("read the scope salt"):
                await self._prepare()
                rows = await self._db.fetch(
                    "SELECT value FROM store_meta WHERE name = ?", ("scope_salt",)
                )
                self._salt = bytes.fromhex(rows[0][0])
        return self._salt

    @contextlib.asynccontextmanager
    async def connection(self, doing: str, *, write: bool = False) -> AsyncIterator[Database]:
        """The database, its schema ready, for a store's queries; its failures are this
        store's (`StoreUnavailableError`, remembered as `failure`)."""
        async with self._failures(doing, write=write):
            await self._prepare()
            yield self._db

    async def evict_table(self, table: ScopedTable) -> int:
        """Delete a scoped table's expired rows, then, under the store's byte caps, each
        scope's oldest while it exceeds its cap (`ScopedTable.evict`); how many."""
        async with self._failures(f"evict old {table.name}", write=True):
            await self._prepare()
            deleted = await table.evict(
                self._db, self.oldest(), self.caps if table.capped else None
            )
        if deleted:
            logger.info("response store: evicted %d row(s) of %s", deleted, table.name)
        return deleted

    async def evict_periodically(self, interval: float) -> None:
        """Evict every scoped table (`schema.SCOPED_TABLES`) now and then every `interval`
        seconds, until cancelled (a failure is logged and tried again next time)."""
        while True:
            for table in SCOPED_TABLES:
                with contextlib.suppress(StoreUnavailableError):
                    await self.evict_table(table)
            await asyncio.sleep(interval)

    def oldest(self) -> float:
        """The time (creation or last change) of the oldest row still alive."""
        return time.time() - self.ttl

    async def _prepare(self) -> None:
        if self._ready:
            return
        await self._db.open()
        await self._db.create_schema(SCHEMA)
        await self._db.write(
            [
                Step(
                    "INSERT INTO store_meta (name, value) VALUES (?, ?) ON CONFLICT (name) "
                    "DO NOTHING",
                    ("schema_version", SCHEMA_VERSION),
                ),
                Step(
                    "INSERT INTO store_meta (name, value) VALUES (?, ?) ON CONFLICT (name) "
                    "DO NOTHING",
                    ("scope_salt", secrets.token_hex(32)),
                ),
            ]
        )
        await self._db.write(
            [
                Step(
                    "UPDATE store_meta SET value = ? WHERE name = ? AND value IN ("
                    + ", ".join("?" * len(UPGRADES))
                    + ")",
                    (SCHEMA_VERSION, "schema_version", *sorted(UPGRADES)),
                )
            ]
        )
        version = await self._db.fetch(
            "SELECT value FROM store_meta WHERE name = ?", ("schema_version",)
        )
        if version[0][0] != SCHEMA_VERSION:
            raise StoreUnavailableError(
                f"the response store {self._db.description} has schema version "
                f"{version[0][0]}; this server reads version {SCHEMA_VERSION}"
            )
        self._ready = True

    @contextlib.asynccontextmanager
    async def _failures(self, doing: str, *, write: bool = False) -> AsyncIterator[None]:
        """Database failures as StoreUnavailableError (logged once here), remembered as the
        store's `failure` until a call of the same kind succeeds."""
        kind = "write" if write else "read"
        try:
            yield
        except self._db.errors as exc:
            # The exception's text goes to the log only: /health shows the reason to anyone.
            self._failing[kind] = f"cannot {doing} ({type(exc).__name__})"
            logger.warning(
                "response store %s: cannot %s: %s: %s",
                self._db.description,
                doing,
                type(exc).__name__,
                exc,
            )
            raise StoreUnavailableError() from exc
        self._failing.pop(kind, None)


class Operations:
    """The base of a store-backed object's operations (its module's store class): the root
    they run on (`connection`, its caps and time to live) and its database."""

    def __init__(self, store: StoreRoot) -> None:
        self._store = store
        self._db = store.database

    def _oldest(self) -> float:
        """The time (creation or last change) of the oldest row still alive."""
        return self._store.oldest()
