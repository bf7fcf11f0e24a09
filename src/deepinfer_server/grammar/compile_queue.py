"""FairCompileQueue: the compile workers taken in turn by API keys, each key's backlog bounded.

One key's grammars must not hold up another key's: every compile waits here, in its key's own
line, and a free worker goes to the next key in turn (round-robin between the keys that have
something waiting), so a key with one grammar never waits behind another key's backlog (the next
free worker goes to the key whose last turn is the oldest, a key new to the queue first:
`fair_turns.FairTurns`, as the preparation gate's). A key that already has a compile running
never takes the last free worker: that one is kept for a key with none running, so one key's
heavy grammars hold at most all the workers but one, and another key's grammar starts at once
instead of waiting for one of them to end. A key holds at most `per_key` compiles (waiting or
running): past that it is refused at once (`CompileRefused(per_key=True)`, a 429). A compile
that finds no free worker within `wait_s` is refused too (a 503): the server is out of compile
capacity for now, which is not the grammar's fault. Waiting holds no thread: a compile runs on
one of `slots` threads, only once a worker is ready for it (`ready()`), so compiles queued
behind a worker that is being replaced wait here, in turn, rather than on a thread.

The keys are opaque names of the API keys' tenants (`api.auth.tenant_of`), never the keys.
One event loop.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

from deepinfer_server.fair_turns import FairTurns
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
        self._turns = FairTurns(self._dispatch)
        self._refused_per_key = 0
        self._refused_busy = 0

    def stats(self) -> QueueStats:
        """How many compiles wait and run, how many were refused, how many workers are ready."""
        return QueueStats(
            self._turns.waiting,
            self._turns.running,
            self._refused_per_key,
            self._refused_busy,
            self._ready(),
        )

    def worker_ready(self) -> None:
        """A worker became ready (callable from any thread): start what waits for one."""
        self._turns.wake_threadsafe()

    async def run(self, key: str, job: Callable[[], T]) -> T:
        """Run `job` on a compile thread in `key`'s turn; CompileRefused past the bounds."""
        if self._turns.held_by(key) >= self._limits.per_key:
            self._refused_per_key += 1
            raise CompileRefused(
                f"this API key already has {self._limits.per_key} grammars compiling or waiting "
                "to compile; retry once they are done",
                self._retry_after,
                per_key=True,
            )
        if not await self._turns.wait_turn(key, self._limits.wait_s):
            self._refused_busy += 1
            raise CompileRefused(
                f"no grammar compile worker was free within {self._limits.wait_s:g} s; retry later",
                self._retry_after,
            )
        return await self._turns.run(key, self._threads, job)

    def close(self) -> None:
        """Stop taking compiles (those running finish on their threads)."""
        self._threads.shutdown(wait=False, cancel_futures=True)

    def _dispatch(self) -> None:
        """Give free workers their next compiles, in turn between keys: the last free one only
        goes to a key with none running, so that one key's compiles never hold every worker
        while another's wait."""
        capacity = min(self._slots, self._ready())
        while self._turns.running < capacity:
            last_free = self._turns.running + 1 >= capacity
            if not self._turns.start_next(self._turns.idle if last_free else None):
                return
