"""StepClock: when each step of the simulated engine ends, and the wait until then.

Every step, prompt steps included, lasts `itl_ms` while there is work (host work overlaps the
step: a step computes its outputs as of its end, then waits for that end; a slower loop slows
the steps); a step with only waiting requests ends when the first of them is ready. A decode
step lasts `itl_ms_per_request` longer per sequence it decodes (`decode_end`): a linear cost
model, a fixed part (weights read, launch) plus a part that grows with the batch (each
sequence's KV read and its share of the expert work).
"""

from __future__ import annotations

import time

#: The end of each step's wait that is spun rather than slept (`sleep_until`).
_SPIN_SECONDS = 0.0003


class StepClock:
    """The step cadence of one engine (owned by its loop's thread)."""

    def __init__(self, itl_ms: float, itl_ms_per_request: float = 0.0) -> None:
        self._itl = itl_ms / 1000.0
        self._per_request = itl_ms_per_request / 1000.0
        self._deadline = 0.0

    def step_end(self, started: float, first_ready: float | None) -> float:
        """When the step that started at `started` ends (`time.monotonic()`); `first_ready`
        is when the first waiting request is ready, given only while none is running."""
        # The step ends one period after the previous one did; after an idle gap (or a loop
        # slower than the period) the cadence restarts from now.
        deadline = self._deadline + self._itl
        if deadline < started:
            deadline = started + self._itl
        if first_ready is not None:
            deadline = min(deadline, max(started, first_ready))
        return deadline

    def decode_end(self, step_end: float, batch: int) -> float:
        """When a decode step of `batch` sequences ends, that would end at `step_end` (as
        `step_end` gives it) with none."""
        return step_end + self._per_request * batch

    def period_start(self, now: float) -> float:
        """When the step that the engine would start at `now` begins: the previous step's end
        while the cadence runs (the host's work between two steps overlaps the next one), else
        `now`."""
        return self._deadline if now <= self._deadline + self._itl else now

    def sleep_until(self, deadline: float) -> None:
        """Wait for the step's end; the next step's period runs from it."""
        # A GPU step ends on time; an OS timer wakes a sleeper 0.1-0.2 ms late (timer slack,
        # virtual CPUs), which would show as latency the server adds. Sleep most of the wait,
        # then spin the last moment.
        remaining = deadline - time.monotonic()
        if remaining > _SPIN_SECONDS:
            time.sleep(remaining - _SPIN_SECONDS)
        while time.monotonic() < deadline:
            pass
        itl = self._itl
        self._deadline = max(deadline, time.monotonic() - itl) if itl else deadline
