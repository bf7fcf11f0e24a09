"""In-process HTTP tests: the real app and protocol layers against a scripted fake coordinator.

`FakeCoordinator` admits requests like the real one (same RequestHandle), then answers each with
a script: the tokens of a text, delivered on the event loop, and a finish or an error.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import cache
from typing import Any, cast

import httpx
import openai
import uvicorn

try:  # openai 3 talks through httpx2, earlier releases through httpx
    import httpx2 as client_http
except ImportError:  # pragma: no cover
    client_http = httpx  # type: ignore[no-redef]

from deepinfer_server.api.app import build_app
from deepinfer_server.api.state import AppState
from deepinfer_server.cli import parse_config
from deepinfer_server.coordinator.coordinator import Coordinator
from deepinfer_server.coordinator.handle import RequestHandle
from deepinfer_server.coordinator.readiness import Readiness
from deepinfer_server.coordinator.session_routing import SessionNames
from deepinfer_server.disaggregation.handoff.params import KVTransferParams
from deepinfer_server.errors import ApiError, OverloadedError
from deepinfer_server.ipc.messages import (
    AbortReason,
    Finish,
    GeneratedTokens,
    Images,
    SamplingOptions,
)
from deepinfer_server.metrics import RankLoad, ServerMetrics
from deepinfer_server.model.tokenizer import embedded_tokenizer_json
from deepinfer_server.protocol.core.images import ImageLimits
from deepinfer_server.protocol.core.recipe import RecipeContext
from deepinfer_server.protocol.core.structured_outputs import StructuredOutputs
from deepinfer_server.server.http import http_config
from deepinfer_server.store import ResponseStore

MODEL = "deepseek-flash"


@cache
def _tokenizer_json() -> str:
    return embedded_tokenizer_json()


@dataclass
class Script:
    """What the fake engine answers: `text` (after `</think>` in thinking mode), then `finish`."""

    text: str = "Hello from the fake engine"
    finish: Finish | None = Finish.STOP
    error: ApiError | None = None
    hold: bool = False  # deliver nothing: the request stays in flight
    #: The prompt tokens the engine says it reused from its prefix cache (its first delta).
    cached_tokens: int = 0
    #: Whether the engine writes the whole prompt to its cache for a request that asked for
    #: retention (`SamplingOptions.retention_seconds`), as the simulated engine does.
    writes: bool = False


@dataclass
class FakeCoordinator:
    """Stands in for `Coordinator` in the HTTP layer's tests."""

    recipe: RecipeContext
    script: Script = field(default_factory=Script)
    submit_error: BaseException | None = None
    submitted: list[tuple[str, list[int], SamplingOptions]] = field(default_factory=list)
    closed: list[tuple[str, bool, AbortReason]] = field(default_factory=list)
    handles: dict[str, RequestHandle] = field(default_factory=dict)
    images: dict[str, Images | None] = field(default_factory=dict)
    #: The prefix-cache partition each request was submitted with.
    cache_salts: dict[str, bytes | None] = field(default_factory=dict)
    kv_transfer_params: dict[str, KVTransferParams | None] = field(default_factory=dict)
    failure: str | None = None
    draining: bool = False
    kv_cache_usage: float | None = None
    #: Each prefill rank's bound bootstrap port, as the ranks reported it.
    bootstrap_ports: dict[int, int] = field(default_factory=dict)
    #: What the ranks reported with their readiness (here: a KV layout, set by a test).
    readiness: Readiness = field(default_factory=lambda: Readiness(1))
    capacity: int | None = None  # admission: 429 beyond this many requests in flight
    #: Each submitted request's (tenant index, priority), by request ID.
    placement: dict[str, tuple[int, int]] = field(default_factory=dict)
    #: The session each request was submitted with.
    sessions: dict[str, SessionNames | None] = field(default_factory=dict)
    _admission: asyncio.Event = field(default_factory=asyncio.Event, init=False, repr=False)

    async def wait_admitted(self, count: int = 1) -> None:
        """Until `count` requests are in flight (each admission sets an event: no polling)."""
        while len(self.handles) < count:
            self._admission.clear()
            await self._admission.wait()

    @property
    def num_in_flight(self) -> int:
        return len(self.handles)

    @property
    def admitted(self) -> int:
        return len(self.handles)

    def admitted_at(self, priority: int) -> int:
        """The requests of `priority` in flight."""
        return sum(self.placement[request_id][1] == priority for request_id in self.handles)

    def rank_loads(self) -> list[RankLoad]:
        """One rank: held requests are running once they have a token, else waiting."""
        live = [h for h in self.handles.values() if not h.engine_finished]
        running = sum(h.has_first_token for h in live)
        tokens = sum(h.context_tokens for h in live)
        return [RankLoad(0, running, len(live) - running, tokens, self.kv_cache_usage)]

    def submit(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingOptions,
        deadline: float | None,
        images: Images | None = None,
        kv_transfer_params: KVTransferParams | None = None,
        cache_salt: bytes | None = None,
        *,
        tenant: int = 0,
        priority: int = 0,
        session: SessionNames | None = None,
    ) -> RequestHandle:
        if self.submit_error is not None:
            raise self.submit_error
        if self.capacity is not None and len(self.handles) >= self.capacity:
            raise OverloadedError("the fake server is at capacity")
        self.submitted.append((request_id, prompt_token_ids, sampling))
        self.images[request_id] = images
        self.cache_salts[request_id] = cache_salt
        self.placement[request_id] = (tenant, priority)
        self.sessions[request_id] = session
        self.kv_transfer_params[request_id] = kv_transfer_params
        handle = RequestHandle(request_id, 0, self._on_close, deadline)
        handle.context_tokens = len(prompt_token_ids)
        self.handles[request_id] = handle
        self._admission.set()
        asyncio.get_running_loop().call_soon(self._play, handle)
        return handle

    def _on_close(self, handle: RequestHandle, aborted: bool, reason: AbortReason) -> None:
        self.handles.pop(handle.request_id, None)
        self.closed.append((handle.request_id, aborted, reason))

    def _play(self, handle: RequestHandle) -> None:
        script = self.script
        if script.hold:
            return
        text = script.text
        _, prompt, sampling = next(s for s in self.submitted if s[0] == handle.request_id)
        thinking = prompt[-1:] == list(self.recipe.tokenizer.encode("<think>"))
        if thinking and "</think>" not in text:
            text = "Thinking.</think>" + text
        ids = list(self.recipe.tokenizer.encode(text))
        now = time.perf_counter()
        # One "arrival" of two steps, as the reader task takes them: deliver, then flush. The
        # first delta says the engine took the request and what its prefix cache reused.
        writes = script.writes and sampling.retention_seconds > 0
        handle.started(script.cached_tokens, len(prompt) if writes else 0)
        due = handle.deliver(_with_logprobs(ids, prompt, sampling), None, now, 0.001)
        if script.error is not None:
            handle.fail(script.error, engine_finished=True)
        elif script.finish is not None:
            due = handle.deliver(GeneratedTokens(), script.finish, now, 0.001) or due
        if due:
            handle.flush()


