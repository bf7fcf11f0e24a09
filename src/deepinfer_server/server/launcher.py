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

from deepinfer_server.config import ResolvedConfig
from deepinfer_server.config.logs import configure_logging
from deepinfer_server.coordinator.channels import RankChannels, bind_rank_listener
from deepinfer_server.coordinator.coordinator import Coordinator
from deepinfer_server.errors import ConfigError
from deepinfer_server.metrics import ServerMetrics
from deepinfer_server.server.http import (
    WRITES_AT_SHUTDOWN,
    build_server,
    log_serving,
    response_store,
    run_loop,
    wait_for_ranks,
)
from deepinfer_server.server.startup import (
    RANK_STOP_TIMEOUT,
    Prepared,
    api_address,
    prepare,
    workspace,
)

logger = logging.getLogger("deepinfer_server")


async def serve(config: ResolvedConfig, prepared: Prepared) -> int:
    """Run the single-process server until it is told to stop; returns the exit code."""
    with workspace(config, prepared) as space:
        if space is None:
            return 1
        config, listener, workdir, ranks = space.config, space.listener, space.workdir, space.ranks
        metrics = ServerMetrics(config.served_model_name)
        channels = RankChannels(
            bind_rank_listener(api_address(workdir, 0)), config.data_parallel_size
        )
        coordinator = Coordinator(
            config, channels, metrics, on_failure=lambda _reason: ranks.break_collectives()
        )
        try:
            ranks.start()
            ranks.watch(coordinator.rank_exited)
            coordinator.start()
            failed = await wait_for_ranks(coordinator, config.startup_timeout)
            if failed is not None:
                return failed
            log_serving(config, prepared.master_port)
            async with response_store(config, evicts=True) as store:
                server = build_server(
                    config,
                    prepared.recipe,
                    prepared.tokenizer_json,
                    coordinator,
                    metrics,
                    store=store,
                )
                await server.serve(sockets=[listener])
                await server.state.wait_background(WRITES_AT_SHUTDOWN)
            if not server.started:
                return 1
            return 0
        finally:
            logger.info("[shutdown] stopping DP ranks")
            ranks.request_stop()
            coordinator.begin_shutdown()
            await ranks.stop(RANK_STOP_TIMEOUT)
            await coordinator.release()
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
    configure_logging(config.log_level)
    try:
        return run_loop(_serve(config))
    except ConfigError as exc:
        print(f"deepinfer-server: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0
