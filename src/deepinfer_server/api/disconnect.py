"""Running a non-streaming request until it completes or its client disconnects."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine
from typing import Any, TypeVar

from starlette.types import Receive

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The client closed the connection before the response was ready."""


async def wait_for_disconnect(receive: Receive) -> None:
    """Return once the client has disconnected (the request body must be consumed already)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnect(receive: Receive, work: Coroutine[Any, Any, T]) -> T:
    """Await `work`; if the client disconnects first, cancel it and raise ClientDisconnected."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    raise ClientDisconnected()
