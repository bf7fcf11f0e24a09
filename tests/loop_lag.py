"""A probe of the event loop's lag: a task that wakes every `interval` seconds and records how
late it woke at worst, so that a test can show a heavy request never stalls the loop (every other
request on it waits as long as the loop is held).

    async with LoopLag() as lag:
        await heavy_request()
    lag.check()  # fails when the loop was held longer than `limit` at once

A measurement, not a synchronisation: the test waits for its own work, never for the probe.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from types import TracebackType

#: How often the probe wakes, in seconds.
INTERVAL = 0.01
#: The worst lateness a test tolerates by default, in seconds.
LIMIT = 0.1


class LoopLag:
    """The worst lateness of a task waking every `interval` seconds while the block runs."""

    def __init__(self, interval: float = INTERVAL, limit: float = LIMIT) -> None:
        self.interval = interval
        self.limit = limit
        #: The worst lateness seen so far, in seconds.
        self.worst = 0.0
        #: How many times the probe woke (a probe that never woke measured nothing).
        self.wakes = 0
        self._task: asyncio.Task[None] | None = None
        self._due = 0.0

    async def _probe(self) -> None:
        while True:
            self._due = time.perf_counter() + self.interval
            await asyncio.sleep(self.interval)
            self.worst = max(self.worst, time.perf_counter() - self._due)
            self.wakes += 1

    async def __aenter__(self) -> LoopLag:
        self._task = asyncio.create_task(self._probe())
        await asyncio.sleep(0)  # the probe's first wait starts now, not after the block
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        assert self._task is not None
        # The block may have held the loop until now: the probe, still asleep, is late by this.
        self.worst = max(self.worst, time.perf_counter() - self._due)
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

    def check(self) -> None:
        """Fail when the loop was held longer than `limit` at once."""
        assert self.worst <= self.limit, (
            f"the event loop was held {self.worst * 1000:.0f} ms at once "
            f"(at most {self.limit * 1000:.0f} ms)"
        )
