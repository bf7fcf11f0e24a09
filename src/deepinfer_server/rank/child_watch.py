"""ChildWatchdog: notices at once when a process the engine started (a CP worker) dies.

DeepInfer keeps no handles to its CP workers and multimodal worker; a dead one leaves the
driver blocked in a collective forever. This thread waits on the children's sentinels (no
polling) and, when one exits, reports the failure and ends the rank process: the engine is
unusable.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess

logger = logging.getLogger(__name__)


class ChildWatchdog:
    """Waits on `children`; calls `on_death(message)` once, for the first that exits."""

    def __init__(self, children: list[BaseProcess], on_death: Callable[[str], None]) -> None:
        self._children = children
        self._on_death = on_death
        self._stop_read, self._stop_write = os.pipe()
        self._thread = threading.Thread(target=self._run, name="child-watchdog", daemon=True)

    def start(self) -> None:
        if self._children:
            self._thread.start()

    def stop(self) -> None:
        """Stop watching (the engine is closing its children on purpose)."""
        os.write(self._stop_write, b"x")

    def _run(self) -> None:
        by_sentinel = {child.sentinel: child for child in self._children}
        ready = wait([self._stop_read, *by_sentinel])
        dead = [by_sentinel[s] for s in ready if isinstance(s, int) and s in by_sentinel]
        if self._stop_read in ready or not dead:
            return
        child = dead[0]
        message = f"engine child process {child.name} (pid {child.pid}) exited"
        logger.error("%s; the engine cannot continue", message)
        try:
            self._on_death(message)
        finally:
            exit_rank_process(1)


def exit_rank_process(code: int = 1) -> None:
    """End the whole rank process at once (its engine thread may be stuck in a collective)."""
    os._exit(code)