def _with_logprobs(ids: list[int], prompt: list[int], sampling: SamplingOptions) -> GeneratedTokens:
    """The tokens with the per-token data the request asked for (logprob -0.5 each, then the
    alternatives 100, 101, ... at -1.5, -2.5, ...)."""
    tokens = GeneratedTokens(ids)
    if sampling.logprobs:
        tokens.logprobs = [-0.5] * len(ids)
        if sampling.top_logprobs:
            alternatives = [(100 + k, -1.5 - k) for k in range(sampling.top_logprobs - 1)]
            tokens.top_logprobs = [[(token, -0.5), *alternatives] for token in ids]
    if sampling.prompt_logprobs:
        tokens.prompt_logprobs = [-1.0] * (len(prompt) - 1)
    return tokens


@dataclass
class Harness:
    client: httpx.AsyncClient
    coordinator: FakeCoordinator
    metrics: ServerMetrics
    state: AppState
    app: Any = None

    def openai(self, api_key: str = "unused") -> openai.AsyncOpenAI:
        """The official openai client, talking to the app in-process."""
        transport = client_http.ASGITransport(app=self.app)
        return openai.AsyncOpenAI(
            base_url="http://test/v1",
            api_key=api_key,
            max_retries=0,
            http_client=openai.DefaultAsyncHttpxClient(transport=transport),
        )


