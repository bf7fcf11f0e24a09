"""The supervisor of `--api-server-count N` (N > 1): ranks, N API server processes, one port.

It spawns the DP ranks, binds the listening socket once and spawns N API server processes
(`api_worker`) that share it, each wired to every rank. It owns what exists once: the rank
processes and their stop, the collectives' break, the service's failure (a rank exit it sees,
a failure an API server process reports, or an API server process that dies fails the service
in every process, with the same reason) and the order of shutdown: on SIGTERM/SIGINT every API
server process drains; once all have, the ranks stop at an agreed iteration; then the API server
processes close and exit. Every child dies with the supervisor (parent-death signal).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import signal
import socket
from collections.abc import Callable, Iterator
from multiprocessing.process import BaseProcess

from deepinfer_server.concurrency import first_of
from deepinfer_server.config import ResolvedConfig
from deepinfer_server.coordinator.admission import shared_state
from deepinfer_server.coordinator.channels import bind_rank_listener
from deepinfer_server.coordinator.failure_cause import FailureCause
from deepinfer_server.ipc import control
from deepinfer_server.ipc.control import ControlChannel, ControlMessage
from deepinfer_server.protocol.core.reasoning_seal import seal_key
from deepinfer_server.server.api_worker import WorkerSpec, run_api_worker
from deepinfer_server.server.http import STOP_SIGNALS, log_serving
from deepinfer_server.server.ranks import REAP_TIMEOUT, RankGroup, describe_exit
from deepinfer_server.server.startup import (
    RANK_STOP_TIMEOUT,
    Prepared,
    api_address,
    workspace,
)

logger = logging.getLogger("deepinfer_server")

#: Seconds API server processes get to close after the ranks stopped, before they are killed.
_WORKER_EXIT_TIMEOUT = 10.0
#: Seconds beyond --shutdown-timeout that draining may take (uvicorn's own graceful shutdown).
_DRAIN_SLACK = 30.0
#: Seconds between the supervisor's pings to each serving API server process.
_PING_INTERVAL = 1.0
#: Seconds a serving API server process may leave the pings unanswered: past that it is stuck
#: (stopped, or its event loop blocked), and it is killed and the service fails, naming it.
#: Shorter than the ranks' bound on an unread link (`rank.links.LINK_STALL_SECONDS`).
API_SERVER_TIMEOUT = 10.0


class _Worker:
    """The supervisor's handle on one API server process."""

    def __init__(self, index: int, process: BaseProcess, channel: ControlChannel) -> None:
        self.index = index
        self.process = process
        self.channel = channel
        self.serving = False
        self.warm = False
        self.drained = False
        self.exited = asyncio.Event()
        self.signals_sent = 0
        #: Event-loop time of its last Serving or Pong.
        self.answered_at = 0.0
        self.stuck = False

    def terminate(self) -> None:
        """SIGTERM: drain (start-up: stop waiting); a second one ends the drain (the API
        server process ignores SIGINT: Ctrl-C reaches the whole process group)."""
        self.signals_sent += 1
        if not self.exited.is_set() and self.process.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.process.pid, signal.SIGTERM)


