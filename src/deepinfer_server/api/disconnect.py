"""until_disconnect: run work until it completes or the client disconnects (one mechanism)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine
from typing import Any, TypeVar

from starlette.types import Receive

from deepinfer_server.errors import ClientDisconnected

T = TypeVar("T")

#: Set in `scope["state"]` when the client left after the response started (its status, 200,
#: is sent by then): the access log reports such a request as 499.
CLIENT_LEFT = "client_left"


async def wait_for_disconnect(receive: Receive) -> None:
    """Return once the client has disconnected (the request body must be consumed already)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnect(receive: Receive, work: Coroutine[Any, Any, T]) -> T:
    """Await `work`; if the client disconnects first, cancel it and raise ClientDisconnected.

    Cancelling `work` runs its cleanup (closing the request handle aborts the engine request).
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            raise ClientDisconnected()
    return task.result()
