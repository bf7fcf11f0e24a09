"""FairCompileQueue: the compile workers taken in turn by API keys, each key's backlog bounded.

One key's grammars must not hold up another key's: every compile waits here, in its key's own
line, and a free worker goes to the next key in turn (round-robin between the keys that have
something waiting), so a key with one grammar never waits behind another key's backlog (the next
free worker goes to the key whose last turn is the oldest, a key new to the queue first). A key
that already has a compile running never takes the last free worker: that one is kept for a key
with none running, so one key's heavy grammars hold at most all the workers but one, and another
key's grammar starts at once instead of waiting for one of them to end. A key holds at most
`per_key` compiles (waiting or running): past that it is refused at once
(`CompileRefused(per_key=True)`, a 429). A compile
that finds no free worker within `wait_s` is refused too (a 503): the server is out of compile
capacity for now, which is not the grammar's fault. Waiting holds no thread: a compile runs on
one of `slots` threads, only once a worker is ready for it (`ready()`), so compiles queued
behind a worker that is being replaced wait here, in turn, rather than on a thread.

The keys are opaque names of the API keys' tenants (`api.auth.tenant_of`), never the keys.
One event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

from deepinfer_server.grammar.errors import CompileRefused

T = TypeVar("T")


@dataclass(frozen=True)
class QueueLimits:
    """The queue's bounds; the docs (structured output, "Fair compilation") state the
    defaults."""

    #: Compiles one API key may have waiting or running at once (429 past it).
    per_key: int = 8
    #: Seconds a compile may wait for a worker before it is refused with a 503.
    wait_s: float = 60.0


@dataclass(frozen=True)
class QueueStats:
    """The queue as metrics read it."""

    waiting: int
    running: int
    refused_per_key: int
    refused_busy: int
    #: Compile workers started and alive (0 while they are prepared, after start-up).
    workers_ready: int


class FairCompileQueue:
    """Runs blocking compile jobs `slots` at a time, in turn between keys (see the module)."""

    def __init__(
        self,
        slots: int,
        ready: Callable[[], int],
        limits: QueueLimits,
        retry_after_s: float,
    ) -> None:
        self._slots = slots
        self._ready = ready
        self._limits = limits
        self._retry_after = max(1, math.ceil(retry_after_s))
        self._threads = ThreadPoolExecutor(slots, thread_name_prefix="grammar-compile")
        #: Each key's waiting compiles, and when each key holding compiles last had its turn.
        self._lines: dict[str, deque[asyncio.Future[None]]] = {}
        self._turns: dict[str, int] = {}
        self._turn_count = 0
        self._held: Counter[str] = Counter()
        #: Each key's compiles running now.
        self._running_by_key: Counter[str] = Counter()
        self._running = 0
        self._refused_per_key = 0
        self._refused_busy = 0
        self._loop: asyncio.AbstractEventLoop | None = None

    def stats(self) -> QueueStats:
        """How many compiles wait and run, how many were refused, how many workers are ready."""
        waiting = sum(len(line) for line in self._lines.values())
        return QueueStats(
            waiting, self._running, self._refused_per_key, self._refused_busy, self._ready()
        )

    def worker_ready(self) -> None:
        """A worker became ready (callable from any thread): start what waits for one."""
        loop = self._loop
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(self._dispatch)

    async def run(self, key: str, job: Callable[[], T]) -> T:
        """Run `job` on a compile thread in `key`'s turn; CompileRefused past the bounds."""
        self._loop = asyncio.get_running_loop()
        if self._held[key] >= self._limits.per_key:
            self._refused_per_key += 1
            raise CompileRefused(
                f"this API key already has {self._limits.per_key} grammars compiling or waiting "
                "to compile; retry once they are done",
                self._retry_after,
                per_key=True,
            )
        self._held[key] += 1
        turn: asyncio.Future[None] = self._loop.create_future()
        self._lines.setdefault(key, deque()).append(turn)
        self._dispatch()
        try:
            await asyncio.wait({turn}, timeout=self._limits.wait_s)
        except asyncio.CancelledError:
            self._leave(key, turn)
            raise
        if not turn.done():
            self._leave(key, turn)
            self._refused_busy += 1
            raise CompileRefused(
                f"no grammar compile worker was free within {self._limits.wait_s:g} s; retry later",
                self._retry_after,
            )
        work = self._threads.submit(job)
        # The slot is the thread's until the job returns, even if this request goes first.
        work.add_done_callback(lambda _: self._finished_threadsafe(key))
        return await asyncio.wrap_future(work)

    def close(self) -> None:
        """Stop taking compiles (those running finish on their threads)."""
        self._threads.shutdown(wait=False, cancel_futures=True)

    def _dispatch(self) -> None:
        capacity = min(self._slots, self._ready())
        while self._running < capacity:
            key = self._next_key(capacity)
            if key is None:
                return
            line = self._lines[key]
            turn = line.popleft()
            if not line:
                del self._lines[key]
            self._turn_count += 1
            self._turns[key] = self._turn_count
            turn.set_result(None)
            self._running += 1
            self._running_by_key[key] += 1

    def _next_key(self, capacity: int) -> str | None:
        """The waiting key whose turn came longest ago (a key new to the queue first) among
        those that may take a worker now: the last free one only goes to a key with none
        running, so that one key's compiles never hold every worker while another's wait."""
        last_free = self._running + 1 >= capacity
        eligible = [k for k in self._lines if not (last_free and self._running_by_key[k])]
        if not eligible:
            return None
        return min(eligible, key=lambda k: self._turns.get(k, 0))

    def _leave(self, key: str, turn: asyncio.Future[None]) -> None:
        """A compile leaves before its job ran (refused or its request gone)."""
        if turn.done():  # its turn had come: the slot is given back
            self._stopped(key)
        else:
            turn.cancel()
            line = self._lines.get(key)
            if line is not None:
                line.remove(turn)
                if not line:
                    del self._lines[key]
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
        """One of `key`'s compiles stopped running."""
        self._running -= 1
        self._running_by_key[key] -= 1
        if self._running_by_key[key] <= 0:
            del self._running_by_key[key]

    def _release(self, key: str) -> None:
        self._held[key] -= 1
        if self._held[key] <= 0:
            del self._held[key]
            self._turns.pop(key, None)
