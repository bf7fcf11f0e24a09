"""In-process HTTP tests against the real simulated engine (no rank processes).

`EngineCoordinator` admits requests like `FakeCoordinator` (same RequestHandle), then answers
each by running the simulated `LLMEngine` through the real `LLMEngineDriver` until the request
ends: what a client sees is what the engine generated (echo, grammar, finish), rendered by the
real protocol layer. The engine runs on the event loop's thread (its owner), one request at a
time; steps take no time (`ttft_ms = itl_ms = 0`).
"""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import cast

import httpx
import openai

from deepinfer_server.api.app import build_app
from deepinfer_server.api.state import AppState
from deepinfer_server.cli import parse_config
from deepinfer_server.coordinator.coordinator import Coordinator
from deepinfer_server.coordinator.handle import RequestHandle
from deepinfer_server.engines.llm_engine_driver import LLMEngineDriver
from deepinfer_server.engines.simulated.abilities import SimulatedAbilities
from deepinfer_server.engines.simulated.collectives import new_lockstep_group
from deepinfer_server.engines.simulated.engine import LLMEngine, SimEngineArgs
from deepinfer_server.engines.simulated.outputs import RequestOutput
from deepinfer_server.ipc.codec import pack_token_ids
from deepinfer_server.ipc.messages import AddRequest, Images, SamplingOptions
from deepinfer_server.metrics import ServerMetrics
from deepinfer_server.protocol.core.images import ImageLimits
from deepinfer_server.protocol.core.structured_outputs import StructuredOutputs
from tests.http.harness import MODEL, FakeCoordinator, _recipe, _tokenizer_json

__all__ = ["MODEL", "EngineCoordinator", "EngineHarness", "SimulatedEngine", "serve_engine"]

#: Engine iterations one request may take before the harness calls it a hang.
_MAX_ITERATIONS = 20_000


@dataclass
class EngineCoordinator(FakeCoordinator):
    """A `FakeCoordinator` whose answers come from a real simulated engine."""

    driver: LLMEngineDriver | None = None
    #: The engine's raw output text per request (special tokens kept), for diagnostics.
    raw_text: dict[str, str] = field(default_factory=dict)

    def _play(self, handle: RequestHandle) -> None:
        asyncio.get_running_loop().create_task(self._run(handle))

    async def _run(self, handle: RequestHandle) -> None:
        assert self.driver is not None
        request_id = handle.request_id
        _, prompt, sampling = next(s for s in self.submitted if s[0] == request_id)
        images: Images | None = self.images.get(request_id)
        rejected = self.driver.add(
            AddRequest(
                request_id,
                pack_token_ids(prompt),
                cast(SamplingOptions, sampling),
                images,
                cache_salt=self.cache_salts.get(request_id),
            )
        )
        assert rejected is None, rejected
        generated: list[int] = []
        for _ in range(_MAX_ITERATIONS):
            if handle.engine_finished:  # closed (the client left): stop running it
                self.driver.abort([request_id])
                return
            _, all_deltas = self.driver.iterate()
            # An earlier request aborted by its client can still have outputs in flight (a
            # speculative step's deferred tokens): they are not this request's.
            deltas = [delta for delta in all_deltas if delta.request_id == request_id]
            due = False
            for delta in deltas:
                generated.extend(delta.tokens.token_ids)
                if delta.cached_tokens is not None:  # as the coordinator's dispatch does
                    handle.started(delta.cached_tokens, delta.written_tokens or 0)
                due = handle.deliver(delta.tokens, delta.finish, 0.0, 0.0) or due
            if due:
                handle.flush()
            if any(delta.finish is not None for delta in deltas):
                self.raw_text[request_id] = self.recipe.decoder.decode(
                    generated, skip_special_tokens=False
                )
                return
            # The grammar compiles on a builder thread: let it (and the client) run.
            await asyncio.sleep(0.001)
        raise AssertionError(f"request {request_id} did not finish in {_MAX_ITERATIONS} steps")


@dataclass
class SimulatedEngine:
    """One simulated engine (and the API side's grammar compiler) for many in-process apps:
    its grammar workers start once. Build and use it on one thread (the engine's owner)."""

    driver: LLMEngineDriver
    structured: StructuredOutputs

    @classmethod
    def start(
        cls,
        max_model_len: int = 4096,
        enable_prefix_caching: bool = False,
        speculative_tokens: int = 0,
        structured: StructuredOutputs | None = None,
    ) -> SimulatedEngine:
        """A new engine; `structured` shares another engine's grammar compiler."""
        engine = LLMEngine.from_engine_args(
            SimEngineArgs(
                tokenizer_json=_tokenizer_json(),
                lockstep=new_lockstep_group(1, 5.0),
                max_model_len=max_model_len,
                ttft_ms=0.0,
                itl_ms=0.0,
                enable_prefix_caching=enable_prefix_caching,
                speculative_tokens=speculative_tokens,
            )
        )
        if structured is None:
            structured = StructuredOutputs(_tokenizer_json())
            # Prepared once for the session, as a server has once its background warm-up ended.
            if importlib.util.find_spec("xgrammar") is not None:
                assert asyncio.run(structured.wait_ready())
        abilities = SimulatedAbilities(engine, enable_prefix_caching)
        driver = LLMEngineDriver(
            engine, RequestOutput, abilities, count_drafts=speculative_tokens > 0
        )
        return cls(driver, structured)

    def close(self) -> None:
        self.driver.close()


@dataclass
class EngineHarness:
    client: httpx.AsyncClient
    openai: openai.AsyncOpenAI
    coordinator: EngineCoordinator


@asynccontextmanager
async def serve_engine(engine: SimulatedEngine, *args: str) -> AsyncIterator[EngineHarness]:
    """The app for `deepinfer-server --engine simulated ARGS`, answered by `engine`."""
    config = parse_config(["--engine", "simulated", "--max-model-len", "4096", *args])
    recipe = _recipe(
        config.served_model_names,
        config.max_model_len,
        config.reasoning_secret,
        ImageLimits.of(config),
    )
    coordinator = EngineCoordinator(recipe, driver=engine.driver)
    state = AppState(
        config=config,
        recipe=recipe,
        coordinator=cast(Coordinator, coordinator),
        metrics=ServerMetrics(config.served_model_name),
        structured=engine.structured,
    )
    transport = httpx.ASGITransport(app=build_app(state))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        sdk = openai.AsyncOpenAI(
            base_url="http://test/v1", api_key="unused", http_client=client, max_retries=0
        )
        yield EngineHarness(client, sdk, coordinator)
