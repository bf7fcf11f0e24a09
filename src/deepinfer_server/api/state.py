"""AppState: what the routes share (configuration, recipe context, coordinator, metrics)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from deepinfer_server.api.preparation import PreparationGate
from deepinfer_server.config import ResolvedConfig
from deepinfer_server.coordinator.coordinator import Coordinator
from deepinfer_server.metrics import ServerMetrics
from deepinfer_server.protocol.recipe import RecipeContext
from deepinfer_server.protocol.structured import StructuredOutputs

# Bodies larger than this are prepared on a worker thread, keeping the event loop responsive.
LARGE_BODY_BYTES = 64 * 1024

T = TypeVar("T")


@dataclass
class AppState:
    """Shared by every request of one server."""

    config: ResolvedConfig
    recipe: RecipeContext
    coordinator: Coordinator
    metrics: ServerMetrics
    structured: StructuredOutputs
    started_at: int = field(default_factory=lambda: int(time.time()))
    preparation: PreparationGate = field(default_factory=PreparationGate)
    _engine_requests: int = 0

    async def prepare_body(
        self,
        prepare: Callable[[dict[str, Any], RecipeContext], T],
        body: dict[str, Any],
        raw_size: int,
        *,
        on_thread: bool = False,
    ) -> T:
        """`prepare(body, recipe)`; a large body (`LARGE_BODY_BYTES`), or any with `on_thread`,
        on a worker thread, at most a few at once and counted under admission (429 when they
        would fill it)."""
        if raw_size <= LARGE_BODY_BYTES and not on_thread:
            return prepare(body, self.recipe)
        return await self.preparation.run(
            self.coordinator.num_in_flight,
            self.config.admission_capacity,
            lambda: prepare(body, self.recipe),
        )

    def next_engine_request_id(self, completion_id: str) -> str:
        """A request ID unique among live engine requests, even if clients reuse X-Request-Id."""
        self._engine_requests += 1
        return f"{completion_id}-{self._engine_requests}"

    def deadline(self) -> float | None:
        """The event-loop time at which a request starting now times out, or None."""
        if not self.config.request_timeout:
            return None
        return asyncio.get_running_loop().time() + self.config.request_timeout
