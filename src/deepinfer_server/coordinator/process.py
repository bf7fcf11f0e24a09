"""RankProcesses: spawn the DP rank processes, watch them, and stop them without orphans.

Shutdown follows one deadline: ask every rank to stop at an agreed iteration and close its
engine together; after the deadline SIGKILL what is left (ranks ignore SIGTERM, which a
process-group signal would deliver to them before the API process could stop them in order).
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
from collections.abc import Callable
from multiprocessing.process import BaseProcess

from deepinfer_server.ipc.lockstep import LockstepGroup
from deepinfer_server.rank.proc import run_rank
from deepinfer_server.rank.spec import RankSpec

logger = logging.getLogger(__name__)

ExitCallback = Callable[[int, int | None], None]


class RankProcesses:
    """Parent-side handle of every rank process of one server."""

    def __init__(self, specs: list[RankSpec], lockstep: LockstepGroup) -> None:
        self._specs = specs
        self.lockstep = lockstep
        self._processes: list[BaseProcess] = []
        self._stopping = False

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._processes if p.pid is not None]

    def start(self) -> None:
        """Spawn one process per rank (the spawn method: no inherited engine or CUDA state)."""
        context = multiprocessing.get_context("spawn")
        for spec in self._specs:
            # Not daemonic: a rank's engine starts child processes of its own (CP workers).
            process = context.Process(
                target=run_rank, args=(spec, self.lockstep), name=f"deepinfer-rank-{spec.rank}"
            )
            process.start()
            self._processes.append(process)
            logger.info("[startup] DP rank %d started as pid %s", spec.rank, process.pid)

    def watch(self, on_exit: ExitCallback) -> None:
        """Call `on_exit(rank, exitcode)` when a rank exits, unless the exit is a requested stop."""
        loop = asyncio.get_running_loop()
        for rank, process in enumerate(self._processes):

            def exited(rank: int = rank, process: BaseProcess = process) -> None:
                loop.remove_reader(process.sentinel)
                process.join(0)
                if not self._stopping:
                    on_exit(rank, process.exitcode)

            loop.add_reader(process.sentinel, exited)

    async def stop(self, timeout: float) -> None:
        """Stop every rank: the agreed stop within `timeout` seconds, then SIGKILL."""
        self._stopping = True
        self.lockstep.request_stop()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        for process in self._processes:
            await self._join(process, deadline - loop.time())
        for process in self._processes:
            if process.is_alive():
                logger.warning(
                    "[shutdown] DP rank pid %s did not stop in time; killing", process.pid
                )
                process.kill()
                await self._join(process, 5.0)

    @staticmethod
    async def _join(process: BaseProcess, timeout: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(0.0, timeout)
        while process.is_alive() and loop.time() < deadline:
            await asyncio.sleep(0.02)
        process.join(0)
