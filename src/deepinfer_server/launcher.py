"""Server lifecycle: start the ranks, wait until all are ready, serve HTTP, stop everything.

Phases: [startup] load the tokenizer, choose MASTER_PORT, spawn one process per DP rank and
wait for every RankReady (bounded by --startup-timeout, interruptible by SIGTERM/SIGINT); only
then open the HTTP port. [serve] uvicorn with one worker. [shutdown] on SIGTERM/SIGINT: /health
turns 503 and new requests get 503, in-flight requests may finish for --shutdown-timeout
seconds, the rest end with a 503 error, then every rank stops; no rank process outlives it.
The engine backend is chosen from the registry; its implementation is imported only in the
rank processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import sys
import tempfile
from collections.abc import Callable, Coroutine, Generator
from types import FrameType
from typing import Any

import uvicorn

from deepinfer_server.api.app import build_app
from deepinfer_server.api.connection import (
    ConnectionLimits,
    fit_to_file_limit,
    guarded_protocol,
)
from deepinfer_server.api.state import AppState
from deepinfer_server.config import ResolvedConfig
from deepinfer_server.coordinator.channels import RankChannels
from deepinfer_server.coordinator.coordinator import Coordinator
from deepinfer_server.coordinator.process import RankProcesses
from deepinfer_server.engines.backend import EngineBackend, EngineSpec
from deepinfer_server.engines.registry import get_backend
from deepinfer_server.errors import ConfigError, ShuttingDownError, StartupError
from deepinfer_server.ipc.stop_agreement import StopAgreement
from deepinfer_server.metrics import ServerMetrics
from deepinfer_server.model_source import resolve_model
from deepinfer_server.ports import choose_master_port
from deepinfer_server.protocol.images import ImageLimits
from deepinfer_server.protocol.recipe import RecipeContext
from deepinfer_server.protocol.structured import StructuredOutputs
from deepinfer_server.rank.proc import run_rank
from deepinfer_server.rank.spec import RankSpec
from deepinfer_server.tokenizer import load_tokenizer_json

logger = logging.getLogger("deepinfer_server")

RANK_STOP_TIMEOUT = 15.0


class _Server(uvicorn.Server):
    """uvicorn's server with a drain before its shutdown, and signals that stay handled."""

    def __init__(self, config: uvicorn.Config, state: AppState) -> None:
        super().__init__(config)
        self._state = state
        self._forced = asyncio.Event()

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        # uvicorn re-raises captured signals after serving, which would kill this process
        # before the ranks are stopped; record them only.
        original = {s: signal.signal(s, self.handle_exit) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        if self.force_exit:  # a second signal: stop draining now
            asyncio.get_event_loop().call_soon_threadsafe(self._forced.set)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        coordinator = self._state.coordinator
        coordinator.draining = True
        grace = self._state.config.shutdown_timeout
        if grace > 0 and coordinator.num_in_flight:
            logger.info(
                "[shutdown] draining %d request(s) for up to %gs (Ctrl-C again to stop now)",
                coordinator.num_in_flight,
                grace,
            )
            forced = asyncio.ensure_future(self._forced.wait())
            idle = asyncio.ensure_future(coordinator.wait_idle(grace))
            await asyncio.wait({forced, idle}, return_when=asyncio.FIRST_COMPLETED)
            forced.cancel()
            idle.cancel()
        coordinator.fail_all(ShuttingDownError())
        await super().shutdown(sockets)


def _rank_specs(
    config: ResolvedConfig,
    backend: EngineBackend,
    checkpoint: str | None,
    workdir: str,
    master_port: int,
) -> list[RankSpec]:
    environments = backend.rank_environments(config, master_port)
    return [
        RankSpec(
            engine=EngineSpec(
                rank=rank,
                model=checkpoint,
                served_model_name=config.served_model_name,
                data_parallel_size=config.data_parallel_size,
                context_parallel_size=config.context_parallel_size,
                expert_parallel_size=config.expert_parallel_size,
                max_model_len=config.max_model_len,
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                options=config.engine_options,
                environment=environments[rank],
                prefill_attempt_interval=config.prefill_attempt_interval,
                prefill_any_attempt_interval=config.prefill_any_attempt_interval,
            ),
            builder=backend.builder,
            backend_name=backend.name,
            inbox_address=f"ipc://{workdir}/rank{rank}.in",
            outbox_address=f"ipc://{workdir}/ranks.out",
            log_level=config.log_level,
        )
        for rank in range(config.data_parallel_size)
    ]


@contextlib.contextmanager
def _startup_signals(task: asyncio.Task[None]) -> Generator[None, None, None]:
    """During start-up, SIGTERM/SIGINT cancel it (uvicorn takes over the signals afterwards)."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, task.cancel)
    try:
        yield
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


async def serve(config: ResolvedConfig) -> int:
    """Run the server until it is told to stop; returns the process exit code."""
    backend = get_backend(config.engine)
    backend.check_installed()
    checkpoint = resolve_model(config.model, backend)
    backend.preflight(config, checkpoint)
    master_port = choose_master_port(config.port)
    tokenizer_json = load_tokenizer_json(checkpoint)
    try:
        recipe = RecipeContext.create(
            tokenizer_json,
            config.served_model_names,
            config.max_model_len,
            default_thinking=config.default_thinking == "enabled",
            reasoning_secret=config.reasoning_secret,
            image_limits=ImageLimits.of(config),
        )
    except (OSError, ValueError, RuntimeError) as exc:
        raise ConfigError(f"cannot load the tokenizer: {exc}") from exc
    with tempfile.TemporaryDirectory(prefix="deepinfer-server-") as workdir:
        specs = _rank_specs(config, backend, checkpoint, workdir, master_port)
        stop = StopAgreement()
        shared = backend.shared_state(config)
        processes = RankProcesses(run_rank, [(spec, stop, shared) for spec in specs])
        metrics = ServerMetrics(config.served_model_name)
        channels = RankChannels([s.inbox_address for s in specs], specs[0].outbox_address)
        coordinator = Coordinator(
            config,
            processes,
            channels,
            stop,
            shared.abort if shared is not None else lambda: None,
            metrics,
        )
        try:
            processes.start()
            coordinator.start()
            startup = asyncio.ensure_future(coordinator.wait_ready(config.startup_timeout))
            with _startup_signals(startup):
                try:
                    await startup
                except asyncio.CancelledError:
                    logger.info("[startup] interrupted")
                    return 0
                except StartupError as exc:
                    logger.error("[startup] failed: %s", exc)
                    return 1
            logger.info(
                "[startup] %d DP rank(s) ready (EP=%d, CP=%d, MASTER_PORT=%d); serving %s on %s:%d",
                config.data_parallel_size,
                config.expert_parallel_size,
                config.context_parallel_size,
                master_port,
                ", ".join(config.served_model_names),
                config.host,
                config.port,
            )
            state = AppState(
                config=config,
                recipe=recipe,
                coordinator=coordinator,
                metrics=metrics,
                structured=StructuredOutputs(tokenizer_json),
            )
            server = _Server(
                uvicorn.Config(
                    build_app(state),
                    host=config.host,
                    port=config.port,
                    log_level=config.log_level,
                    lifespan="off",
                    timeout_graceful_shutdown=5,
                    access_log=False,
                    http=guarded_protocol(
                        ConnectionLimits(
                            header_timeout=config.header_timeout,
                            write_timeout=config.write_timeout,
                            max_connections=fit_to_file_limit(config.max_connections),
                        )
                    ),
                ),
                state,
            )
            await server.serve()
            if not server.started:
                return 1
            return 0
        finally:
            logger.info("[shutdown] stopping DP ranks")
            await coordinator.close(RANK_STOP_TIMEOUT)
            logger.info("[shutdown] done")


def run(config: ResolvedConfig) -> int:
    """Run the server in a fresh event loop (uvloop when installed)."""
    logging.basicConfig(
        level=config.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    runner: Callable[[Coroutine[Any, Any, int]], int] = asyncio.run
    with contextlib.suppress(ImportError):  # uvloop comes with uvicorn[standard]
        import uvloop

        runner = uvloop.run
    try:
        return int(runner(serve(config)))
    except ConfigError as exc:
        print(f"deepinfer-server: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0
