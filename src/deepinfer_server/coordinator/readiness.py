"""Readiness: which DP ranks reported ready, the wait for the last of them, which ranks'
grammar builders are warm (a first structured request then pays no start-up on the rank side),
and the disaggregation bootstrap port each prefill rank bound, which it reports with its
readiness."""

from __future__ import annotations

import asyncio
import logging

from deepinfer_server.concurrency import first_of
from deepinfer_server.disaggregation.layout import KVLayout
from deepinfer_server.errors import StartupError
from deepinfer_server.ipc.messages import GrammarWarm, RankReady

logger = logging.getLogger(__name__)


class Readiness:
    """The ranks' start-up: set once every one of `size` ranks reported ready."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._ready: set[int] = set()
        self._grammar_warm: set[int] = set()
        self._all_ready = asyncio.Event()
        #: Each prefill rank's bound bootstrap port, by DP rank (what `/server_info` lists).
        self.bootstrap_ports: dict[int, int] = {}
        #: A prefill or decode rank's KV layout (every rank's is the same; None until one
        #: reported, and on a NORMAL server).
        self.layout: KVLayout | None = None

    def report(self, message: RankReady | GrammarWarm) -> None:
        """A rank's report: it is ready (`RankReady`), or its grammar builder is warm."""
        if isinstance(message, GrammarWarm):
            self.grammar_warm(message.rank)
            return
        logger.info("[startup] DP rank %d is ready (pid %d)", message.rank, message.pid)
        if message.layout is not None:
            self.layout = message.layout
        self.ready(message.rank, message.bootstrap_port, message.grammar_warming)

    def ready(
        self, rank: int, bootstrap_port: int | None = None, grammar_warming: bool = False
    ) -> None:
        """Rank `rank` reported ready (a prefill rank with the bootstrap port it bound); its
        grammar builder is warm too unless still `grammar_warming` (`grammar_warm` then
        follows)."""
        self._ready.add(rank)
        if bootstrap_port is not None:
            self.bootstrap_ports[rank] = bootstrap_port
        if not grammar_warming:
            self._grammar_warm.add(rank)
        if len(self._ready) == self._size:
            self._all_ready.set()

    def grammar_warm(self, rank: int) -> None:
        """Rank `rank`'s grammar builder finished its warm-up."""
        self._grammar_warm.add(rank)

    @property
    def grammar_ready(self) -> bool:
        """Whether every rank's grammar builder is warm."""
        return len(self._grammar_warm) == self._size

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