class Supervisor:
    """Runs the ranks and the API server processes of one server until told to stop."""

    def __init__(
        self,
        config: ResolvedConfig,
        master_port: int,
        ranks: RankGroup,
    ) -> None:
        self._config = config
        self._master_port = master_port
        self._ranks = ranks
        self._workers: list[_Worker] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = asyncio.Event()
        self._changed = asyncio.Event()  # a worker is serving, drained or exited
        self._failure: str | None = None
        #: Rank exits (seen here) and rank reports (forwarded by the API server processes):
        #: the cause the service fails for.
        self._causes = FailureCause(self._fail)
        self._signals = 0

    async def start_workers(self, specs: list[WorkerSpec], ends: list[socket.socket]) -> None:
        """Spawn every API server process and watch it (its control channel and its exit)."""
        context = multiprocessing.get_context("spawn")
        loop = asyncio.get_running_loop()
        for spec, end in zip(specs, ends, strict=True):
            process = context.Process(
                target=run_api_worker, args=(spec,), name=f"deepinfer-api-{spec.index}"
            )
            process.start()
            spec.control.close()  # the child holds its own end now
            worker = _Worker(spec.index, process, await ControlChannel.open(end))
            self._workers.append(worker)
            logger.info(
                "[startup] API server process %d started as pid %s", spec.index, process.pid
            )
            self._tasks.append(loop.create_task(self._listen(worker)))
            loop.add_reader(process.sentinel, self._on_worker_exit, worker)
        self._tasks.append(loop.create_task(self._watch_workers()))
        self._forward_signals()  # any that arrived while they were being spawned

    async def run(self) -> int:
        """Start-up, serve, shut down; the exit code."""
        code = await self._startup()
        if code is None:
            await self._stopping.wait()
            code = 0
        await self._until(lambda w: w.drained or w.exited.is_set(), self._drain_timeout())
        logger.info("[shutdown] stopping DP ranks")
        await self._ranks.stop(RANK_STOP_TIMEOUT)
        for worker in self._workers:
            worker.channel.send(control.Exit())
        if not await self._until(lambda w: w.exited.is_set(), _WORKER_EXIT_TIMEOUT):
            for worker in self._workers:
                if not worker.exited.is_set():
                    logger.warning("[shutdown] killing API server process %d", worker.index)
                    worker.process.kill()
            await self._until(lambda w: w.exited.is_set(), 5.0)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for worker in self._workers:
            worker.channel.close()
        logger.info("[shutdown] done")
        return code

    async def abandon(self) -> None:
        """Start-up broke off before `run()`: kill the API server processes spawned so far
        and stop the ranks, which would otherwise outlive this process's failure."""
        for worker in self._workers:
            worker.process.kill()
        await self._ranks.stop(RANK_STOP_TIMEOUT)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for worker in self._workers:
            await asyncio.to_thread(worker.process.join, _WORKER_EXIT_TIMEOUT)
            worker.channel.close()

    def on_signal(self, sig: signal.Signals = signal.SIGTERM) -> None:
        """SIGTERM/SIGINT: every API server process drains; then SIGINT (a second Ctrl-C)
        ends the drains, as it does for one process (a second SIGTERM does not)."""
        if self._signals == 0 or sig == signal.SIGINT:
            self._signals += 1
        self._stopping.set()
        self._forward_signals()

    def _forward_signals(self) -> None:
        for worker in self._workers:
            while worker.signals_sent < self._signals:
                worker.terminate()

    def on_rank_exit(self, rank: int, reason: str) -> None:
        self._causes.exit(rank, reason)

    async def _startup(self) -> int | None:
        """None once every API server process serves; else the exit code (1: a process ended
        during start-up, 0: stopped by a signal)."""
        while True:
            if self._stopping.is_set():
                logger.info("[startup] interrupted")
                return 0
            if any(w.exited.is_set() for w in self._workers):
                logger.error("[startup] failed: an API server process could not start")
                self.on_signal()  # stops the others' start-up
                return 1
            if all(w.serving for w in self._workers):
                return None
            await first_of(self._changed.wait(), self._stopping.wait())
            self._changed.clear()

    def _all(self, holds: Callable[[_Worker], bool]) -> bool:
        """Whether every API server process has started and `holds` for each."""
        every = len(self._workers) == self._config.api_server_count
        return every and all(holds(w) for w in self._workers)

    def _drain_timeout(self) -> float:
        return self._config.shutdown_timeout + _DRAIN_SLACK

    async def _until(self, done: Callable[[_Worker], bool], timeout: float) -> bool:
        """Wait until `done` holds for every API server process; False after `timeout`."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not all(done(w) for w in self._workers):
            self._changed.clear()
            try:
                async with asyncio.timeout_at(deadline):
                    await self._changed.wait()
            except TimeoutError:
                return False
        return True

    async def _listen(self, worker: _Worker) -> None:
        while (message := await worker.channel.receive()) is not None:
            self._on_message(worker, message)

    def _on_message(self, worker: _Worker, message: ControlMessage) -> None:
        if isinstance(message, control.SnapshotRequest):
            for other in self._workers:
                if other is not worker and not other.exited.is_set():
                    other.channel.send(message)
        elif isinstance(message, control.SnapshotReply):
            self._workers[message.requester].channel.send(message)
        elif isinstance(message, control.Failed):
            self._fail(message.reason)
        elif isinstance(message, control.RankReport):
            self._causes.report(message.rank, message.reason)
        elif isinstance(message, control.Pong):
            worker.answered_at = asyncio.get_running_loop().time()
        elif isinstance(message, control.Serving):
            worker.serving = True
            worker.answered_at = asyncio.get_running_loop().time()
            self._changed.set()
            if self._all(lambda w: w.serving):
                log_serving(self._config, self._master_port)
                for other in self._workers:
                    other.channel.send(control.AllServing())
        elif isinstance(message, control.Warm):
            worker.warm = True
            if self._all(lambda w: w.warm):
                for other in self._workers:
                    other.channel.send(control.AllWarm())
        elif isinstance(message, control.Drained):
            worker.drained = True
            self._changed.set()

    async def _watch_workers(self) -> None:
        """Ping every serving API server process; one that stops answering is stuck."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(_PING_INTERVAL)
            now = loop.time()
            for worker in self._workers:
                if not worker.serving or worker.stuck or worker.exited.is_set():
                    continue
                if self._stopping.is_set():  # a drain that hangs has its own bound
                    continue
                if now - worker.answered_at > API_SERVER_TIMEOUT:
                    self._on_stuck(worker)
                else:
                    worker.channel.send(control.Ping())

    def _on_stuck(self, worker: _Worker) -> None:
        """Kill a stuck API server process (its clients' connections close) and fail the
        service: its requests are lost, and the ranks' links to it are gone."""
        worker.stuck = True
        reason = (
            f"API server process {worker.index} (pid {worker.process.pid}) answered the "
            f"supervisor's pings for none of {API_SERVER_TIMEOUT:g}s (stopped, or its event "
            "loop is blocked); it was killed"
        )
        logger.error("%s", reason)
        self._fail(reason, break_collectives=False)
        worker.process.kill()

    def _on_worker_exit(self, worker: _Worker) -> None:
        loop = asyncio.get_running_loop()
        loop.remove_reader(worker.process.sentinel)
        # The sentinel closes while the process exits, a moment before it can be reaped.
        worker.process.join(REAP_TIMEOUT)
        worker.exited.set()
        self._changed.set()
        if not self._stopping.is_set() and all(w.serving for w in self._workers):
            self._fail(
                f"API server process {worker.index} exited unexpectedly with "
                f"{describe_exit(worker.process.exitcode)}",
                break_collectives=False,
            )

    def _fail(self, reason: str, break_collectives: bool = True) -> None:
        """Fail the service in every API server process (the first reason wins)."""
        if self._failure is not None:
            return
        self._failure = reason
        for worker in self._workers:
            worker.channel.send(control.Failed(reason))
        if break_collectives:
            self._ranks.break_collectives()


