"""PreparationGate: large requests are prepared off the event loop, a few at a time, in turn
between API keys.

Converting and tokenizing a large prompt costs CPU seconds. It runs on worker threads, at most
`workers` at once, and it counts under admission: while the requests in flight plus those being
prepared fill the admission capacity, another large request gets a 429 instead of queueing CPU
work without bound. The workers are the gate's own threads, not the event loop's default
executor, where DNS lookups (image URL fetches) and other blocking calls wait: none of those can
hold up a preparation. Nothing that waits on the network runs here (`api.image_urls`).

The workers are taken in turn between API keys (`fair_turns.FairTurns`, as the grammar compile
queue's): a key with one preparation waits behind at most those already running, never behind
another key's backlog. Past the `workers`, `spare` more are kept for keys with nothing being
prepared: a preparation of seconds (a body of megabytes) holding every worker does not make
another key's request wait for it to end. On a server with several keys, a key holds at most
`per_key` preparations (waiting or running): past that, that key alone gets a 429.
"""

from __future__ import annotations

import contextvars
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from deepinfer_server.errors import OverloadedError
from deepinfer_server.fair_turns import FairTurns

T = TypeVar("T")

#: Large bodies prepared at once (the rest wait, within admission).
PREPARATION_WORKERS = 2
#: Workers past those kept for keys with nothing being prepared.
SPARE_WORKERS = 1
#: Preparations one API key may hold (waiting or running) on a server with several keys.
PER_KEY_PREPARATIONS = 8


class PreparationGate:
    """Bounded, admission-counted preparation of large requests on worker threads, fair
    between keys."""

    def __init__(
        self,
        workers: int = PREPARATION_WORKERS,
        per_key: int | None = None,
        spare: int = SPARE_WORKERS,
    ) -> None:
        self._slots = workers
        self._spare = spare
        self._per_key = per_key
        self._threads = ThreadPoolExecutor(workers + spare, thread_name_prefix="preparation")
        self._turns = FairTurns(self._dispatch)

    @property
    def pending(self) -> int:
        """Preparations waiting or running."""
        return self._turns.held

    async def run(self, in_flight: int, capacity: int, work: Callable[[], T], key: str = "") -> T:
        """`work()` on a worker thread in `key`'s turn; 429 when `in_flight` plus pending fill
        `capacity`, or when `key` already holds `per_key` preparations."""
        self._check(in_flight, capacity, key)
        await self._turns.wait_turn(key)
        # As asyncio.to_thread does: the request's context (FETCHED_IMAGES) goes along.
        context = contextvars.copy_context()
        return await self._turns.run(key, self._threads, functools.partial(context.run, work))

    def _check(self, in_flight: int, capacity: int, key: str) -> None:
        if in_flight + self.pending >= capacity:
            raise OverloadedError(
                f"the server is at capacity ({capacity} requests in flight or being prepared); "
                "retry later"
            )
        if self._per_key is not None and self._turns.held_by(key) >= self._per_key:
            raise OverloadedError(
                f"this API key already has {self._per_key} large requests being prepared or "
                "waiting to be; retry once they are done"
            )

    def _dispatch(self) -> None:
        eligible: Callable[[str], bool] | None
        while True:
            running = self._turns.running
            if running < self._slots:
                eligible = None
            elif running < self._slots + self._spare:
                eligible = self._turns.idle
            else:
                return
            if not self._turns.start_next(eligible):
                return
