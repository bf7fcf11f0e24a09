"""The store's view of a SQL database: statements run in one transaction (`Step`), and the
`Database` both backends implement (`sqlite.SqliteDatabase`, `postgres.PostgresDatabase`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class Step:
    """One statement of a write transaction; `many`: `params` is a list of parameter rows."""

    sql: str
    params: Sequence[Any] = ()
    many: bool = False


class Database(Protocol):
    """One SQL database (`sqlite.SqliteDatabase`, `postgres.PostgresDatabase`): `?`
    placeholders, every call asynchronous."""

    #: What the database raises when it fails (unreachable, locked, full, broken).
    errors: tuple[type[BaseException], ...]
    #: For log lines: the database without its credentials.
    description: str

    async def open(self) -> None:
        """Connect (once; later calls do nothing)."""
        ...

    async def fetch(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        """The rows a query returns."""
        ...

    async def write(self, steps: Sequence[Step], *, frees: bool = False) -> list[int]:
        """Run the steps in one transaction; the rows each changed. `frees`: the steps only
        delete, and must succeed on a full disk if the database can make that possible."""
        ...

    async def create_schema(self, statements: Sequence[str]) -> None:
        """Run the schema statements once (safe when several processes start together)."""
        ...

    async def close(self) -> None:
        """Close the connection(s)."""
        ...
