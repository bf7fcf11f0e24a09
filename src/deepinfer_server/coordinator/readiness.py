"""Readiness: which DP ranks reported ready, and the wait for the last of them; and the
disaggregation bootstrap port each prefill rank bound, which it reports with its readiness."""

from __future__ import annotations

import asyncio

from deepinfer_server.concurrency import first_of
from deepinfer_server.errors import StartupError


class Readiness:
    """The ranks' start-up: set once every one of `size` ranks reported ready."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._ready: set[int] = set()
        self._all_ready = asyncio.Event()
        #: Each prefill rank's bound bootstrap port, by DP rank (what `/server_info` lists).
        self.bootstrap_ports: dict[int, int] = {}

    def ready(self, rank: int, bootstrap_port: int | None = None) -> None:
        """Rank `rank` reported ready (a prefill rank with the bootstrap port it bound)."""
        self._ready.add(rank)
        if bootstrap_port is not None:
            self.bootstrap_ports[rank] = bootstrap_port
        if len(self._ready) == self._size:
            self._all_ready.set()

    async def wait(self, failed: asyncio.Event, timeout: float) -> bool:
        """Wait until every rank is ready or `failed` is set, at most `timeout` seconds (0:
        no bound); False when the time ran out."""
        return await first_of(self._all_ready.wait(), failed.wait(), timeout=timeout or None)

    def timed_out(self, timeout: float) -> StartupError:
        """The error for ranks not ready within `timeout` seconds."""
        waiting = sorted(set(range(self._size)) - self._ready)
        return StartupError(
            f"DP ranks {waiting} were not ready within --startup-timeout {timeout:g}s"
        )
