"""The DP rank processes of one server: spawn them, watch them, break their collectives when
the service fails, and stop them without orphans.

Shutdown follows one deadline: ask every rank to stop at an agreed iteration and close its
engine together; after the deadline SIGKILL what is left. Each rank leads a process group of
its own (`rank.proc`), which its engine's children join: signals sent to the API process's
group never reach a rank, and killing a rank means killing its whole group, so no engine child
outlives it. Exits are seen through each process's sentinel on the event loop, never by polling.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import signal
import threading
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from typing import Any

from deepinfer_server.engines.backend import SharedState
from deepinfer_server.ipc.stop_agreement import StopAgreement
from deepinfer_server.rank.proc import run_rank
from deepinfer_server.rank.spec import RankSpec

logger = logging.getLogger(__name__)

ExitCallback = Callable[[int, int | None], None]

#: How long reaping a process whose sentinel fired may take: the sentinel closes while the
#: process exits, a moment before it becomes reapable; `join(0)` would then leave a zombie.
REAP_TIMEOUT = 1.0


def describe_exit(exitcode: int | None) -> str:
    """'exit code 3' or 'signal SIGKILL' for a process's exit code."""
    if exitcode is None:
        return "an unknown status"
    if exitcode < 0:
        try:
            return f"signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"signal {-exitcode}"
    return f"exit code {exitcode}"


def kill_group(process: BaseProcess) -> None:
    """SIGKILL the process group a rank leads (the rank and its engine's children).

    Call it only before the rank is reaped: an unreaped pid cannot be reused, so the group
    named by it is still the rank's.
    """
    if process.pid is None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)


class RankProcesses:
    """Parent-side handle of every rank process of one server."""

    def __init__(self, target: Callable[..., None], args_of_rank: list[tuple[Any, ...]]) -> None:
        self._target = target
        self._args_of_rank = args_of_rank
        self._processes: list[BaseProcess] = []
        self._exited: list[asyncio.Future[None]] = []
        self._stopping = False

    def start(self) -> None:
        """Spawn one process per rank (the spawn method: no inherited engine or CUDA state)."""
        context = multiprocessing.get_context("spawn")
        for rank, args in enumerate(self._args_of_rank):
            # Not daemonic: a rank's engine starts child processes of its own (CP workers).
            process = context.Process(target=self._target, args=args, name=f"deepinfer-rank-{rank}")
            process.start()
            self._processes.append(process)
            logger.info("[startup] DP rank %d started as pid %s", rank, process.pid)

    def watch(self, on_exit: ExitCallback) -> None:
        """Call `on_exit(rank, exitcode)` when a rank exits, unless the exit is a requested stop."""
        loop = asyncio.get_running_loop()
        for rank, process in enumerate(self._processes):
            exited: asyncio.Future[None] = loop.create_future()
            self._exited.append(exited)

            def on_sentinel(
                rank: int = rank,
                process: BaseProcess = process,
                exited: asyncio.Future[None] = exited,
            ) -> None:
                loop.remove_reader(process.sentinel)
                kill_group(process)  # before the rank is reaped: its pid still names the group
                process.join(REAP_TIMEOUT)
                if not exited.done():
                    exited.set_result(None)
                if not self._stopping:
                    on_exit(rank, process.exitcode)

            loop.add_reader(process.sentinel, on_sentinel)

    async def stop(self, timeout: float) -> None:
        """Wait `timeout` seconds for the agreed stop, then SIGKILL every rank still alive."""
        self._stopping = True
        if not self._exited:  # never watched (start-up was interrupted): join on a thread
            for process in self._processes:
                await asyncio.to_thread(process.join, max(0.0, timeout))
        pending = [f for f in self._exited if not f.done()]
        if pending:
            await asyncio.wait(pending, timeout=max(0.0, timeout))
        for rank, process in enumerate(self._processes):
            if self._exited[rank].done() if self._exited else process.exitcode is not None:
                continue
            # Alive, or dead with its sentinel still held open by a leftover engine child.
            logger.warning(
                "[shutdown] DP rank pid %s did not stop in time; killing its process group",
                process.pid,
            )
            kill_group(process)
            process.kill()
        pending = [f for f in self._exited if not f.done()]
        if pending:
            await asyncio.wait(pending, timeout=5.0)
        for process in self._processes:
            process.join(0)


class RankGroup:
    """The ranks of one server, owned by the process that spawns them (the single API process,
    or the supervisor of several): their processes, their agreed stop, and the break of their
    collectives."""

    def __init__(self, specs: list[RankSpec], shared: SharedState | None) -> None:
        self._stop = StopAgreement()
        self._processes = RankProcesses(run_rank, [(spec, self._stop, shared) for spec in specs])
        self._abort = shared.abort if shared is not None else None

    def start(self) -> None:
        """Spawn every rank."""
        self._processes.start()

    def watch(self, on_exit: Callable[[int, str], None]) -> None:
        """Call `on_exit(rank, reason)` when a rank exits unless it was asked to stop."""
        self._processes.watch(
            lambda rank, exitcode: on_exit(
                rank, f"DP rank {rank} exited unexpectedly with {describe_exit(exitcode)}"
            )
        )

    def break_collectives(self) -> None:
        """Peers blocked in a collective with a failed rank would wait forever: break it. On a
        thread, because a rank killed while holding a shared lock leaves that lock taken for
        good, and the event loop must never wait on it."""
        if self._abort is not None:
            threading.Thread(target=self._abort, name="break-collectives", daemon=True).start()

    def request_stop(self) -> None:
        """Ask every rank to stop at an iteration they all agree on."""
        self._stop.request_stop()

    async def stop(self, timeout: float) -> None:
        """The agreed stop; SIGKILL whatever is left after `timeout`."""
        self._stop.request_stop()
        await self._processes.stop(timeout)