async def supervise(config: ResolvedConfig, prepared: Prepared) -> int:
    """Run the server with `config.api_server_count` API server processes; the exit code."""
    with workspace(config, prepared) as space:
        if space is None:
            return 1
        config, listener, workdir, ranks = space.config, space.listener, space.workdir, space.ranks
        supervisor = Supervisor(config, prepared.master_port, ranks)
        # Bound before any rank starts: a rank connects to every API process as soon as its
        # engine is built.
        rank_listeners = [
            bind_rank_listener(api_address(workdir, index))
            for index in range(config.api_server_count)
        ]
        pairs = [socket.socketpair() for _ in range(config.api_server_count)]
        specs = _worker_specs(config, prepared, listener, rank_listeners, [w for _, w in pairs])
        with _signals_to(supervisor.on_signal):
            try:
                ranks.start()
                ranks.watch(supervisor.on_rank_exit)
                await supervisor.start_workers(specs, [end for end, _ in pairs])
            except BaseException:
                await supervisor.abandon()
                raise
            listener.close()  # every API server process holds its own copy
            for rank_listener in rank_listeners:
                rank_listener.close()
            return await supervisor.run()


def _worker_specs(
    config: ResolvedConfig,
    prepared: Prepared,
    listener: socket.socket,
    rank_listeners: list[socket.socket],
    controls: list[socket.socket],
) -> list[WorkerSpec]:
    """One spec per API server process: the shared port, its own rank socket and control end,
    the admission state they share and one reasoning seal key for all."""
    slots = shared_state(config.data_parallel_size, len(config.tenants), config.api_server_count)
    reasoning_key = seal_key(config.reasoning_secret)
    return [
        WorkerSpec(
            config=config,
            index=index,
            checkpoint=prepared.checkpoint,
            rank_listener=rank_listeners[index],
            listener=listener,
            control=controls[index],
            slots=slots,
            reasoning_key=reasoning_key,
        )
        for index in range(config.api_server_count)
    ]


@contextlib.contextmanager
def _signals_to(handler: Callable[[signal.Signals], None]) -> Iterator[None]:
    """`handler(signal)` handles the stop signals while inside."""
    loop = asyncio.get_running_loop()
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, handler, sig)
    try:
        yield
    finally:
        for sig in STOP_SIGNALS:
            loop.remove_signal_handler(sig)
