"""StopAgreement: how every DP rank agrees on the loop iteration at which it stops.

Created by the API process before it spawns the ranks and handed to each. No rank may leave
its loop while a peer still waits in a collective of the same iteration, so a stop request is
turned into one iteration number that all ranks reach and stop at together.
"""

from __future__ import annotations

import multiprocessing
from typing import Any


class StopAgreement:
    """Shared-memory stop flag and agreed stop iteration for the ranks of one server."""

    def __init__(self) -> None:
        context = multiprocessing.get_context("spawn")
        self._stop_at: Any = context.Value("q", -1)
        self._requested: Any = context.Value("b", 0, lock=False)

    def request_stop(self) -> None:
        """Ask every rank to stop at the next iteration they can all agree on."""
        self._requested.value = 1

    def should_stop(self, iteration: int) -> bool:
        """Called at the top of each loop iteration, before any collective of that iteration.

        The first rank that sees a stop request proposes `iteration + 1`. No peer can be past
        the top of `iteration` yet (they all must join this iteration's collective first), so
        every rank reaches the proposed iteration and stops there, together.
        """
        if not self._requested.value:
            return False
        with self._stop_at.get_lock():
            if self._stop_at.value < 0:
                self._stop_at.value = iteration + 1
            stop_at = int(self._stop_at.value)
        return iteration >= stop_at
