"""The one way the server waits for whichever of several things happens first."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any


async def first_of(*awaitables: Awaitable[Any], timeout: float | None = None) -> bool:
    """Wait until the first of `awaitables` completes, or `timeout` seconds pass; the others
    are cancelled either way. True when one completed, False on the timeout."""
    tasks = [asyncio.ensure_future(awaitable) for awaitable in awaitables]
    try:
        done, _ = await asyncio.wait(tasks, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
    return bool(done)
