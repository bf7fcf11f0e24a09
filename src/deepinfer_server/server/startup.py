"""What start-up settles before any process is spawned, and the rank processes' specs.

Both ways of serving (one API process, or `--api-server-count N` under the supervisor) start
from `prepare()` and spawn the ranks from `rank_specs()`.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass

from deepinfer_server.config import ResolvedConfig
from deepinfer_server.coordinator.liveness import heartbeat_interval
from deepinfer_server.engines.backend import EngineBackend, EngineSpec
from deepinfer_server.engines.deepinfer.ports import choose_master_port
from deepinfer_server.engines.registry import get_backend
from deepinfer_server.errors import ConfigError
from deepinfer_server.model.source import resolve_model
from deepinfer_server.model.tokenizer import load_tokenizer_json
from deepinfer_server.protocol.core.recipe import RecipeContext
from deepinfer_server.rank.spec import RankSpec
from deepinfer_server.server.http import bind_listener, create_recipe
from deepinfer_server.server.ranks import RankGroup
from deepinfer_server.store.location import check_store

logger = logging.getLogger("deepinfer_server")

#: Seconds the ranks get to stop at an agreed iteration before they are killed.
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
    if config.response_store is not None:
        check_store(config.response_store)
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
            engine=EngineSpec.for_rank(config, rank, prepared.checkpoint, environments[rank]),
            builder=backend.builder,
            backend_name=backend.name,
            api_addresses=tuple(api_address(workdir, i) for i in servers),
            log_level=config.log_level,
            heartbeat_seconds=heartbeat_interval(config.step_timeout),
        )
        for rank in range(config.data_parallel_size)
    ]


@dataclass(frozen=True)
class Workspace:
    """Where the server runs: its configuration with the port bound, its TCP socket, the
    directory of the sockets between the ranks and the API server processes, and the rank
    group (not started) wired through it."""

    config: ResolvedConfig
    listener: socket.socket
    workdir: str
    ranks: RankGroup


@contextlib.contextmanager
def workspace(config: ResolvedConfig, prepared: Prepared) -> Iterator[Workspace | None]:
    """The server's workspace (None, logged, when its port cannot be bound); its socket is
    closed and its directory removed on leaving."""
    try:
        listener, config = bind_listener(config)
    except OSError as exc:
        logger.error("cannot listen on %s:%d: %s", config.host, config.port, exc)
        yield None
        return
    with tempfile.TemporaryDirectory(prefix="deepinfer-server-") as workdir, listener:
        specs = rank_specs(config, prepared, workdir)
        ranks = RankGroup(specs, prepared.backend.shared_state(config))
        yield Workspace(config, listener, workdir, ranks)
