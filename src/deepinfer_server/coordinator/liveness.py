"""LivenessWatch: a rank whose loop stops coming back is hung, whatever is in flight.

A hung engine (a dead collective peer, a wedged kernel, a step or a request that never
returns) must not keep answering 200 on /health. Every rank's loop reports each iteration that
produced something (`StepOutputs`) and, when it has nothing to say, a `RankAlive` heartbeat at
least every `heartbeat_interval(step_timeout)` seconds; a rank that sent nothing for
`step_timeout` seconds is hung. The clock measures the loop itself, so clients that give up
(and requests that end) cannot reset it.

The clocks start when the last rank has reported: in lockstep, a rank that is ready waits for
its slower peers (still loading weights) in its first collective, silent but not hung; until
then the start-up timeout is the bound.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

#: The most a rank waits between heartbeats (seconds), and the watch between checks.
_MAX_INTERVAL_SECONDS = 1.0


def heartbeat_interval(step_timeout: float) -> float:
    """How often an otherwise silent rank loop reports that it came back (seconds)."""
    if step_timeout <= 0:
        return _MAX_INTERVAL_SECONDS
    return min(_MAX_INTERVAL_SECONDS, step_timeout / 4)


class LivenessWatch:
    """Calls `on_hang(reason)` once when a rank that has reported sends nothing for
    `step_timeout` seconds while `watching()` is true.

    `clock` is the loop time the ranks' reports are stamped with (the running event loop's
    `time()` by default) and `sleep` what `run` waits between checks with (`asyncio.sleep`):
    a test moves both by hand.
    """

    def __init__(
        self,
        data_parallel_size: int,
        step_timeout: float,
        on_hang: Callable[[str], None],
        watching: Callable[[], bool] = lambda: True,
        *,
        clock: Callable[[], float] | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self._step_timeout = step_timeout
        self._on_hang = on_hang
        self._watching = watching
        self._clock = clock
        self._sleep = sleep
        #: Loop time of each rank's last message; None until its first (it is starting).
        self._last_report: list[float | None] = [None] * data_parallel_size
        self._last_check = 0.0

    def reported(self, rank: int, now: float) -> None:
        """A message from `rank` (ready, step outputs, heartbeat) arrived at loop time `now`."""
        starting = self._last_report[rank] is None
        self._last_report[rank] = now
        if starting and None not in self._last_report:  # the last rank is up: clocks start
            self._last_report = [now] * len(self._last_report)

    async def run(self) -> None:
        """Check every heartbeat interval until a hang is found."""
        clock = self._clock or asyncio.get_running_loop().time
        self.started(clock())
        while True:
            await self._sleep(self.interval)
            if self.check(clock()):
                return

    @property
    def interval(self) -> float:
        """Seconds between checks."""
        return heartbeat_interval(self._step_timeout)

    def started(self, now: float) -> None:
        """The watch starts checking at loop time `now`."""
        self._last_check = now

    def check(self, now: float) -> bool:
        """One check at loop time `now` (one interval after the last); calls `on_hang` and
        returns True when a hang is found."""
        stalled_here = now - self._last_check > 2 * self.interval + 0.5
        self._last_check = now
        if stalled_here or not self._watching():
            # This process's own loop was held up (the ranks' reports are still unread in the
            # sockets), or nothing is watched now: the clocks start again.
            self._last_report = [None if t is None else now for t in self._last_report]
            return False
        stuck = self._stuck_ranks(now)
        if stuck:
            self._on_hang(_hang_reason(stuck, self._step_timeout))
        return bool(stuck)

    def _stuck_ranks(self, now: float) -> list[int]:
        """Every rank silent for longer than the step timeout (none while one is starting)."""
        if None in self._last_report:  # a rank is still starting
            return []
        return [
            rank
            for rank, t in enumerate(self._last_report)
            if t is not None and now - t > self._step_timeout
        ]


def _hang_reason(stuck: list[int], step_timeout: float) -> str:
    """The failure's reason. In lockstep the peers of a hung rank block in its next collective
    a moment after it stops, so every rank goes silent, within milliseconds of each other;
    which one hung is not known from here, and every silent rank is named."""
    if len(stuck) == 1:
        who = f"DP rank {stuck[0]}"
    else:
        who = f"DP ranks {', '.join(map(str, stuck[:-1]))} and {stuck[-1]}"
    reason = (
        f"{who} completed no engine step or loop iteration for {step_timeout:g}s "
        "(--step-timeout); the engine is hung"
    )
    if len(stuck) > 1:
        reason += " (in lockstep one hung rank holds up the others)"
    return reason
