"""PostgresDatabase: a shared store for replicas behind a router (psycopg 3, asynchronous).

The `store-postgres` extra installs psycopg. Each API server process keeps a small pool of
connections; a connection is checked when handed out, so a database restart costs the requests
in flight at that moment, not the pool. Each statement may run `STATEMENT_TIMEOUT_MS`, and a
request waits at most `CONNECT_TIMEOUT` seconds for a connection: a database that is down fails
the requests that need it with a 503 and nothing else, and the pool reconnects by itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from deepinfer_server.errors import ConfigError
from deepinfer_server.store.database import Step

STATEMENT_TIMEOUT_MS = 5000
CONNECT_TIMEOUT = 5.0
POOL_SIZE = 4
#: pg_advisory_xact_lock key of the schema creation (processes and replicas start together).
_SCHEMA_LOCK = 0x646565707374


def _placeholders(sql: str) -> str:
    """The store's `?` placeholders as psycopg's `%s`."""
    return sql.replace("?", "%s")


class PostgresDatabase:
    """A connection pool of this process to the store's PostgreSQL database."""

    def __init__(self, url: str) -> None:
        try:
            import psycopg
            import psycopg_pool
        except ImportError as exc:
            raise ConfigError(
                "--response-store postgresql://... needs psycopg: pip install "
                "'.[store-postgres]' in the deepinfer-server checkout"
            ) from exc
        self._psycopg = psycopg
        self.errors: tuple[type[BaseException], ...] = (
            psycopg.Error,
            psycopg_pool.PoolTimeout,
            psycopg_pool.PoolClosed,
            OSError,
        )
        self.description = _without_password(url)
        self._pool = psycopg_pool.AsyncConnectionPool(
            url,
            min_size=1,
            max_size=POOL_SIZE,
            timeout=CONNECT_TIMEOUT,
            open=False,
            check=psycopg_pool.AsyncConnectionPool.check_connection,
            kwargs={
                "connect_timeout": int(CONNECT_TIMEOUT),
                "options": f"-c statement_timeout={STATEMENT_TIMEOUT_MS}",
            },
        )
        self._opened = False

    async def open(self) -> None:
        if not self._opened:
            # Without waiting: a database that is down now is retried by the pool, and the
            # requests that need it meanwhile get a 503.
            await self._pool.open(wait=False)
            self._opened = True

    async def fetch(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        async with self._pool.connection() as connection:
            cursor = await connection.execute(_placeholders(sql), tuple(params))
            return [tuple(row) for row in await cursor.fetchall()]

    async def write(self, steps: Sequence[Step], *, frees: bool = False) -> list[int]:
        changed = []
        async with self._pool.connection() as connection, connection.transaction():
            for step in steps:
                cursor = connection.cursor()
                if step.many:
                    await cursor.executemany(_placeholders(step.sql), step.params)
                else:
                    await cursor.execute(_placeholders(step.sql), tuple(step.params))
                changed.append(cursor.rowcount)
        return changed

    async def create_schema(self, statements: Sequence[str]) -> None:
        async with self._pool.connection() as connection, connection.transaction():
            await connection.execute("SELECT pg_advisory_xact_lock(%s)", (_SCHEMA_LOCK,))
            for statement in statements:
                await connection.execute(statement)

    async def close(self) -> None:
        if self._opened:
            await self._pool.close()


def _without_password(url: str) -> str:
    """The URL for log lines: its password replaced by `***`."""
    scheme, sep, rest = url.partition("://")
    credentials, at, host = rest.rpartition("@")
    if not sep or not at or ":" not in credentials:
        return url
    user = credentials.split(":", 1)[0]
    return f"{scheme}://{user}:***@{host}"
