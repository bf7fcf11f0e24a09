"""Server lifecycle: start the ranks, wait until all are ready, serve HTTP, stop everything.

Phases: [startup] load the tokenizer, choose MASTER_PORT, spawn one process per DP rank and
wait for every RankReady (bounded by --startup-timeout, interruptible by SIGTERM/SIGINT); only
then open the HTTP port. [serve] uvicorn in this process (`http_server`), or with
--api-server-count N > 1 in N API server processes under a supervisor (`supervisor`).
[shutdown] on SIGTERM/SIGINT: /health turns 503 and new requests get 503, in-flight requests
may finish for --shutdown-timeout seconds, the rest end with a 503 error, then every rank stops;
no rank process outlives it. The engine backend is chosen from the registry; its implementation
is imported only in the rank processes.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
from dataclasses import dataclass

from deepinfer_server.config import ResolvedConfig
from deepinfer_server.coordinator.channels import RankChannels, bind_rank_listener
from deepinfer_server.coordinator.coordinator import Coordinator
from deepinfer_server.coordinator.liveness import heartbeat_interval
from deepinfer_server.coordinator.process import RankProcesses
from deepinfer_server.engines.backend import EngineBackend, EngineSpec
from deepinfer_server.engines.deepinfer.ports import choose_master_port
from deepinfer_server.engines.registry import get_backend
from deepinfer_server.errors import ConfigError
from deepinfer_server.ipc.stop_agreement import StopAgreement
from deepinfer_server.metrics import ServerMetrics
from deepinfer_server.model.source import resolve_model
from deepinfer_server.model.tokenizer import load_tokenizer_json
from deepinfer_server.protocol.core.recipe import RecipeContext
from deepinfer_server.rank.proc import run_rank
from deepinfer_server.rank.spec import RankSpec
from deepinfer_server.server.http import (
    build_server,
    create_recipe,
    log_serving,
    run_loop,
    wait_for_ranks,
)

logger = logging.getLogger("deepinfer_server")

RANK_STOP_TIMEOUT = 15.0


@dataclass(frozen=True)
class Prepared:
    """What start-up settles before any process is spawned."""

    backend: EngineBackend
    checkpoint: str | None
    master_port: int
    tokenizer_json: str
    recipe: RecipeContext


def prepare(config: ResolvedConfig) -> Prepared:
    """Check the engine, resolve the model, load the tokenizer (ConfigError when it cannot)."""
    backend = get_backend(config.engine)
    backend.check_installed()
    checkpoint = resolve_model(config.model, backend)
    backend.preflight(config, checkpoint)
    master_port = choose_master_port(config.port)
    tokenizer_json = load_tokenizer_json(checkpoint)
    try:
        recipe = create_recipe(config, tokenizer_json, checkpoint)
    except (OSError, ValueError, RuntimeError) as exc:
        raise ConfigError(f"cannot load the tokenizer: {exc}") from exc
    return Prepared(backend, checkpoint, master_port, tokenizer_json, recipe)


def api_address(workdir: str, api_server: int) -> str:
    """The socket API server process `api_server` listens on for the ranks."""
    return f"{workdir}/api{api_server}.sock"


def rank_specs(config: ResolvedConfig, prepared: Prepared, workdir: str) -> list[RankSpec]:
    """One spec per DP rank, wired to every API server process."""
    backend = prepared.backend
    environments = backend.rank_environments(config, prepared.master_port)
    servers = range(config.api_server_count)
    return [
        RankSpec(
            engine=EngineSpec(
                rank=rank,
                model=prepared.checkpoint,
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
            api_addresses=tuple(api_address(workdir, i) for i in servers),
            log_level=config.log_level,
            heartbeat_seconds=heartbeat_interval(config.step_timeout),
        )
        for rank in range(config.data_parallel_size)
    ]


async def serve(config: ResolvedConfig, prepared: Prepared) -> int:
    """Run the single-process server until it is told to stop; returns the exit code."""
    with tempfile.TemporaryDirectory(prefix="deepinfer-server-") as workdir:
        specs = rank_specs(config, prepared, workdir)
        stop = StopAgreement()
        shared = prepared.backend.shared_state(config)
        processes = RankProcesses(run_rank, [(spec, stop, shared) for spec in specs])
        metrics = ServerMetrics(config.served_model_name)
        channels = RankChannels(
            bind_rank_listener(api_address(workdir, 0)), config.data_parallel_size
        )
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
            failed = await wait_for_ranks(coordinator, config.startup_timeout)
            if failed is not None:
                return failed
            log_serving(config, prepared.master_port)
            server = build_server(
                config, prepared.recipe, prepared.tokenizer_json, coordinator, metrics
            )
            await server.serve()
            if not server.started:
                return 1
            return 0
        finally:
            logger.info("[shutdown] stopping DP ranks")
            await coordinator.close(RANK_STOP_TIMEOUT)
            logger.info("[shutdown] done")


async def _serve(config: ResolvedConfig) -> int:
    prepared = prepare(config)
    if config.api_server_count == 1:
        return await serve(config, prepared)
    from deepinfer_server.server.supervisor import supervise

    return await supervise(config, prepared)


def run(config: ResolvedConfig) -> int:
    """Run the server in a fresh event loop (uvloop when installed)."""
    # Prompts are encoded one request at a time: the tokenizers thread pool only adds wake-ups
    # and spinning threads to a short prompt (its encoding took 264 µs instead of 120 µs after an
    # idle gap) and barely speeds up a long one. DeepInfer's LLM sets the same default
    # (deepinfer/entrypoints/llm.py); the ranks and API processes inherit it.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    logging.basicConfig(
        level=config.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return run_loop(_serve(config))
    except ConfigError as exc:
        print(f"deepinfer-server: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0
