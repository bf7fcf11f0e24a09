"""ChildWatchdog: notices when a process the engine started (a CP worker) dies.

DeepInfer keeps no handles to its CP workers and multimodal worker; a dead one leaves the
driver blocked in a collective forever. This thread polls a snapshot of them and, when one
exits, reports the failure on its own socket and ends the rank process: the engine is unusable.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from multiprocessing.process import BaseProcess

logger = logging.getLogger(__name__)


class ChildWatchdog:
    """Polls `children`; calls `on_death(message)` once, for the first that exits."""

    def __init__(
        self,
        children: list[BaseProcess],
        on_death: Callable[[str], None],
        interval: float = 1.0,
    ) -> None:
        self._children = children
        self._on_death = on_death
        self._interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="child-watchdog", daemon=True)

    def start(self) -> None:
        if self._children:
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            for child in self._children:
                if not child.is_alive():
                    message = f"engine child process {child.name} (pid {child.pid}) exited"
                    logger.error("%s; the engine cannot continue", message)
                    try:
                        self._on_death(message)
                    finally:
                        exit_rank_process(1)
                    return


def exit_rank_process(code: int = 1) -> None:
    """End the whole rank process at once (its engine thread may be stuck in a collective)."""
    os._exit(code)
