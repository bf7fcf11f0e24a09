"""ResponseStore: the Responses store's schema and queries, the same on SQLite and PostgreSQL.

Two tables: `responses` (one row per stored response: its scope, creation time, the response
object, the response it continues) and `items` (every input and output item of a response, by
position: inputs first, then outputs), plus `store_meta` (the schema version and the salt of the
scope hashes). A background response (`api/background.py`) also has its stream's events in
`response_events` and, while it runs, a row in `background_runs` (the process running it and its
last heartbeat). A conversation continued with `previous_response_id` is a chain of responses;
its items are read back by walking the chain (a recursive query), so no response repeats its
ancestors' items. Rows older than the time to live are never read and are deleted by `evict()`.

Sizes are kept per scope (one API key's responses): `evict()` deletes a scope's oldest responses
while that scope holds more than its cap, so one key's traffic never evicts another's; the whole
store's cap is a backstop that evicts fairly, from the scopes holding the most (each is cut down
to one common level, the largest at which the store fits). `save()` refuses a response larger
than the cap of one response (`ResponseTooLarge`) before it writes anything.

Every write is one short transaction. Database failures surface as `StoreUnavailableError`
(503) for the request that needed the store, and nothing else.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import AsyncIterator, Collection, Sequence
from typing import Any, Literal

import orjson

from deepinfer_server.errors import StoreUnavailableError
from deepinfer_server.store import blobs
from deepinfer_server.store.batch_tables import BATCH_TABLES
from deepinfer_server.store.conversations import CONVERSATION_SCHEMA
from deepinfer_server.store.database import Database, Step
from deepinfer_server.store.fairness import fair_level
from deepinfer_server.store.records import Item, ItemPage, NewResponse, StoredResponse

logger = logging.getLogger(__name__)

SCHEMA_VERSION = "4"
#: Versions this server opens and brings to SCHEMA_VERSION (2 added the image blobs, 3 the
#: background runs and their events, 4 the conversations and the batch jobs' tables
#: (`conversations.py`, `batch_tables.py`): an older store has none of them, and its tables are
#: unchanged).
_UPGRADES = frozenset({"1", "2", "3"})
#: The deepest `previous_response_id` chain read back (a guard; chains are acyclic).
MAX_CHAIN = 100_000

SCHEMA = (
    "CREATE TABLE IF NOT EXISTS store_meta (name TEXT PRIMARY KEY, value TEXT NOT NULL)",
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
    # A background response's stream, event by event, for `starting_after` (api/background.py).
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
    *CONVERSATION_SCHEMA,
    *BATCH_TABLES,
)
#: What goes with a response when it is deleted, besides its items and blobs.
_RESPONSE_TABLES = ("items", "response_blobs", "response_events", "background_runs")
#: Blobs no stored response refers to any more.
_ORPHAN_BLOBS = (
    "DELETE FROM blobs WHERE NOT EXISTS (SELECT 1 FROM response_blobs r "
    "WHERE r.scope = blobs.scope AND r.hash = blobs.hash)"
)

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

#: The newest response of a scope past which its stored bytes exceed a cap (it and older
#: ones go).
_SIZE_CUTOFF = """
SELECT created_at, id FROM (
    SELECT created_at, id, SUM(bytes) OVER (ORDER BY created_at DESC, id DESC) AS newer
    FROM responses WHERE scope = ?
) AS ranked WHERE newer > ? ORDER BY created_at DESC, id DESC LIMIT 1
"""


class BrokenHistory(Exception):
    """A response of the chain is stored but one it continues expired or was deleted."""

    def __init__(self, missing: str) -> None:
        super().__init__(missing)
        self.missing = missing


class ResponseTooLarge(Exception):
    """A response (its object and items as JSON) larger than the store keeps for one."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"{size} bytes, over the limit of {limit}")
        self.size = size
        self.limit = limit


