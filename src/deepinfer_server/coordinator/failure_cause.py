"""Which of several rank failures that arrive together is the cause the service fails for.

When a rank dies, its peers' collectives break at once and they report that (a lockstep
violation, a closed gloo connection) before the dead rank's exit is seen; a rank that fails on
purpose reports why just before it exits. So every report and exit is collected for a short
grace, and the cause is: a rank that died without a report (its peers' reports are
consequences), else the first report, else the first exit.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

#: Seconds the reports and exits of one failure may take to arrive together.
FAILURE_GRACE_SECONDS = 0.5


class FailureCause:
    """Collects rank reports and exits; calls `on_cause` once, after the grace."""

    def __init__(
        self, on_cause: Callable[[str], None], grace: float = FAILURE_GRACE_SECONDS
    ) -> None:
        self._on_cause = on_cause
        self._grace = grace
        self._reports: dict[int, str] = {}
        self._exits: dict[int, str] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._settled = False

    def report(self, rank: int, reason: str) -> None:
        """Rank `rank` said why it failed."""
        self._reports.setdefault(rank, reason)
        self._start()

    def exit(self, rank: int, reason: str) -> None:
        """Rank `rank`'s process ended (`reason` describes how)."""
        self._exits.setdefault(rank, reason)
        self._start()

    def _start(self) -> None:
        if self._timer is None and not self._settled:
            self._timer = asyncio.get_running_loop().call_later(self._grace, self._settle)

    def _settle(self) -> None:
        self._settled = True
        silent = [why for rank, why in self._exits.items() if rank not in self._reports]
        causes = silent or list(self._reports.values()) or list(self._exits.values())
        self._on_cause(causes[0])
