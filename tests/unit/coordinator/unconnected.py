"""A real Coordinator with DP 2 over real RankChannels whose ranks never connect: every
message to a rank waits in memory, so a test reads where each request was placed."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from deepinfer_server.cli import parse_config
from deepinfer_server.coordinator.channels import RankChannels, bind_rank_listener
from deepinfer_server.coordinator.coordinator import Coordinator
from deepinfer_server.metrics import ServerMetrics


@asynccontextmanager
async def unconnected_coordinator(tmp_path: Path, *flags: str) -> AsyncIterator[Coordinator]:
    """The coordinator of a simulated DP-2 server started with `flags`, its ranks unconnected."""
    config = parse_config(["--engine", "simulated", "--dp", "2", *flags])
    channels = RankChannels(bind_rank_listener(str(tmp_path / "ranks.sock")), 2)
    coordinator = Coordinator(config, channels, ServerMetrics("m"))
    try:
        yield coordinator
    finally:
        channels.close()
