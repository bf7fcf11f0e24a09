"""PreparationGate: large request bodies are prepared off the event loop, a few at a time.

Converting and tokenizing a large prompt costs CPU seconds. It runs on worker threads, at most
`workers` at once, and it counts under admission: while the requests in flight plus those being
prepared fill the admission capacity, another large request gets a 429 instead of queueing CPU
work without bound. The workers are the gate's own threads, not the event loop's default
executor, where DNS lookups (image URL fetches) and other blocking calls wait: none of those can
hold up a preparation. Nothing that waits on the network runs here (`api.image_urls`).
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from deepinfer_server.errors import OverloadedError

T = TypeVar("T")

#: Large bodies prepared at once (the rest wait, within admission).
PREPARATION_WORKERS = 2


class PreparationGate:
    """Bounded, admission-counted preparation of large bodies on worker threads."""

    def __init__(self, workers: int = PREPARATION_WORKERS) -> None:
        self._workers = asyncio.Semaphore(workers)
        self._threads = ThreadPoolExecutor(workers, thread_name_prefix="preparation")
        self.pending = 0

    async def run(self, in_flight: int, capacity: int, work: Callable[[], T]) -> T:
        """`work()` on a worker thread; 429 when `in_flight` plus pending fill `capacity`."""
        if in_flight + self.pending >= capacity:
            raise OverloadedError(
                f"the server is at capacity ({capacity} requests in flight or being prepared); "
                "retry later"
            )
        self.pending += 1
        try:
            async with self._workers:
                # As asyncio.to_thread does: the request's context (FETCHED_IMAGES) goes along.
                context = contextvars.copy_context()
                loop = asyncio.get_running_loop()
                return await loop.run_in_executor(self._threads, context.run, work)
        finally:
            self.pending -= 1
