"""PreparationGate: large requests are prepared off the event loop, a few at a time, in turn
between API keys.

Converting and tokenizing a large prompt costs CPU seconds. It runs on worker threads, at most
`workers` at once, and it counts under admission: while the requests in flight plus those being
prepared fill the admission capacity, another large request gets a 429 instead of queueing CPU
work without bound. The workers are the gate's own threads, not the event loop's default
executor, where DNS lookups (image URL fetches) and other blocking calls wait: none of those can
hold up a preparation. Nothing that waits on the network runs here (`api.image_urls`).

The workers are taken in turn between API keys (`fair_lines.FairLines`, as the grammar compile
queue's): a key with one preparation waits behind at most those already running, never behind
another key's backlog. Past the `workers`, `spare` more are kept for keys with nothing being
prepared: a preparation of seconds (a body of megabytes) holding every worker does not make
another key's request wait for it to end. On a server with several keys, a key holds at most
`per_key` preparations (waiting or running): past that, that key alone gets a 429.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from deepinfer_server.errors import OverloadedError
from deepinfer_server.fair_lines import FairLines

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
        self._lines: FairLines[asyncio.Future[None]] = FairLines()
        #: Each key's preparations waiting or running, and running.
        self._held: Counter[str] = Counter()
        self._running: Counter[str] = Counter()
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def pending(self) -> int:
        """Preparations waiting or running."""
        return self._held.total()

    async def run(self, in_flight: int, capacity: int, work: Callable[[], T], key: str = "") -> T:
        """`work()` on a worker thread in `key`'s turn; 429 when `in_flight` plus pending fill
        `capacity`, or when `key` already holds `per_key` preparations."""
        self._check(in_flight, capacity, key)
        self._loop = asyncio.get_running_loop()
        self._held[key] += 1
        turn: asyncio.Future[None] = self._loop.create_future()
        self._lines.push(key, turn)
        self._dispatch()
        try:
            await turn
        except asyncio.CancelledError:
            self._leave(key, turn)
            raise
        # As asyncio.to_thread does: the request's context (FETCHED_IMAGES) goes along.
        context = contextvars.copy_context()
        job = self._threads.submit(context.run, work)
        # The slot is the thread's until the work returns, even if this request goes first.
        job.add_done_callback(lambda _: self._finished_threadsafe(key))
        return await asyncio.wrap_future(job)

    def _check(self, in_flight: int, capacity: int, key: str) -> None:
        if in_flight + self.pending >= capacity:
            raise OverloadedError(
                f"the server is at capacity ({capacity} requests in flight or being prepared); "
                "retry later"
            )
        if self._per_key is not None and self._held[key] >= self._per_key:
            raise OverloadedError(
                f"this API key already has {self._per_key} large requests being prepared or "
                "waiting to be; retry once they are done"
            )

    def _dispatch(self) -> None:
        while True:
            running = self._running.total()
            if running < self._slots:
                taken = self._lines.pop()
            elif running < self._slots + self._spare:
                taken = self._lines.pop(lambda key: self._running[key] == 0)
            else:
                return
            if taken is None:
                return
            key, turn = taken
            turn.set_result(None)
            self._running[key] += 1

    def _leave(self, key: str, turn: asyncio.Future[None]) -> None:
        """A preparation leaves before its work ran (its request gone)."""
        if not self._lines.remove(key, turn):  # its turn had come: the slot is given back
            self._stopped(key)
        self._release(key)
        self._dispatch()

    def _finished_threadsafe(self, key: str) -> None:
        loop = self._loop
        assert loop is not None
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            loop.call_soon_threadsafe(self._finished, key)

    def _finished(self, key: str) -> None:
        self._stopped(key)
        self._release(key)
        self._dispatch()

    def _stopped(self, key: str) -> None:
        self._running[key] -= 1
        if self._running[key] <= 0:
            del self._running[key]

    def _release(self, key: str) -> None:
        self._held[key] -= 1
        if self._held[key] <= 0:
            del self._held[key]
            self._lines.forget(key)
