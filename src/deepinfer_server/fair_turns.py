"""FairTurns: a few worker threads taken in turn between keys, each key's work counted.

What the preparation gate (`api.preparation_gate`) and the grammar compile queue
(`grammar.compile_queue`) share. Each piece of work waits for its turn in its key's line
(`fair_lines.FairLines`); each key's work held (waiting or running) and running is counted; the
work leaves its line before its turn (its request gone, or it waited too long), or it runs on a
worker thread, which keeps its slot until the work returns, even if its request goes first.

The owner decides how many slots there are and which keys may take a free one: its `dispatch`
(called whenever a slot may have come free) gives turns with `start_next` while it has slots.
One event loop; `wake_threadsafe` from any thread.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Executor
from typing import TypeVar

from deepinfer_server.fair_lines import FairLines

T = TypeVar("T")


class FairTurns:
    """Turns on worker threads, fair between keys, with each key's held and running counts."""

    def __init__(self, dispatch: Callable[[], None]) -> None:
        self._dispatch = dispatch
        self._lines: FairLines[asyncio.Future[None]] = FairLines()
        #: Each key's work waiting or running, and running.
        self._held: Counter[str] = Counter()
        self._running: Counter[str] = Counter()
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def held(self) -> int:
        """Work waiting or running, over every key."""
        return self._held.total()

    @property
    def waiting(self) -> int:
        """Work waiting for its turn, over every key."""
        return len(self._lines)

    @property
    def running(self) -> int:
        """Work running, over every key."""
        return self._running.total()

    def held_by(self, key: str) -> int:
        """`key`'s work waiting or running."""
        return self._held[key]

    def idle(self, key: str) -> bool:
        """Whether `key` has nothing running."""
        return self._running[key] == 0

    async def wait_turn(self, key: str, timeout: float | None = None) -> bool:
        """Wait in `key`'s line until `start_next` gives this work its turn: True then, False
        when `timeout` passed first (it left its line); cancelled, it leaves its line."""
        self._loop = asyncio.get_running_loop()
        self._held[key] += 1
        turn: asyncio.Future[None] = self._loop.create_future()
        self._lines.push(key, turn)
        self._dispatch()
        try:
            # Not `await turn`: a cancelled request must not cancel a turn still in its line.
            await asyncio.wait({turn}, timeout=timeout)
        except asyncio.CancelledError:
            self._leave(key, turn)
            raise
        if not turn.done():
            self._leave(key, turn)
            return False
        return True

    async def run(self, key: str, threads: Executor, job: Callable[[], T]) -> T:
        """`job` on `threads`, once `wait_turn` gave `key` its turn."""
        work = threads.submit(job)
        # The slot is the thread's until the job returns, even if this request goes first.
        work.add_done_callback(lambda _: self._finished_threadsafe(key))
        return await asyncio.wrap_future(work)

    def start_next(self, eligible: Callable[[str], bool] | None = None) -> bool:
        """Give the next turn (`FairLines.pop`, among the keys `eligible` accepts when given)
        and count it running; False when nothing (eligible) waits."""
        taken = self._lines.pop(eligible)
        if taken is None:
            return False
        key, turn = taken
        turn.set_result(None)
        self._running[key] += 1
        return True

    def wake_threadsafe(self) -> None:
        """Call the owner's `dispatch` on the loop (callable from any thread)."""
        loop = self._loop
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(self._dispatch)

    def _leave(self, key: str, turn: asyncio.Future[None]) -> None:
        """Work leaves before it ran (refused or its request gone)."""
        turn.cancel()
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
        """One of `key`'s works stopped running."""
        self._running[key] -= 1
        if self._running[key] <= 0:
            del self._running[key]

    def _release(self, key: str) -> None:
        self._held[key] -= 1
        if self._held[key] <= 0:
            del self._held[key]
            self._lines.forget(key)
