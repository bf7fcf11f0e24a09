"""The HTTP side of one API server process: uvicorn with a drain before its shutdown.

Shared by the single-process server (`launcher`) and each API server process of
`--api-server-count` (`api_worker`). On SIGTERM (or SIGINT): /health turns 503 and new requests
get 503, in-flight requests may finish for --shutdown-timeout seconds (a second signal ends the
wait), the rest end with a 503 error, then uvicorn shuts down.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import signal
import socket
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from typing import Any

import uvicorn

from deepinfer_server.api.app import build_app
from deepinfer_server.api.connection import (
    ConnectionLimits,
    fit_to_file_limit,
    guarded_protocol,
)
from deepinfer_server.api.request_head import HeadLimits
from deepinfer_server.api.state import AppState, Peers
from deepinfer_server.api.transport import HTTP_PROTOCOL, HookedServer
from deepinfer_server.concurrency import first_of
from deepinfer_server.config import ResolvedConfig
from deepinfer_server.coordinator.coordinator import Coordinator
from deepinfer_server.disaggregation.handoff.peers import PrefillPeers
from deepinfer_server.disaggregation.role import DisaggregationRole
from deepinfer_server.engines.registry import get_backend
from deepinfer_server.errors import ShuttingDownError, StartupError, StoreUnavailableError
from deepinfer_server.grammar.compile_queue import QueueLimits
from deepinfer_server.metrics import ServerMetrics
from deepinfer_server.model.tokenizer import load_tokenizer_config, prompt_id_bound
from deepinfer_server.protocol.core.images import ImageLimits
from deepinfer_server.protocol.core.recipe import RecipeContext
from deepinfer_server.protocol.core.structured_outputs import StructuredOutputs
from deepinfer_server.store import ResponseStore
from deepinfer_server.store.location import open_store

logger = logging.getLogger("deepinfer_server")

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
#: Seconds between two evictions of expired (and over-cap) responses from the store.
EVICT_INTERVAL = 60.0
#: Seconds store writes still running at shutdown may take.
WRITES_AT_SHUTDOWN = 5.0


class HttpServer(HookedServer):
    """uvicorn's server with a drain before its shutdown, and signals that stay handled."""

    def __init__(
        self,
        config: uvicorn.Config,
        state: AppState,
        *,
        signals: Sequence[signal.Signals] = STOP_SIGNALS,
        on_started: Callable[[], None] | None = None,
    ) -> None:
        """`signals`: those that drain; with only SIGTERM (an API server process of
        --api-server-count, whose supervisor forwards signals), a second SIGTERM ends the
        drain, as a second SIGINT does otherwise."""
        super().__init__(config, signals)
        self._state = state
        self._started_callback = on_started

    @property
    def state(self) -> AppState:
        return self._state

    def on_stop_signal(self) -> None:
        self._state.coordinator.draining = True  # /health and new requests: 503 from now on

    def on_started(self) -> None:
        if self._state.config.grammar_warmup:
            # Once the port answers: loading xgrammar (and PyTorch) beside the ranks' start
            # slowed it by seconds on a small machine. `/health` says `starting` until it is
            # warm (`api/warmup.py`).
            self._state.warmup.start()
        if self._state.background_runs is not None:
            self._state.background_runs.start()
        if self._state.batches is not None:
            self._state.batches.start()
        if self._started_callback is not None:
            self._started_callback()

    async def before_shutdown(self) -> None:
        coordinator = self._state.coordinator
        coordinator.draining = True
        if self._state.batches is not None:  # their lines are given back for the next start
            await self._state.batches.stop()
        grace = self._state.config.shutdown_timeout
        if grace > 0 and coordinator.num_in_flight:
            logger.info(
                "[shutdown] draining %d request(s) for up to %gs (Ctrl-C again to stop now)",
                coordinator.num_in_flight,
                grace,
            )
            await first_of(self.stop_now.wait(), coordinator.wait_idle(grace))
        coordinator.fail_all(ShuttingDownError())
        if self._state.background_runs is not None:  # those left are marked failed
            await self._state.background_runs.stop()

    async def after_shutdown(self) -> None:
        self._state.structured.close()


@contextlib.asynccontextmanager
async def response_store(
    config: ResolvedConfig, *, evicts: bool
) -> AsyncIterator[ResponseStore | None]:
    """This process's connection to the Responses store (None without one), evicting old
    responses and conversations now and then when `evicts` (one API server process of several
    does)."""
    if config.response_store is None:
        yield None
        return
    store = open_store(
        config.response_store,
        ttl=config.response_store_ttl,
        max_bytes=config.response_store_max_bytes,
        scope_max_bytes=config.response_store_scope_max_bytes,
        response_max_bytes=config.response_store_max_response_bytes,
        scope_max_files=config.files_key_max_count,
    )
    with contextlib.suppress(StoreUnavailableError):  # logged; the requests that need it: 503
        await store.open()
    logger.info("[startup] Responses store: %s", store.description)
    evictions = (
        [
            # Responses, conversations, files and ended batches (`store.schema.SCOPED_TABLES`).
            asyncio.ensure_future(store.evict_periodically(EVICT_INTERVAL)),
        ]
        if evicts
        else []
    )
    try:
        yield store
    finally:
        for eviction in evictions:
            eviction.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await eviction
        await store.close()


