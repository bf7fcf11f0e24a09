"""Coordinator: what the HTTP layer uses to run requests on the DP ranks.

It admits requests (429 beyond capacity), starts each on the least-loaded rank (with
`--enable-prefix-caching` and DP > 1, on the rank that holds its session or its prompt's
longest cached prefix unless that one is much more loaded: `rank_router.py`), fans
every rank's step outputs out to the live RequestHandles, and owns the service's health: a
failed or hung rank fails the whole service (every handle ends with a 503, new requests get
503, and `/health` reports the reason until the server is restarted).

It owns no process: whoever spawned the ranks (`server.ranks.RankGroup`) reports their exits
(`rank_exited`) and learns of the service's failure through `on_failure` (to break the ranks'
collectives). With several API server processes (`--api-server-count`) each has a Coordinator
of its own over the same ranks: admission is shared (`SharedAdmission`), and a failure seen by
one process reaches the others through `on_failure` and `fail_service`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from deepinfer_server.config import ResolvedConfig
from deepinfer_server.coordinator.admission import Admission, SharedAdmission, Ticket
from deepinfer_server.coordinator.channels import RankChannels
from deepinfer_server.coordinator.delivery import deliver_step
from deepinfer_server.coordinator.failure_cause import FailureCause
from deepinfer_server.coordinator.handle import RequestHandle
from deepinfer_server.coordinator.liveness import LivenessWatch
from deepinfer_server.coordinator.outcomes import error_for_rejection
from deepinfer_server.coordinator.rank_reports import RankReports
from deepinfer_server.coordinator.rank_router import Placement, RankRouter
from deepinfer_server.coordinator.readiness import Readiness
from deepinfer_server.coordinator.session_routing import RouteHint, SessionNames
from deepinfer_server.disaggregation.handoff.params import KVTransferParams
from deepinfer_server.errors import (
    ApiError,
    OverloadedError,
    ServiceFailedError,
    ShuttingDownError,
    StartupError,
)
from deepinfer_server.ipc.codec import pack_token_ids
from deepinfer_server.ipc.messages import (
    AbortReason,
    FromRank,
    GrammarWarm,
    Images,
    RankAlive,
    RankFailed,
    RankReady,
    RequestRejected,
    SamplingOptions,
    StepOutputs,
)
from deepinfer_server.metrics import RankLoad, ServerMetrics

logger = logging.getLogger(__name__)


class Coordinator:
    """The API process's handle on all DP ranks. Use from the event loop thread only."""

    def __init__(
        self,
        config: ResolvedConfig,
        channels: RankChannels,
        metrics: ServerMetrics,
        *,
        admission: Admission | SharedAdmission | None = None,
        on_failure: Callable[[str], None] | None = None,
        on_rank_report: Callable[[int, str], None] | None = None,
    ) -> None:
        self._config = config
        self._metrics = metrics
        metrics.watch_ranks(self.rank_loads, lambda: self._failure is None)
        self._channels = channels
        self._on_failure = on_failure
        self._admission = admission or Admission.for_config(config)
        metrics.watch_tenants(self._admission.tenant_counts)
        self._handles: dict[str, RequestHandle] = {}
        #: Each request's place in admission, and, until it starts, its framed AddRequest.
        self._tickets: dict[str, Ticket] = {}
        self._unsent: dict[str, tuple[bytes, Placement]] = {}
        self._stop_wakes: Callable[[], None] | None = None
        #: Handles whose sinks are due once the messages that arrived together are delivered.
        self._to_flush: list[RequestHandle] = []
        self._router = RankRouter(config, metrics)
        self._reports = RankReports(config.data_parallel_size, metrics, self._router.directory)
        self.readiness = Readiness(config.data_parallel_size)
        self.bootstrap_ports = self.readiness.bootstrap_ports
        self._failure: str | None = None
        self._causes = FailureCause(self._fail_service)
        #: Where a rank's failure report goes when this process cannot see rank exits (an API
        #: server process: the supervisor sees them and weighs the reports); else `_causes`.
        self._on_rank_report = on_rank_report or self._causes.report
        self._failed = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = False
        self._liveness = LivenessWatch(
            config.data_parallel_size,
            config.step_timeout,
            self._fail_service,
            watching=lambda: self._failure is None and not self._stopping,
        )
        self.draining = False

    # Lifecycle

    def start(self) -> None:
        """Start reading from the ranks and watching their loops."""
        loop = asyncio.get_running_loop()
        self._tasks.append(loop.create_task(self._channels.read(self._on_messages)))
        if isinstance(self._admission, SharedAdmission):
            # Another process freed a slot whose next request waits here.
            self._stop_wakes = self._admission.watch_wakes(self._start_ready)
        if self._config.step_timeout > 0:
            self._tasks.append(loop.create_task(self._liveness.run()))

    async def wait_ready(self, timeout: float) -> None:
        """Return once every rank reported ready; raise StartupError on failure or timeout."""
        settled = await self.readiness.wait(self._failed, timeout)
        if self._failure is not None:
            raise StartupError(self._failure)
        if not settled:
            raise self.readiness.timed_out(timeout)

    def begin_shutdown(self) -> None:
        """The ranks are being stopped: end every request with a 503 and wake idle ranks, so
        they reach their agreed stop promptly."""
        self.stop_watching()
        self.fail_all(ShuttingDownError())
        self._channels.send_shutdown()

    def stop_watching(self) -> None:
        """The ranks are about to leave their loops: their silence from now on is no hang."""
        self._stopping = True

    async def release(self) -> None:
        """Stop reading from the ranks and close the sockets (the ranks are stopped, or are
        another process's to stop)."""
        if self._stop_wakes is not None:
            self._stop_wakes()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._channels.close()

    # Requests

    @property
    def failure(self) -> str | None:
        """Why the service failed, or None while every rank is healthy."""
        return self._failure

    @property
    def num_in_flight(self) -> int:
        return len(self._handles)

    @property
    def admitted(self) -> int:
        """Requests admitted now, by every API server process."""
        return self._admission.total

    def admitted_at(self, priority: int) -> int:
        """This process's requests of `priority` admitted now (`admission.py`)."""
        return self._admission.admitted_at(priority)

    def submit(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingOptions,
        deadline: float | None,
        images: Images | None = None,
        kv_transfer_params: KVTransferParams | None = None,
        cache_salt: bytes | None = None,
        *,
        tenant: int = 0,
        priority: int = 0,
        session: SessionNames | None = None,
    ) -> RequestHandle:
        """Admit a request of `tenant` (an index into `config.tenants`) and start it when its
        turn comes (`admission.py`): on the least-loaded rank with a free slot, or the rank
        holding its `session` or its prompt's cached prefix under its `cache_salt` (429/503
        when it cannot be admitted).

        The returned handle owns the request's admission slot and its place among the requests
        in flight: closing it frees both, once, whether it is still queued or already started.
        If admitting or starting fails, at any step, what was taken is freed before the error
        is raised.
        """
        if self._failure is not None:
            raise ServiceFailedError(f"the service has failed: {self._failure}")
        if self.draining:
            raise ShuttingDownError()
        assert request_id not in self._handles, f"request {request_id} is already in flight"
        packed = pack_token_ids(prompt_token_ids)  # OverflowError for an ID outside int32
        placement = self._router.placement(
            packed, len(prompt_token_ids), cache_salt, tenant, session
        )
        ticket = self._admit(request_id, tenant, priority, placement.hint)
        handle = self._new_handle(ticket, deadline)
        try:
            handle.context_tokens = len(prompt_token_ids)
            self._unsent[request_id] = (
                self._channels.frame_add(
                    request_id, packed, sampling, images, cache_salt, kv_transfer_params
                ),
                placement,
            )
        except BaseException:
            handle.withdraw()
            raise
        self._metrics.observe_admission(self._admission.tenant_name(tenant), admitted=True)
        self._start_ready(own=ticket)
        return handle

    def _admit(self, request_id: str, tenant: int, priority: int, hint: RouteHint | None) -> Ticket:
        """A place in admission for the request (OverloadedError, counted, when there is none)."""
        try:
            ticket = self._admission.admit(tenant, priority, hint)
        except OverloadedError:
            self._metrics.observe_admission(self._admission.tenant_name(tenant), admitted=False)
            raise
        ticket.request_id = request_id
        return ticket

    def _new_handle(self, ticket: Ticket, deadline: float | None) -> RequestHandle:
        """The admitted request's handle, which owns `ticket` and its place in `_handles`
        from here on: closing it (once, on any path) frees both."""
        queue_timeout = self._config.queue_timeout
        try:
            handle = RequestHandle(
                ticket.request_id,
                None,
                self._on_handle_closed,
                deadline,
                self._config.stream_interval,
                asyncio.get_running_loop().time() + queue_timeout if queue_timeout else None,
            )
        except BaseException:
            self._admission.release(ticket)
            raise
        self._handles[ticket.request_id] = handle
        self._tickets[ticket.request_id] = ticket
        self._idle.clear()
        return handle

    def _start_ready(self, own: Ticket | None = None) -> None:
        """Send every request whose turn has come to its rank; a failure to start `own` (the
        request being submitted) is raised once the others are sent."""
        if self._failure is not None or self._stopping:
            return
        error: BaseException | None = None
        for ticket in self._admission.ready():
            try:
                self._start(ticket)
            except BaseException as exc:
                if ticket is own:
                    error = exc
                else:
                    logger.exception("request %s: could not be started", ticket.request_id)
        if error is not None:
            raise error

    def _start(self, ticket: Ticket) -> None:
        request_id, rank = ticket.request_id, ticket.rank
        assert rank is not None
        handle = self._handles[request_id]
        framed, placement = self._unsent.pop(request_id)
        handle.rank = rank
        try:
            self._channels.send_framed_add(rank, framed)
            self._router.placed(rank, request_id, placement)
            logger.debug(
                "request %s: %d prompt tokens to DP rank %d (%d in flight)",
                request_id,
                handle.context_tokens,
                rank,
                len(self._handles),
            )
        except BaseException:
            # The rank may have it: abort it there too.
            handle.fail(ServiceFailedError("the request could not be sent to its DP rank"))
            handle.close(AbortReason.ROLLBACK)
            raise

    def fail_all(self, error: ApiError) -> None:
        """End every request in flight with `error` (their engine requests are aborted)."""
        for handle in list(self._handles.values()):
            handle.fail(error)

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no request is in flight, at most `timeout` seconds; True if idle."""
        try:
            async with asyncio.timeout(timeout):
                await self._idle.wait()
        except TimeoutError:
            return False
        return True

    # Internals

    def _on_handle_closed(self, handle: RequestHandle, aborted: bool, reason: AbortReason) -> None:
        if self._handles.pop(handle.request_id, None) is None:
            return
        ticket = self._tickets.pop(handle.request_id)
        self._unsent.pop(handle.request_id, None)
        self._admission.release(ticket)
        if not self._handles:
            self._idle.set()
        if aborted and self._failure is None and handle.rank is not None:
            self._channels.send_abort(handle.rank, [handle.request_id])
            self._metrics.observe_abort(reason)
            logger.debug(
                "request %s: aborted on DP rank %d (%s)", handle.request_id, handle.rank, reason
            )
        self._start_ready()

    def rank_exited(self, rank: int, reason: str) -> None:
        """Rank `rank` exited unexpectedly (seen by the process that spawned it)."""
        self._causes.exit(rank, reason)

    def fail_service(self, reason: str) -> None:
        """Fail the service for `reason` (seen elsewhere: by the supervisor or another API
        server process); a no-op once it has failed."""
        self._fail_service(reason)

    def _fail_service(self, reason: str) -> None:
        if self._failure is not None:
            return
        self._failure = reason
        logger.error("service failed: %s; restart the server", reason)
        self._failed.set()
        if self._on_failure is not None:
            self._on_failure(reason)
        error = ServiceFailedError(f"the service has failed: {reason}")
        for handle in list(self._handles.values()):
            if not handle.engine_finished:
                self._metrics.observe_abort(AbortReason.RANK_FAILURE)
            handle.fail(error, engine_finished=True)

    def _on_messages(self, messages: list[FromRank]) -> None:
        """Messages that arrived together: every stream's sink is called once, after all of
        them are delivered, so that steps that arrived together make one write per stream."""
        for message in messages:
            self._on_message(message)
        to_flush, self._to_flush = self._to_flush, []
        for handle in to_flush:
            handle.flush()

    def _on_message(self, message: FromRank) -> None:
        if isinstance(message, StepOutputs):
            self._dispatch(message)
        elif isinstance(message, RankAlive):
            self._liveness.reported(message.rank, asyncio.get_running_loop().time())
        elif isinstance(message, RequestRejected):
            handle = self._handles.get(message.request_id)
            if handle is not None:
                handle.fail(error_for_rejection(message), engine_finished=True)
                self._engine_done(message.request_id)
        elif isinstance(message, RankReady | GrammarWarm):
            self._liveness.reported(message.rank, asyncio.get_running_loop().time())
            self.readiness.report(message)
        elif isinstance(message, RankFailed):
            logger.error("DP rank %d failed:\n%s", message.rank, message.traceback)
            self._on_rank_report(message.rank, f"DP rank {message.rank} failed: {message.message}")

    def _engine_done(self, request_id: str) -> None:
        """The engine ended a request: its running slot goes to the next request now, not
        when the response has been written to the client."""
        ticket = self._tickets.get(request_id)
        if ticket is not None:
            self._admission.finished(ticket)
            self._start_ready()

    def rank_loads(self) -> list[RankLoad]:
        """Every rank's running and waiting requests and their tokens (from the requests the
        engine owns) and its KV-cache usage (from its last step report)."""
        return self._reports.loads(self._handles.values())

    def _dispatch(self, message: StepOutputs) -> None:
        self._liveness.reported(message.rank, asyncio.get_running_loop().time())
        # Request timings use perf_counter: uvloop's loop clock has millisecond resolution.
        now = time.perf_counter()
        self._reports.step(message)
        deliver_step(message, self._handles, now, self._engine_done, self._to_flush)
