"""EngineClient: what the HTTP layer uses to run requests on the DP ranks.

Owns the sockets to the rank processes, admission (capacity `dp * max_num_seqs +
max_queued_requests`, 429 beyond it), routing (least-loaded rank), the table of live
RequestHandles, the one reader task that fans rank outputs out to those handles, and the
service's health. A failed rank fails the whole service: every handle ends with a 503, new
requests get 503, and `/health` reports the reason until the server is restarted.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import logging
import sys
import threading
import time
from collections.abc import Callable

import zmq
import zmq.asyncio

from deepinfer_server.config import ServerConfig
from deepinfer_server.coordinator.handle import RequestHandle
from deepinfer_server.coordinator.process import RankProcesses
from deepinfer_server.coordinator.routing import choose_rank
from deepinfer_server.errors import (
    ApiError,
    BadRequestError,
    EngineRequestError,
    OverloadedError,
    ServerError,
    ServiceUnavailableError,
)
from deepinfer_server.ipc.messages import (
    AbortRequests,
    AddRequest,
    RankFailed,
    RankReady,
    RequestRejected,
    SamplingOptions,
    Shutdown,
    StepOutputs,
    Wake,
    from_rank_decoder,
    to_rank_encoder,
)
from deepinfer_server.metrics import ServerMetrics

logger = logging.getLogger(__name__)

_EXIT_REPORT_GRACE_SECONDS = 0.5
_DRAIN_BATCH = 32
SHUTDOWN_CODE = "server_shutting_down"
_WAKE = to_rank_encoder.encode(Wake())
_SHUTDOWN = to_rank_encoder.encode(Shutdown())


class StartupError(ServerError):
    """A rank failed to start, or did not become ready in time."""


def shutdown_error() -> ServiceUnavailableError:
    """The error of requests refused or ended because the server is shutting down."""
    return ServiceUnavailableError("the server is shutting down", code=SHUTDOWN_CODE)


def finish_reason_error(reason: str) -> ApiError:
    """The client-facing error for a DeepInfer finish reason other than stop/length."""
    if reason == "prompt_length_exceeded":
        return BadRequestError("the prompt is longer than the engine accepts", code=reason)
    if reason == "insufficient_system_resource":
        return EngineRequestError(
            "the engine ran out of KV-cache memory for this request; retry later",
            status_code=503,
            code=reason,
        )
    if reason == "abort":
        return EngineRequestError("the engine aborted the request", status_code=500, code=reason)
    return EngineRequestError(f"the engine ended the request: {reason}", status_code=500)


class EngineClient:
    """The API process's handle on all DP ranks. Use from the event loop thread only."""

    def __init__(
        self,
        config: ServerConfig,
        processes: RankProcesses,
        inbox_addresses: list[str],
        outbox_address: str,
        metrics: ServerMetrics,
    ) -> None:
        self._config = config
        self._metrics = metrics
        metrics.watch_ranks(self._rank_counts, lambda: self._failure is None)
        self._processes = processes
        self._context = zmq.Context()
        self._inboxes: list[zmq.Socket[bytes]] = []
        for address in inbox_addresses:
            socket = self._context.socket(zmq.PUSH)
            socket.setsockopt(zmq.SNDHWM, 0)  # never block the event loop on a send
            socket.setsockopt(zmq.LINGER, 0)
            socket.bind(address)
            self._inboxes.append(socket)
        self._outbox = zmq.asyncio.Context.shadow(self._context).socket(zmq.PULL)
        self._outbox.setsockopt(zmq.LINGER, 0)
        self._outbox.bind(outbox_address)
        self._handles: dict[str, RequestHandle] = {}
        self._in_flight = [0] * config.dp
        self._ready: set[int] = set()
        self._all_ready = asyncio.Event()
        self._failure: str | None = None
        self._failed = asyncio.Event()
        self._reader: asyncio.Task[None] | None = None
        self._liveness: asyncio.Task[None] | None = None
        self._last_report = [0.0] * config.dp
        self.draining = False

    # Lifecycle

    def start(self) -> None:
        """Start the reader task and the process watch (ranks must already be spawned)."""
        loop = asyncio.get_running_loop()
        self._reader = loop.create_task(self._read_outputs())
        if self._config.step_timeout > 0:
            self._liveness = loop.create_task(self._watch_liveness(self._config.step_timeout))
        self._processes.watch(self._on_rank_exit)

    async def wait_ready(self, timeout: float) -> None:
        """Return once every rank reported ready; raise StartupError on failure or timeout."""
        ready = asyncio.ensure_future(self._all_ready.wait())
        failed = asyncio.ensure_future(self._failed.wait())
        try:
            done, _ = await asyncio.wait(
                {ready, failed}, timeout=timeout or None, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            ready.cancel()
            failed.cancel()
        if self._failure is not None:
            raise StartupError(self._failure)
        if not done:
            waiting = sorted(set(range(self._config.dp)) - self._ready)
            raise StartupError(
                f"DP ranks {waiting} were not ready within --startup-timeout "
                f"{self._config.startup_timeout:g}s"
            )

    async def close(self, timeout: float) -> None:
        """Stop every rank (agreed stop, then terminate) and release the sockets."""
        self.fail_all(shutdown_error())
        self._processes.lockstep.request_stop()
        for socket in self._inboxes:
            with contextlib.suppress(zmq.ZMQError):
                socket.send(_SHUTDOWN, zmq.NOBLOCK)
        await self._processes.stop(timeout)
        for task in (self._reader, self._liveness):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        for socket in self._inboxes:
            socket.close()
        self._outbox.close()
        self._context.term()

    # Requests

    @property
    def failure(self) -> str | None:
        """Why the service failed, or None while every rank is healthy."""
        return self._failure

    @property
    def num_in_flight(self) -> int:
        return len(self._handles)

    def submit(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingOptions,
        deadline: float | None,
    ) -> RequestHandle:
        """Admit a request and start it on the least-loaded rank (429/503 when it cannot)."""
        if self._failure is not None:
            raise ServiceUnavailableError(f"the service has failed: {self._failure}")
        if self.draining:
            raise shutdown_error()
        capacity = self._config.admission_capacity
        if len(self._handles) >= capacity:
            raise OverloadedError(
                f"the server is at capacity ({capacity} requests in flight); retry later"
            )
        rank = choose_rank(self._in_flight)
        handle = RequestHandle(request_id, rank, self._on_handle_closed, deadline)
        self._handles[request_id] = handle
        self._in_flight[rank] += 1
        prompt = array.array("i", prompt_token_ids)
        if sys.byteorder != "little":
            prompt.byteswap()
        message = AddRequest(request_id, prompt.tobytes(), sampling)
        self._inboxes[rank].send(to_rank_encoder.encode(message), copy=False)
        for other, socket in enumerate(self._inboxes):
            if other != rank:
                socket.send(_WAKE, copy=False)
        return handle

    def fail_all(self, error: ApiError) -> None:
        """End every request in flight with `error` (their engine requests are aborted)."""
        for handle in list(self._handles.values()):
            handle.fail(error)

    async def wait_idle(self, timeout: float, give_up: Callable[[], bool] = lambda: False) -> None:
        """Wait until no request is in flight, at most `timeout` seconds or until `give_up()`."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self._handles and loop.time() < deadline and not give_up():
            await asyncio.sleep(0.05)

    # Internals

    def _on_handle_closed(self, handle: RequestHandle, abort: bool) -> None:
        if self._handles.pop(handle.request_id, None) is None:
            return
        self._in_flight[handle.rank] -= 1
        if abort and self._failure is None:
            message = to_rank_encoder.encode(AbortRequests([handle.request_id]))
            with contextlib.suppress(zmq.ZMQError):
                self._inboxes[handle.rank].send(message, copy=False)

    def _on_rank_exit(self, rank: int, exitcode: int | None) -> None:
        # A rank that fails on purpose reports why just before it exits; give that report a
        # moment to arrive so that /health names the cause rather than only the exit code.
        asyncio.get_running_loop().call_later(
            _EXIT_REPORT_GRACE_SECONDS,
            self._fail_service,
            f"DP rank {rank} exited unexpectedly with exit code {exitcode}",
        )

    def _fail_service(self, reason: str) -> None:
        if self._failure is not None:
            return
        self._failure = reason
        logger.error("service failed: %s; restart the server", reason)
        self._failed.set()
        # Peers blocked in a collective with the failed rank would wait forever: break it. On a
        # thread, because a rank killed while holding the barrier's internal lock leaves that
        # lock taken for good, and the event loop must never wait on it.
        threading.Thread(
            target=self._processes.lockstep.abort, name="lockstep-abort", daemon=True
        ).start()
        error = ServiceUnavailableError(f"the service has failed: {reason}")
        for handle in list(self._handles.values()):
            handle.fail(error, engine_finished=True)

    async def _read_outputs(self) -> None:
        # Await one message, then take what else is already queued without a future per message
        # (at high step rates that is most of them), but few enough to keep the loop fair.
        drain: zmq.Socket[bytes] = zmq.Socket.shadow(self._outbox.underlying)
        while True:
            self._handle_message(await self._outbox.recv(copy=False))
            for _ in range(_DRAIN_BATCH):
                try:
                    frame = drain.recv(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                self._handle_message(frame)

    def _handle_message(self, frame: zmq.Frame) -> None:
        message = from_rank_decoder.decode(frame.buffer)
        if isinstance(message, StepOutputs):
            self._dispatch(message)
        elif isinstance(message, RequestRejected):
            handle = self._handles.get(message.request_id)
            if handle is not None:
                error = EngineRequestError(message.message, status_code=message.status_code)
                handle.fail(error, engine_finished=True)
        elif isinstance(message, RankReady):
            self._ready.add(message.rank)
            logger.info("[startup] DP rank %d is ready (pid %d)", message.rank, message.pid)
            if len(self._ready) == self._config.dp:
                self._all_ready.set()
        elif isinstance(message, RankFailed):
            logger.error("DP rank %d failed:\n%s", message.rank, message.traceback)
            self._fail_service(f"DP rank {message.rank} failed: {message.message}")

    async def _watch_liveness(self, step_timeout: float) -> None:
        """Fail the service when a rank completes no step for `step_timeout` seconds while the
        engine has work: a hung engine (a dead collective peer, a wedged kernel) must not keep
        answering 200 on /health."""
        loop = asyncio.get_running_loop()
        interval = min(1.0, step_timeout / 4)
        while self._failure is None:
            await asyncio.sleep(interval)
            now = loop.time()
            if not any(not h.engine_finished for h in self._handles.values()):
                # No engine work: the clock only runs while requests are in the engine.
                self._last_report = [now] * len(self._last_report)
                continue
            for rank, last in enumerate(self._last_report):
                if now - last > step_timeout:
                    self._fail_service(
                        f"DP rank {rank} completed no engine step for {step_timeout:g}s "
                        "(--step-timeout) while requests were in flight; the engine is hung"
                    )
                    return

    def _rank_counts(self) -> list[tuple[int, int, int]]:
        """(rank, running, waiting) for every rank, from the requests in flight."""
        running = [0] * self._config.dp
        waiting = [0] * self._config.dp
        for handle in self._handles.values():
            if handle.engine_finished:
                continue
            if handle.has_first_token:
                running[handle.rank] += 1
            else:
                waiting[handle.rank] += 1
        return [(rank, running[rank], waiting[rank]) for rank in range(self._config.dp)]

    def _dispatch(self, message: StepOutputs) -> None:
        self._last_report[message.rank] = asyncio.get_running_loop().time()
        # Request timings use perf_counter: uvloop's loop clock has millisecond resolution.
        now = time.perf_counter()
        self._metrics.observe_step(message.rank, message.step_seconds)
        handles = self._handles
        step_seconds = message.step_seconds
        for output in message.outputs:
            handle = handles.get(output.request_id)
            if handle is None:
                continue
            reason = output.finish_reason
            if reason in ("", "stop", "length"):
                handle.deliver(output.token_ids, reason, now, step_seconds)
            else:
                handle.deliver(output.token_ids, "", now, step_seconds)
                handle.fail(finish_reason_error(reason), engine_finished=True)
