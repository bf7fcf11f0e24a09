"""Server lifecycle: start the ranks, wait until all are ready, serve HTTP, stop everything.

Phases: [startup] load the tokenizer, choose MASTER_PORT, spawn one process per DP rank and
wait for every RankReady (bounded by --startup-timeout, interruptible by SIGTERM/SIGINT); only
then open the HTTP port. [serve] uvicorn with one worker. [shutdown] on SIGTERM/SIGINT: /health
turns 503 and new requests get 503, in-flight requests may finish for --shutdown-timeout
seconds, the rest end with a 503 error, then every rank stops; no rank process outlives it.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import logging
import os
import signal
import socket
import sys
import tempfile
from collections.abc import Callable, Coroutine, Generator
from typing import Any

import uvicorn

from deepinfer_server.api.app import build_app
from deepinfer_server.api.state import AppState
from deepinfer_server.config import ServerConfig
from deepinfer_server.coordinator.client import EngineClient, StartupError, shutdown_error
from deepinfer_server.coordinator.process import RankProcesses
from deepinfer_server.errors import ConfigError
from deepinfer_server.ipc.lockstep import new_lockstep_group
from deepinfer_server.metrics import ServerMetrics
from deepinfer_server.model_source import resolve_model
from deepinfer_server.ports import choose_master_port
from deepinfer_server.protocol.recipe import RecipeContext
from deepinfer_server.rank.environment import rank_environment, visible_gpus
from deepinfer_server.rank.spec import RankSpec
from deepinfer_server.tokenizer import load_tokenizer_json

logger = logging.getLogger("deepinfer_server")

RANK_STOP_TIMEOUT = 15.0


class _Server(uvicorn.Server):
    """uvicorn's server with a drain before its shutdown, and signals that stay handled."""

    def __init__(self, config: uvicorn.Config, state: AppState) -> None:
        super().__init__(config)
        self._state = state

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

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        engine = self._state.engine
        engine.draining = True
        grace = self._state.config.shutdown_timeout
        if grace > 0 and engine.num_in_flight:
            logger.info(
                "[shutdown] draining %d request(s) for up to %gs (Ctrl-C again to stop now)",
                engine.num_in_flight,
                grace,
            )
            await engine.wait_idle(grace, give_up=lambda: self.force_exit)
        engine.fail_all(shutdown_error())
        await super().shutdown(sockets)


def _rank_specs(
    config: ServerConfig, local_model: str | None, workdir: str, master_port: int
) -> list[RankSpec]:
    if config.engine == "deepinfer":
        gpus = visible_gpus(os.environ)
        environments = [
            rank_environment(rank, gpus, config.cp, config.expert_parallel_size, master_port)
            for rank in range(config.dp)
        ]
    else:
        plain = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master_port)}
        environments = [plain] * config.dp
    return [
        RankSpec(
            rank=rank,
            engine=config.engine,
            model=local_model,
            served_model_name=config.served_model_names[0],
            data_parallel_size=config.dp,
            context_parallel_size=config.cp,
            expert_parallel_size=config.expert_parallel_size,
            max_model_len=config.context_limit,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            gpu_memory_utilization=config.gpu_memory_utilization,
            trust_remote_code=config.trust_remote_code,
            disable_log_stats=config.disable_log_stats,
            inbox_address=f"ipc://{workdir}/rank{rank}.in",
            outbox_address=f"ipc://{workdir}/ranks.out",
            log_level=config.log_level,
            environment=environments[rank],
            sim_ttft_ms=config.sim_ttft_ms,
            sim_itl_ms=config.sim_itl_ms,
            sim_tokens_per_step=config.sim_tokens_per_step,
            sim_zero_overhead_scheduling=not config.sim_disable_zos,
            sim_fault=config.sim_fault if rank == config.sim_fault_rank else None,
            sim_fault_after_steps=config.sim_fault_after_steps,
        )
        for rank in range(config.dp)
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


async def serve(config: ServerConfig) -> int:
    """Run the server until it is told to stop; returns the process exit code."""
    if config.engine == "deepinfer" and importlib.util.find_spec("deepinfer") is None:
        raise ConfigError(
            "--engine deepinfer needs the DeepInfer package, which is not importable here "
            "(install DeepInfer or add its source to PYTHONPATH; or use --engine simulated)"
        )
    local_model = resolve_model(config.model, config.engine)
    master_port = choose_master_port(config.port)
    try:
        recipe = RecipeContext.create(
            load_tokenizer_json(local_model),
            config.served_model_names,
            config.context_limit,
            default_thinking=config.default_thinking == "enabled",
        )
    except (OSError, ValueError, RuntimeError) as exc:
        raise ConfigError(f"cannot load the tokenizer: {exc}") from exc
    with tempfile.TemporaryDirectory(prefix="deepinfer-server-") as workdir:
        specs = _rank_specs(config, local_model, workdir, master_port)
        lockstep = new_lockstep_group(config.dp, config.sim_collective_timeout)
        processes = RankProcesses(specs, lockstep)
        metrics = ServerMetrics(config.served_model_names[0])
        engine = EngineClient(
            config, processes, [s.inbox_address for s in specs], specs[0].outbox_address, metrics
        )
        try:
            processes.start()
            engine.start()
            startup = asyncio.ensure_future(engine.wait_ready(config.startup_timeout))
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
                config.dp,
                config.expert_parallel_size,
                config.cp,
                master_port,
                config.served_model_names[0],
                config.host,
                config.port,
            )
            state = AppState(config=config, recipe=recipe, engine=engine, metrics=metrics)
            server = _Server(
                uvicorn.Config(
                    build_app(state),
                    host=config.host,
                    port=config.port,
                    log_level=config.log_level,
                    lifespan="off",
                    timeout_graceful_shutdown=5,
                    access_log=False,
                ),
                state,
            )
            await server.serve()
            if not server.started:
                return 1
            return 0
        finally:
            logger.info("[shutdown] stopping DP ranks")
            await engine.close(RANK_STOP_TIMEOUT)
            logger.info("[shutdown] done")


def run(config: ServerConfig) -> int:
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