def create_recipe(
    config: ResolvedConfig,
    tokenizer_json: str,
    checkpoint: str | None = None,
    reasoning_key: bytes | None = None,
) -> RecipeContext:
    """The recipe context of the served model (raises OSError, ValueError or RuntimeError when
    the tokenizer cannot be loaded). `reasoning_key` is the seal's key every API server process
    shares (default: one from `--reasoning-secret`, random without it)."""
    backend = get_backend(config.engine)
    return RecipeContext.create(
        tokenizer_json,
        config.served_model_names,
        config.max_model_len,
        default_thinking=config.default_thinking == "enabled",
        reasoning_secret=config.reasoning_secret,
        image_limits=ImageLimits.of(config),
        reasoning_key=reasoning_key,
        prompt_id_bound=prompt_id_bound(checkpoint),
        prompt_logprobs_unavailable=backend.prompt_logprobs_unavailable(),
        image_policy=backend.image_policy(checkpoint, tokenizer_json),
        clamp_max_tokens=config.clamp_max_tokens,
        tokenizer_config=load_tokenizer_config(checkpoint),
    )


def http_config(
    app: Any, state: AppState, protocol: type[asyncio.Protocol] = HTTP_PROTOCOL
) -> uvicorn.Config:
    """uvicorn's configuration for `app`: the server's options, on uvicorn's HTTP `protocol`
    (httptools' when installed, else h11's) with the connection guards."""
    config = state.config
    heads = HeadLimits(config.max_header_bytes, config.max_header_line_bytes)
    return uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        log_level=config.log_level,
        lifespan="off",
        timeout_graceful_shutdown=5,
        access_log=False,
        # h11 has a head bound of its own, 16 KiB by default and answered with a plain 400:
        # kept above ours, which answers first.
        h11_max_incomplete_event_size=2 * heads.max_bytes,
        http=guarded_protocol(
            ConnectionLimits(
                header_timeout=config.header_timeout,
                write_timeout=config.write_timeout,
                max_connections=fit_to_file_limit(config.max_connections),
                heads=heads,
                receiving=state.receiving,
                on_refused=state.metrics.observe_failure,
            ),
            protocol,
        ),
    )


def build_server(
    config: ResolvedConfig,
    recipe: RecipeContext,
    tokenizer_json: str,
    coordinator: Coordinator,
    metrics: ServerMetrics,
    *,
    peers: Peers | None = None,
    signals: Sequence[signal.Signals] = STOP_SIGNALS,
    on_started: Callable[[], None] | None = None,
    store: ResponseStore | None = None,
) -> HttpServer:
    """The app and its uvicorn server for one API server process (ranks already ready)."""
    limits = QueueLimits(config.max_queued_compiles_per_key, config.grammar_queue_timeout)
    structured = StructuredOutputs(tokenizer_json, limits=limits)
    state = AppState(
        config=config,
        recipe=recipe,
        coordinator=coordinator,
        metrics=metrics,
        structured=structured,
        peers=peers,
        store=store,
        prefill_peers=PrefillPeers(lambda: coordinator.readiness.layout)
        if config.disaggregation_mode is DisaggregationRole.DECODE
        else None,
    )
    metrics.watch_compile_queue(
        structured.queue_stats, lambda: structured.warm and coordinator.readiness.grammar_ready
    )
    metrics.watch_receive_buffer(lambda: state.receiving.used)
    metrics.watch_transport(lambda: coordinator.readiness.layout)
    return HttpServer(
        http_config(build_app(state), state),
        state,
        signals=signals,
        on_started=on_started,
    )


async def wait_for_ranks(
    coordinator: Coordinator, timeout: float, signals: Sequence[signal.Signals] = STOP_SIGNALS
) -> int | None:
    """Wait until every rank is ready; None then, else the exit code: 0 when one of `signals`
    interrupted start-up, 1 when it failed (logged). uvicorn takes the signals over afterwards.
    """
    startup = asyncio.ensure_future(coordinator.wait_ready(timeout))
    loop = asyncio.get_running_loop()
    for sig in signals:
        loop.add_signal_handler(sig, startup.cancel)
    try:
        await startup
    except asyncio.CancelledError:
        logger.info("[startup] interrupted")
        return 0
    except StartupError as exc:
        logger.error("[startup] failed: %s", exc)
        return 1
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)
    return None


def bind_listener(config: ResolvedConfig) -> tuple[socket.socket, ResolvedConfig]:
    """The server's TCP socket, bound but not listening (connections are refused until an API
    server serves on it), and the configuration with the port it is bound to: `--port 0` takes
    one the operating system picks, which the start-up line then names."""
    family = socket.AF_INET6 if ":" in config.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((config.host, config.port))
    except OSError:
        sock.close()
        raise
    return sock, dataclasses.replace(config, port=int(sock.getsockname()[1]))


def log_serving(config: ResolvedConfig, master_port: int) -> None:
    """The start-up line that says every rank is ready and what is served where."""
    logger.info(
        "[startup] %d DP rank(s) ready (EP=%d, CP=%d, MASTER_PORT=%d); serving %s on %s:%d%s",
        config.data_parallel_size,
        config.expert_parallel_size,
        config.context_parallel_size,
        master_port,
        ", ".join(config.served_model_names),
        config.host,
        config.port,
        f" with {config.api_server_count} API server processes"
        if config.api_server_count > 1
        else "",
    )


def run_loop(main: Coroutine[Any, Any, int]) -> int:
    """Run `main` in a fresh event loop (uvloop when installed); returns its exit code."""
    runner: Callable[[Coroutine[Any, Any, int]], int] = asyncio.run
    with contextlib.suppress(ImportError):  # uvloop comes with uvicorn[standard]
        import uvloop

        runner = uvloop.run
    return int(runner(main))