class ResponseStore:
    """The stored responses of every API server process (and replica) that shares `database`.

    Sizes count response objects and items as JSON. `ttl` (seconds): responses older than this
    are neither read nor kept; `max_bytes`: the whole store's cap; `scope_max_bytes`: one
    scope's cap (default: the whole store's); `response_max_bytes`: the largest response
    stored (default: a scope's cap). Past a cap, `evict()` deletes the oldest (module
    docstring).
    """

    def __init__(
        self,
        database: Database,
        *,
        ttl: float,
        max_bytes: int,
        scope_max_bytes: int | None = None,
        response_max_bytes: int | None = None,
    ) -> None:
        self._db = database
        self.ttl = ttl
        self.max_bytes = max_bytes
        self.scope_max_bytes = max_bytes if scope_max_bytes is None else scope_max_bytes
        self.response_max_bytes = (
            self.scope_max_bytes if response_max_bytes is None else response_max_bytes
        )
        self._ready = False
        self._salt: bytes | None = None
        #: The last failure of a read and of a write, until one of the same kind succeeds.
        self._failing: dict[str, str] = {}

    @property
    def description(self) -> str:
        return self._db.description

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
        with contextlib.suppress(*self._db.errors):
            await self._db.close()

    async def scope_salt(self) -> bytes:
        """The salt of this store's scope hashes, made once per store (shared by replicas)."""
        if self._salt is None:
            async with self._failures("read the scope salt"):
                await self._prepare()
                self._salt = await self._read_salt()
        return self._salt

    @contextlib.asynccontextmanager
    async def connection(self, doing: str, *, write: bool = False) -> AsyncIterator[Database]:
        """The database, its schema ready, for another module's queries on it (the
        conversations' and the batches'); its failures are this store's
        (`StoreUnavailableError`)."""
        async with self._failures(doing, write=write):
            await self._prepare()
            yield self._db

    @property
    def database(self) -> Database:
        """The database itself, which `batches.BatchStore` keeps (it queries it within
        `connection`)."""
        return self._db

    def check_size(self, size: int) -> None:
        """Raise ResponseTooLarge when a response of `size` bytes would not be stored."""
        if size > self.response_max_bytes:
            raise ResponseTooLarge(size, self.response_max_bytes)

    async def save(self, response: NewResponse) -> None:
        """Store a finished response and its items (one transaction); ResponseTooLarge, with
        nothing written, past the cap of one response."""
        steps = await self._insert_steps(response)
        async with self._failures("store a response", write=True):
            await self._db.write(steps)

    async def _insert_steps(self, response: NewResponse) -> list[Step]:
        """The statements that store `response` (ResponseTooLarge past the cap of one)."""
        body = orjson.dumps(response.body).decode()
        images: dict[str, str] = {}
        inputs = [
            orjson.dumps(blobs.extract(item, images)).decode() for item in response.input_items
        ]
        outputs = [orjson.dumps(item).decode() for item in _output_items(response.body)]
        rows = [
            (response.id, position, str(item.get("id", "")), response.scope, text)
            for position, (item, text) in enumerate(
                zip(
                    [*response.input_items, *_output_items(response.body)],
                    [*inputs, *outputs],
                    strict=True,
                )
            )
        ]
        size = len(body) + sum(len(text) for text in inputs) + sum(len(text) for text in outputs)
        self.check_size(size + sum(len(data) for data in images.values()))
        async with self._failures("read stored images"):
            await self._prepare()
            stored = await self._stored_blobs(response.scope, images)
        # A blob counts once in its scope: in the response that stored it first.
        size += sum(len(data) for digest, data in images.items() if digest not in stored)
        steps = [
            Step(
                "INSERT INTO responses (id, scope, created_at, previous_response_id, "
                "input_count, bytes, body) VALUES (?, ?, ?, ?, ?, ?, ?)",
                (
                    response.id,
                    response.scope,
                    response.created_at,
                    response.previous_response_id,
                    len(inputs),
                    size,
                    body,
                ),
            )
        ]
        if rows:
            steps.append(
                Step(
                    "INSERT INTO items (response_id, position, item_id, scope, body) "
                    "VALUES (?, ?, ?, ?, ?)",
                    rows,
                    many=True,
                )
            )
        if images:
            steps += [
                Step(
                    "INSERT INTO blobs (scope, hash, data) VALUES (?, ?, ?) "
                    "ON CONFLICT (scope, hash) DO NOTHING",
                    [(response.scope, digest, data) for digest, data in images.items()],
                    many=True,
                ),
                Step(
                    "INSERT INTO response_blobs (response_id, scope, hash) VALUES (?, ?, ?)",
                    [(response.id, response.scope, digest) for digest in images],
                    many=True,
                ),
            ]
        return steps

    async def start_background(
        self, response: NewResponse, owner: str, events: Sequence[tuple[int, str]] = ()
    ) -> None:
        """Store a background response as it starts (its input items, no output yet, the
        first `events` of its stream), run by `owner` (a process: `heartbeat` says it still
        runs it)."""
        steps = await self._insert_steps(response)
        steps.append(
            Step(
                "INSERT INTO background_runs (response_id, scope, owner, heartbeat_at) "
                "VALUES (?, ?, ?, ?)",
                (response.id, response.scope, owner, time.time()),
            )
        )
        if events:
            steps.append(
                Step(
                    "INSERT INTO response_events (response_id, sequence_number, body) "
                    "VALUES (?, ?, ?)",
                    [(response.id, number, text) for number, text in events],
                    many=True,
                )
            )
        async with self._failures("store a background response", write=True):
            await self._db.write(steps)

    async def record_progress(
        self, response_id: str, body: dict[str, Any] | None, events: Sequence[tuple[int, str]]
    ) -> None:
        """Append a background response's stream events (sequence number, JSON) and, with
        `body`, replace its response object (its status), in one transaction."""
        steps = []
        added = sum(len(text) for _, text in events)
        if body is not None:
            text = orjson.dumps(body).decode()
            added += len(text)
            steps.append(Step("UPDATE responses SET body = ? WHERE id = ?", (text, response_id)))
        if events:
            # Only while it runs: a response deleted or evicted meanwhile keeps no events.
            steps.append(
                Step(
                    "INSERT INTO response_events (response_id, sequence_number, body) "
                    "SELECT ?, ?, ? WHERE EXISTS (SELECT 1 FROM background_runs "
                    "WHERE response_id = ?) ON CONFLICT (response_id, sequence_number) DO NOTHING",
                    [(response_id, number, text, response_id) for number, text in events],
                    many=True,
                )
            )
        if not steps:
            return
        steps.append(
            Step("UPDATE responses SET bytes = bytes + ? WHERE id = ?", (added, response_id))
        )
        async with self._failures("record a background response's progress", write=True):
            await self._db.write(steps)

    async def claim_run(self, response_id: str, owner: str, *, stale_before: float) -> bool:
        """Take the run of a background response for `owner`: when `owner` runs it already
        (its lease renewed), or its owner's last heartbeat is older than `stale_before` (a
        process that died). False when the run is gone (ended, deleted) or another process
        holds it."""
        async with self._failures("claim a background response", write=True):
            await self._prepare()
            changed = await self._db.write(
                [
                    Step(
                        "UPDATE background_runs SET owner = ?, heartbeat_at = ? "
                        "WHERE response_id = ? AND (owner = ? OR heartbeat_at < ?)",
                        (owner, time.time(), response_id, owner, stale_before),
                    )
                ]
            )
        return changed[0] > 0

    async def finish_background(
        self, response_id: str, scope: str, body: dict[str, Any], events: Sequence[tuple[int, str]]
    ) -> None:
        """A background response ended: its last events, its final object and output items;
        its run is over. Call it after `claim_run` (this writes whatever the run holds)."""
        outputs = [orjson.dumps(item).decode() for item in _output_items(body)]
        text = orjson.dumps(body).decode()
        added = len(text) + sum(len(item) for item in outputs)
        added += sum(len(event) for _, event in events)
        async with self._failures("finish a background response", write=True):
            await self._prepare()
            found = await self._db.fetch(
                "SELECT input_count FROM responses WHERE id = ?", (response_id,)
            )
            if not found:
                return  # deleted meanwhile
            first = int(found[0][0])
            steps = [
                Step(
                    "UPDATE responses SET body = ?, bytes = bytes + ? WHERE id = ?",
                    (text, added, response_id),
                ),
                Step("DELETE FROM background_runs WHERE response_id = ?", (response_id,)),
            ]
            if outputs:
                steps.append(
                    Step(
                        "INSERT INTO items (response_id, position, item_id, scope, body) "
                        "VALUES (?, ?, ?, ?, ?) ON CONFLICT (response_id, position) DO NOTHING",
                        [
                            (response_id, first + index, str(item.get("id", "")), scope, row)
                            for index, (item, row) in enumerate(
                                zip(_output_items(body), outputs, strict=True)
                            )
                        ],
                        many=True,
                    )
                )
            if events:
                steps.append(
                    Step(
                        "INSERT INTO response_events (response_id, sequence_number, body) "
                        "VALUES (?, ?, ?) ON CONFLICT (response_id, sequence_number) DO NOTHING",
                        [(response_id, number, event) for number, event in events],
                        many=True,
                    )
                )
            await self._db.write(steps)

    async def heartbeat(self, owner: str) -> None:
        """`owner` still runs its background responses."""
        async with self._failures("renew background runs", write=True):
            await self._prepare()
            await self._db.write(
                [
                    Step(
                        "UPDATE background_runs SET heartbeat_at = ? WHERE owner = ?",
                        (time.time(), owner),
                    )
                ]
            )

    async def request_cancel(self, response_id: str) -> bool:
        """Ask the process running a background response to cancel it (`runs_of`);
        False when it runs no more."""
        async with self._failures("cancel a background response", write=True):
            await self._prepare()
            changed = await self._db.write(
                [
                    Step(
                        "UPDATE background_runs SET cancel_requested = 1 WHERE response_id = ?",
                        (response_id,),
                    )
                ]
            )
        return changed[0] > 0

    async def runs_of(self, owner: str) -> dict[str, bool]:
        """The background responses `owner` runs, each with whether it was asked to be
        cancelled (a run missing here was deleted, evicted, or taken for dead)."""
        async with self._failures("read background runs"):
            await self._prepare()
            rows = await self._db.fetch(
                "SELECT response_id, cancel_requested FROM background_runs WHERE owner = ?",
                (owner,),
            )
        return {str(found): bool(asked) for found, asked in rows}

    async def last_event(self, response_id: str) -> int | None:
        """The sequence number of a response's last stored event (None: it has none)."""
        async with self._failures("read a response's events"):
            await self._prepare()
            rows = await self._db.fetch(
                "SELECT MAX(sequence_number) FROM response_events WHERE response_id = ?",
                (response_id,),
            )
        return None if not rows or rows[0][0] is None else int(rows[0][0])

    async def stale_runs(self, stale_before: float) -> list[tuple[str, str]]:
        """(response ID, scope) of the background runs whose owner's last heartbeat is older
        than `stale_before`."""
        async with self._failures("list background runs"):
            await self._prepare()
            rows = await self._db.fetch(
                "SELECT response_id, scope FROM background_runs WHERE heartbeat_at < ?",
                (stale_before,),
            )
        return [(str(found), str(scope)) for found, scope in rows]

    async def events_after(
        self, response_id: str, after: int, limit: int = 1000
    ) -> list[tuple[int, str]]:
        """A background response's stored stream events past sequence number `after`, in
        order (at most `limit`)."""
        async with self._failures("read a response's events"):
            await self._prepare()
            rows = await self._db.fetch(
                "SELECT sequence_number, body FROM response_events WHERE response_id = ? "
                "AND sequence_number > ? ORDER BY sequence_number LIMIT ?",
                (response_id, after, limit),
            )
        return [(int(number), str(body)) for number, body in rows]

    async def _stored_blobs(self, scope: str, wanted: Collection[str]) -> dict[str, str]:
        """The blobs of this scope with these hashes that are stored (by hash)."""
        if not wanted:
            return {}
        ordered = sorted(wanted)
        rows = await self._db.fetch(
            "SELECT hash, data FROM blobs WHERE scope = ? AND hash IN ("
            + ", ".join("?" * len(ordered))
            + ")",
            (scope, *ordered),
        )
        return {str(digest): str(data) for digest, data in rows}

    async def _inflated(self, scope: str, items: list[Item]) -> list[Item]:
        """The items with their images' data URLs back in place of references."""
        wanted: set[str] = set()
        for item in items:
            blobs.references(item, wanted)
        if not wanted:
            return items
        found = await self._stored_blobs(scope, wanted)
        return [blobs.inflate(item, found) for item in items]

    async def response(self, scope: str, response_id: str) -> StoredResponse | None:
        """The response, or None when it is not stored for this scope (or expired)."""
        async with self._failures("read a response"):
            await self._prepare()
            rows = await self._db.fetch(
                "SELECT r.id, r.created_at, r.previous_response_id, r.body, b.heartbeat_at "
                "FROM responses r LEFT JOIN background_runs b ON b.response_id = r.id "
                "WHERE r.id = ? AND r.scope = ? AND r.created_at >= ?",
                (response_id, scope, self._oldest()),
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
        oldest = self._oldest()
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
            return await self._inflated(scope, [orjson.loads(row[2]) for row in rows])

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
                (scope, self._oldest(), *wanted),
            )
            found = {item_id: orjson.loads(body) for item_id, body in rows}
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
                (response_id, scope, self._oldest()),
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
            items = await self._inflated(scope, [orjson.loads(row[0]) for row in rows[:limit]])
        return ItemPage(items, has_more=len(rows) > limit)

    async def delete(self, scope: str, response_id: str) -> bool:
        """Delete the response and its items; False when it is not stored for this scope."""
        async with self._failures("delete a response", write=True):
            await self._prepare()
            changed = await self._db.write(
                frees=True,
                steps=[
                    *(
                        Step(
                            f"DELETE FROM {table} WHERE response_id IN (SELECT id FROM "
                            "responses WHERE id = ? AND scope = ? AND created_at >= ?)",
                            (response_id, scope, self._oldest()),
                        )
                        for table in _RESPONSE_TABLES
                    ),
                    Step(
                        "DELETE FROM responses WHERE id = ? AND scope = ? AND created_at >= ?",
                        (response_id, scope, self._oldest()),
                    ),
                    Step(_ORPHAN_BLOBS),
                ],
            )
        return changed[-2] > 0

    async def evict(self) -> int:
        """Delete expired responses, then each scope's oldest while it exceeds its cap (the
        scope's own, or the level the whole store's cap sets, `fair_level`); the number of
        responses deleted."""
        async with self._failures("evict old responses", write=True):
            await self._prepare()
            deleted = await self._delete_before(self._oldest(), None)
            rows = await self._db.fetch(
                "SELECT scope, SUM(bytes) FROM responses GROUP BY scope", ()
            )
            usage = {str(scope): int(size) for scope, size in rows}
            level = min(self.scope_max_bytes, fair_level(usage, self.max_bytes))
            for scope in sorted(scope for scope, size in usage.items() if size > level):
                cutoff = await self._db.fetch(_SIZE_CUTOFF, (scope, level))
                if cutoff:
                    created_at, last = cutoff[0]
                    deleted += await self._delete_before(float(created_at), str(last), scope)
        if deleted:
            logger.info("response store: evicted %d response(s)", deleted)
        return deleted

    async def evict_periodically(self, interval: float) -> None:
        """`evict()` now and then every `interval` seconds, until cancelled (a failure is
        logged and tried again next time)."""
        while True:
            with contextlib.suppress(StoreUnavailableError):
                await self.evict()
            await asyncio.sleep(interval)

    async def _delete_before(
        self, created_at: float, last: str | None, scope: str | None = None
    ) -> int:
        """Delete responses older than `created_at` (and, with `last`, those created at that
        time whose ID sorts up to `last`), of one scope or of all."""
        where = "created_at < ?"
        params: tuple[Any, ...] = (created_at,)
        if last is not None:
            where += " OR (created_at = ? AND id <= ?)"
            params = (created_at, created_at, last)
        if scope is not None:
            where = f"scope = ? AND ({where})"
            params = (scope, *params)
        owned = f"response_id IN (SELECT id FROM responses WHERE {where})"
        changed = await self._db.write(
            [
                *(Step(f"DELETE FROM {table} WHERE {owned}", params) for table in _RESPONSE_TABLES),
                Step(f"DELETE FROM responses WHERE {where}", params),
                Step(_ORPHAN_BLOBS),
            ],
            frees=True,
        )
        return changed[-2]

    def _oldest(self) -> float:
        """The creation time of the oldest response still alive."""
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
                    + ", ".join("?" * len(_UPGRADES))
                    + ")",
                    (SCHEMA_VERSION, "schema_version", *sorted(_UPGRADES)),
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

    async def _read_salt(self) -> bytes:
        rows = await self._db.fetch("SELECT value FROM store_meta WHERE name = ?", ("scope_salt",))
        return bytes.fromhex(rows[0][0])

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


def _output_items(body: dict[str, Any]) -> list[Item]:
    output = body.get("output")
    return [item for item in output if isinstance(item, dict)] if isinstance(output, list) else []
