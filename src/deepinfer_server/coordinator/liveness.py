"""LivenessWatch: a rank that completes no step while the engine owns work is hung.

A hung engine (a dead collective peer, a wedged kernel) must not keep answering 200 on
/health. The clock only runs while the engine still owns requests: requests that ended, were
aborted or timed out do not count, whatever their HTTP writer is doing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable


class LivenessWatch:
    """Calls `on_hang(reason)` once when a rank reports no step for `step_timeout` seconds."""

    def __init__(
        self,
        data_parallel_size: int,
        step_timeout: float,
        engine_busy: Callable[[], bool],
        on_hang: Callable[[str], None],
    ) -> None:
        self._step_timeout = step_timeout
        self._engine_busy = engine_busy
        self._on_hang = on_hang
        self._last_report = [0.0] * data_parallel_size

    def reported(self, rank: int, now: float) -> None:
        """A step report from `rank` arrived at loop time `now`."""
        self._last_report[rank] = now

    async def run(self) -> None:
        """Check at a quarter of the timeout (at most every second) until a hang is found."""
        loop = asyncio.get_running_loop()
        interval = min(1.0, self._step_timeout / 4)
        was_busy = False
        while True:
            await asyncio.sleep(interval)
            now = loop.time()
            busy = self._engine_busy()
            if not (busy and was_busy):
                # Idle, or work that arrived since the last check: the clock starts now.
                self._last_report = [now] * len(self._last_report)
                was_busy = busy
                continue
            # In lockstep, peers of a stuck rank block in its next collective shortly after it
            # stops: the rank whose last report is oldest is the one that stopped first.
            stuck = min(range(len(self._last_report)), key=self._last_report.__getitem__)
            if now - self._last_report[stuck] > self._step_timeout:
                self._on_hang(
                    f"DP rank {stuck} completed no engine step for {self._step_timeout:g}s "
                    "(--step-timeout) while requests were in flight; the engine is hung"
                )
                return