@cache
def _structured() -> StructuredOutputs:
    """One grammar compiler for the session: each starts its compile worker processes on first
    use, seconds on a loaded machine, and every test of grammars would start its own."""
    return StructuredOutputs(_tokenizer_json())


@cache
def _recipe(
    served_model_names: tuple[str, ...],
    max_model_len: int,
    reasoning_secret: str | None,
    image_limits: ImageLimits,
    clamp_max_tokens: bool = True,
) -> RecipeContext:
    """One recipe context per configuration, built once for the whole session: building one
    loads the tokenizer twice and takes seconds (the context holds no per-request state)."""
    return RecipeContext.create(
        _tokenizer_json(),
        served_model_names,
        max_model_len,
        default_thinking=True,
        reasoning_secret=reasoning_secret,
        image_limits=image_limits,
        clamp_max_tokens=clamp_max_tokens,
    )


@asynccontextmanager
async def serve(
    *args: str,
    script: Script | None = None,
    structured: StructuredOutputs | None = None,
    store: ResponseStore | None = None,
) -> AsyncIterator[Harness]:
    """The app for `deepinfer-server --engine simulated ARGS`, with a fake coordinator, the
    session's grammar compiler (or `structured`) and `store` as its Responses store (none by
    default)."""
    config = parse_config(["--engine", "simulated", "--max-model-len", "4096", *args])
    recipe = _recipe(
        config.served_model_names,
        config.max_model_len,
        config.reasoning_secret,
        ImageLimits.of(config),
        config.clamp_max_tokens,
    )
    coordinator = FakeCoordinator(recipe, script or Script())
    metrics = ServerMetrics(config.served_model_name)
    metrics.watch_ranks(coordinator.rank_loads, lambda: coordinator.failure is None)
    state = AppState(
        config=config,
        recipe=recipe,
        coordinator=cast(Coordinator, coordinator),
        metrics=metrics,
        structured=structured or _structured(),
        store=store,
    )
    app = build_app(state)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        try:
            yield Harness(client, coordinator, metrics, state, app)
        finally:
            if state.batches is not None:  # started by the first batch
                await state.batches.stop()


@asynccontextmanager
async def listening(harness: Harness, protocol: type[asyncio.Protocol]) -> AsyncIterator[int]:
    """The harness's app served by real uvicorn on a loopback port (yielded), as the server
    configures it (connection guards included) on uvicorn's HTTP `protocol` class."""
    config = http_config(harness.app, harness.state, protocol)
    config.load()
    server = uvicorn.Server(config)
    server.lifespan = config.lifespan_class(config)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    await server.startup(sockets=[sock])
    try:
        yield sock.getsockname()[1]
    finally:
        await server.shutdown(sockets=[sock])
        sock.close()


def run(test: Callable[[], Any], timeout: float = 30.0) -> Any:
    """Run an async test body on a fresh event loop, bounded so a hang fails fast."""

    async def bounded() -> Any:
        return await asyncio.wait_for(test(), timeout)

    return asyncio.run(bounded())


def failures(metrics: ServerMetrics) -> dict[str, float]:
    """request_failure_total by status."""
    found: dict[str, float] = {}
    for family in metrics.registry.collect():
        for sample in family.samples:
            if sample.name == "deepinfer:request_failure_total":
                found[sample.labels["status"]] = sample.value
    return found
