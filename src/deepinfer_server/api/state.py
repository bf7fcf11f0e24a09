"""AppState: what the routes share (configuration, recipe context, coordinator, metrics)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from deepinfer_server.api.preparation_gate import PER_KEY_PREPARATIONS, PreparationGate
from deepinfer_server.api.receive_budget import ReceiveBudget
from deepinfer_server.api.warmup import GrammarWarmup
from deepinfer_server.config import ResolvedConfig
from deepinfer_server.coordinator.coordinator import Coordinator
from deepinfer_server.disaggregation.handoff.peers import PrefillPeers
from deepinfer_server.disaggregation.handoff.signing import HandoffSigner
from deepinfer_server.metrics import RankLoad, ServerMetrics
from deepinfer_server.metrics.aggregate import Snapshot, merge_loads, merged_exposition
from deepinfer_server.protocol.core.json_types import JsonObject
from deepinfer_server.protocol.core.recipe import RecipeContext
from deepinfer_server.protocol.core.structured_outputs import StructuredOutputs
from deepinfer_server.protocol.core.validation import PRIORITY_MAX
from deepinfer_server.services.background_runs import BackgroundRuns
from deepinfer_server.services.batch_runner import BatchRunner
from deepinfer_server.services.batch_slots import IdleSlots
from deepinfer_server.store import ResponseStore
from deepinfer_server.store.batches import BatchStore

# Bodies larger than this are prepared on a worker thread, keeping the event loop responsive.
LARGE_BODY_BYTES = 64 * 1024

T = TypeVar("T")


class Peers(Protocol):
    """The other API server processes of this server (`--api-server-count` > 1)."""

    #: This process's number (0-based) among the API server processes.
    index: int
    #: Whether every API server process serves (the supervisor says so once they all do).
    all_serving: bool
    #: Whether every API server process's start-up warm-up is over (`api.warmup`).
    all_warm: bool

    async def snapshots(self, metrics: bool = True) -> list[Snapshot]:
        """Every other process's rank loads, and its metrics unless `metrics` is False (those
        that answer in time)."""
        ...


@dataclass
class AppState:
    """Shared by every request of one server."""

    config: ResolvedConfig
    recipe: RecipeContext
    coordinator: Coordinator
    metrics: ServerMetrics
    structured: StructuredOutputs
    started_at: int = field(default_factory=lambda: int(time.time()))
    #: The large requests' preparation, fair between keys (each bounded, with several keys).
    preparation: PreparationGate = field(init=False)
    peers: Peers | None = None
    #: A decode server's prefill peers (`--disaggregation-mode decode`; else None).
    prefill_peers: PrefillPeers | None = None
    #: The Responses store (None: `--response-store none`).
    store: ResponseStore | None = None
    #: Bytes held by requests still being received (`--max-receive-buffer-mb`).
    receiving: ReceiveBudget = field(init=False)
    #: Signs a prefill server's handoffs and verifies a decode server's (None: no secret).
    handoff_signer: HandoffSigner | None = field(init=False)
    #: Structured output's warm-up at start (`/health` says `starting` until it is over).
    warmup: GrammarWarmup = field(init=False)
    #: This process's background responses (with a store; else None).
    background_runs: BackgroundRuns | None = field(init=False)
    #: This process's share of the batch jobs (with a store; else None).
    batches: BatchRunner | None = field(init=False)
    _engine_requests: int = 0
    #: Work that outlives its request (store writes still running), kept until done.
    _background: set[asyncio.Future[Any]] = field(default_factory=set)

    def __post_init__(self) -> None:
        several_keys = len(self.config.tenants) > 1
        self.preparation = PreparationGate(per_key=PER_KEY_PREPARATIONS if several_keys else None)
        self.receiving = ReceiveBudget(self.config.max_receive_buffer_mb * 1024 * 1024)
        secret = self.config.disaggregation_secret
        self.handoff_signer = (
            HandoffSigner(secret, self.config.disaggregation_kv_hold_timeout) if secret else None
        )
        self.warmup = GrammarWarmup(
            self.structured, lambda: self.coordinator.readiness.grammar_ready
        )
        self.background_runs = (
            None if self.store is None else BackgroundRuns(self.store, self.metrics)
        )
        self.batches = (
            None
            if self.store is None
            else BatchRunner(
                BatchStore(self.store),
                self.config.api_keys,
                self.config.batch_concurrency,
                self.metrics,
                IdleSlots(self._batch_slots(), self._idle_slots, self._batch_admitted),
            )
        )

    def _batch_slots(self) -> int:
        """Running slots batch work may take: all but one kept for interactive requests (on
        a server with more than one)."""
        capacity = self.config.running_capacity
        return capacity - (1 if capacity > 1 else 0)

    def _idle_slots(self) -> int:
        """Running slots a batch line may take now: those idle, but one kept for interactive
        requests."""
        return self._batch_slots() - self.coordinator.admitted

    def _batch_admitted(self) -> int:
        """At least how many of the requests admitted now are this process's batch lines':
        its lowest-priority requests but its background responses'."""
        runs = 0 if self.background_runs is None else len(self.background_runs.runs)
        return max(0, self.coordinator.admitted_at(PRIORITY_MAX) - runs)

    async def prepare_body(
        self,
        prepare: Callable[[JsonObject, RecipeContext], T],
        body: JsonObject,
        size: int,
        tenant: int,
        *,
        on_thread: bool = False,
    ) -> T:
        """`prepare(body, recipe)`; a large request (`size`, the bytes it prepares: its body,
        or what a stored conversation expands it to, past `LARGE_BODY_BYTES`), or any with
        `on_thread`, on a worker thread, at most a few at once, in turn between tenants (API
        keys) and counted under admission (429 when they would fill it)."""
        if size <= LARGE_BODY_BYTES and not on_thread:
            return prepare(body, self.recipe)
        return await self.preparation.run(
            self.coordinator.admitted,
            self.config.admission_capacity,
            lambda: prepare(body, self.recipe),
            key=str(tenant),
        )

    def background(
        self, work: asyncio.Future[T], on_done: Callable[[asyncio.Future[T]], None]
    ) -> None:
        """Keep `work` alive until it is done, then call `on_done` with it."""
        self._background.add(work)
        work.add_done_callback(self._background.discard)
        work.add_done_callback(on_done)

    async def wait_background(self, timeout: float) -> None:
        """Wait up to `timeout` seconds for the work still running (at shutdown)."""
        if self._background:
            await asyncio.wait(set(self._background), timeout=timeout)

    def next_engine_request_id(self, completion_id: str) -> str:
        """A request ID unique among live engine requests, even if clients reuse X-Request-Id."""
        self._engine_requests += 1
        if self.peers is not None:  # unique across the API server processes too
            return f"{completion_id}-{self.peers.index}.{self._engine_requests}"
        return f"{completion_id}-{self._engine_requests}"

    async def metrics_exposition(self) -> bytes:
        """/metrics: this process's metrics, with every other API server process's summed in."""
        if self.peers is None:
            return self.metrics.exposition()
        return merged_exposition(self.metrics, await self.peers.snapshots())

    async def rank_loads(self) -> list[RankLoad]:
        """Every rank's load, from the requests of every API server process."""
        own = self.coordinator.rank_loads()
        if self.peers is None:
            return own
        return merge_loads(own, await self.peers.snapshots(metrics=False))

    def deadline(self) -> float | None:
        """The event-loop time at which a request starting now times out, or None."""
        if not self.config.request_timeout:
            return None
        return asyncio.get_running_loop().time() + self.config.request_timeout
