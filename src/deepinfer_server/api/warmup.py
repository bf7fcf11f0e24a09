"""GrammarWarmup: whether the server still warms what a first structured request needs.

With `--grammar-warmup` (the default) and the grammar extra installed, `/health` answers 503
`starting` until structured output is warm: this process's compile workers all ready
(`StructuredOutputs.preparing`) and every rank's grammar builder warm (`Readiness`), as SGLang's
server answers its health check only after its warm-up request. A load balancer then sends the
first schema to a server that answers it as fast as the next one. Once warm, it stays so: a
compile worker restarted later is no start-up. The wait is bounded (`WARMUP_HEALTH_WAIT`): past
it (a worker that never starts, a rank's warm-up that failed, both logged), the server is
healthy and a structured request waits for what is still cold, as with `--no-grammar-warmup`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from deepinfer_server.protocol.core.structured_outputs import StructuredOutputs, xgrammar_installed

logger = logging.getLogger(__name__)

#: Seconds `/health` waits for the warm-up at most (the compile workers' own start-up bound).
WARMUP_HEALTH_WAIT = 180.0
#: Seconds between looks at the warm-up by `over` (its parts have no event of their own).
_WARM_POLL_SECONDS = 0.25


class GrammarWarmup:
    """The start-up's structured-output warm-up, as `/health` sees it."""

    def __init__(
        self,
        structured: StructuredOutputs,
        ranks_warm: Callable[[], bool],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._structured = structured
        self._ranks_warm = ranks_warm
        self._clock = clock
        #: When the warm-up started (None: not started, or over: warm, given up or never to be).
        self._since: float | None = None

    def start(self) -> None:
        """Start warming (once the server listens): the compile workers are prepared from now
        on, and the ranks warm their grammar builders once ready. Without xgrammar there is
        nothing to warm."""
        self._structured.start()
        if xgrammar_installed():
            self._since = self._clock()

    @property
    def warming(self) -> bool:
        """Whether `/health` should still say `starting` for the warm-up."""
        if self._since is None:
            return False
        if not self._structured.preparing and self._ranks_warm():
            self._since = None
        elif self._clock() - self._since > WARMUP_HEALTH_WAIT:
            logger.warning(
                "[startup] structured output is not warm after %gs; serving anyway (the first "
                "structured request waits for what is still cold)",
                WARMUP_HEALTH_WAIT,
            )
            self._since = None
        return self._since is not None

    async def over(self) -> None:
        """Return once the warm-up is over (warm, or given up on): what another API server
        process's `/health` waits for too (`--api-server-count`)."""
        while self.warming:
            await asyncio.sleep(_WARM_POLL_SECONDS)
