"""LLMEngineDriver driving the simulated engine: the code path that will drive DeepInfer."""

from __future__ import annotations

import time
from functools import cache
from types import SimpleNamespace
from typing import Any

from tokenizers import Tokenizer

from deepinfer_server.disaggregation.transfer.connector import KVConnector
from deepinfer_server.engines.llm_engine_driver import LLMEngineDriver, finish_of
from deepinfer_server.engines.simulated.abilities import SimulatedAbilities
from deepinfer_server.engines.simulated.collectives import new_lockstep_group
from deepinfer_server.engines.simulated.engine import LLMEngine, SimEngineArgs
from deepinfer_server.engines.simulated.outputs import RequestOutput
from deepinfer_server.errors import ErrorKind
from deepinfer_server.ipc.codec import pack_token_ids
from deepinfer_server.ipc.messages import (
    AddRequest,
    Finish,
    Images,
    PrefixCacheStats,
    SamplingOptions,
)
from deepinfer_server.model.tokenizer import embedded_tokenizer_json


@cache
def _tokenizer_json() -> str:
    return embedded_tokenizer_json()


def make_adapter(**overrides: object) -> LLMEngineDriver:
    args = SimEngineArgs(
        tokenizer_json=_tokenizer_json(), lockstep=new_lockstep_group(1, 5.0), ttft_ms=0, itl_ms=0
    )
    for key, value in overrides.items():
        setattr(args, key, value)
    engine = LLMEngine.from_engine_args(args)
    return LLMEngineDriver(engine, RequestOutput, SimulatedAbilities(engine))


def add(adapter: LLMEngineDriver, request_id: str, ids: list[int], **sampling: object) -> object:
    options = SamplingOptions(**{"max_tokens": 50, **sampling})  # type: ignore[arg-type]
    return adapter.add(AddRequest(request_id, pack_token_ids(ids), options))


PROMPT = [0, 128803, 19923, 128804, 128822]  # BOS <｜User｜> "Hello" <｜Assistant｜> </think>


def drain(adapter: LLMEngineDriver) -> dict[str, tuple[list[int], Finish | None]]:
    results: dict[str, tuple[list[int], Finish | None]] = {}
    for _ in range(1000):
        unfinished, outputs = adapter.iterate()
        for output in outputs:
            tokens, _ = results.get(output.request_id, ([], None))
            results[output.request_id] = (tokens + output.tokens.token_ids, output.finish)
        if not unfinished and not outputs:
            return results
    raise AssertionError("the engine never went idle")


def test_eos_of_a_stop_finish_is_hidden() -> None:
    adapter = make_adapter()
    assert add(adapter, "r1", PROMPT) is None
    tokens, reason = drain(adapter)["r1"]
    assert reason is Finish.STOP
    assert tokens == [19923]  # "Hello", without EOS


def test_several_tokens_per_step_are_batched_per_request() -> None:
    adapter = make_adapter(tokens_per_step=3)
    add(adapter, "r1", PROMPT, max_tokens=7, ignore_eos=True)
    sizes = []
    while True:
        unfinished, outputs = adapter.iterate()
        sizes += [len(o.tokens) for o in outputs]
        if not unfinished and not outputs:
            break
    assert sum(sizes) == 7 and max(sizes) == 3


def test_outputs_after_an_abort_are_discarded() -> None:
    adapter = make_adapter()
    add(adapter, "r1", PROMPT, ignore_eos=True)
    adapter.iterate()
    adapter.iterate()
    adapter.abort(["r1"])
    assert adapter.num_live == 0
    assert drain(adapter) == {}


def test_waiting_abort_output_is_not_forwarded() -> None:
    adapter = make_adapter(ttft_ms=60_000)
    add(adapter, "r1", PROMPT)
    adapter.abort(["r1"])
    unfinished, outputs = adapter.iterate()
    assert not unfinished and outputs == []


def test_engine_rejections_become_messages() -> None:
    adapter = make_adapter()
    rejected = add(adapter, "bad", [0, 10**7])
    assert rejected is not None and rejected.kind is ErrorKind.ENGINE_REJECTED  # type: ignore[attr-defined]
    rejected = add(adapter, "empty", [])
    assert rejected is not None and "empty" in rejected.message  # type: ignore[attr-defined]
    assert adapter.num_live == 0


def test_prompt_length_exceeded_is_forwarded_without_a_token() -> None:
    adapter = make_adapter(max_model_len=3)
    add(adapter, "r1", PROMPT)
    assert drain(adapter) == {"r1": ([], Finish.PROMPT_TOO_LONG)}


def test_deepinfer_finish_strings_map_to_outcomes() -> None:
    assert finish_of("stop") is Finish.STOP
    assert finish_of("length") is Finish.LENGTH
    assert finish_of("insufficient_system_resource") is Finish.OUT_OF_RESOURCES
    assert finish_of("xgrammar runtime errors or timeout") is Finish.GRAMMAR_FAILED
    assert finish_of("ve_error") is Finish.ENGINE_ERROR


def test_images_reach_the_engine_as_multi_modal_data() -> None:
    adapter = make_adapter()
    images = Images(sizes=[(630, 476)], data=[b"RIFF-image-bytes"])
    options = SamplingOptions(max_tokens=50)
    adapter.add(AddRequest("r1", pack_token_ids(PROMPT), options, images))
    tokens, reason = drain(adapter)["r1"]
    assert reason is Finish.STOP
    # The simulated engine describes what it was given: size and digest of the bytes.
    text = Tokenizer.from_str(_tokenizer_json()).decode(tokens)
    assert text.startswith("[image 1: 630x476 sha256:")


def test_eos_under_ignore_eos_counts_but_is_never_rendered() -> None:
    adapter = make_adapter()
    add(adapter, "r1", PROMPT, max_tokens=5, ignore_eos=True)
    rendered: list[int] = []
    hidden = 0
    finish = None
    while finish is None:
        _, outputs = adapter.iterate()
        for output in outputs:
            rendered += output.tokens.token_ids
            hidden += output.tokens.hidden_tokens
            finish = output.finish or finish
    # "Hello" EOS "Hello" EOS "Hello": the two EOS count toward max_tokens, unrendered.
    assert finish is Finish.LENGTH
    assert rendered == [19923, 19923, 19923]
    assert hidden == 2


class _CachingEngine:
    """The simulated engine as a prefix-caching one looks to the driver: each sequence
    `add_request` returns says how many prompt tokens it reused, and the engine has counters."""

    def __init__(self, cached: int, **overrides: object) -> None:
        args = SimEngineArgs(
            tokenizer_json=_tokenizer_json(), lockstep=new_lockstep_group(1, 5.0), itl_ms=0
        )
        for key, value in overrides.items():
            setattr(args, key, value)
        self._engine = LLMEngine.from_engine_args(args)
        self.eos_id = self._engine.eos_id
        self.cached = cached
        self.stats = (0, 0, 0)

    def add_request(self, *args: Any, **kwargs: Any) -> object | None:
        sequence = self._engine.add_request(*args, **kwargs)
        return None if sequence is None else SimpleNamespace(num_cached_tokens=self.cached)

    def driver(self, connector: KVConnector | None = None) -> LLMEngineDriver:
        """A driver told this engine has a prefix cache (and `connector`'s role)."""
        return LLMEngineDriver(self, RequestOutput, _CachingAbilities(self, connector))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


class _CachingAbilities(SimulatedAbilities):
    """The simulated engine's abilities, with `_CachingEngine`'s prefix-cache counters."""

    def __init__(self, engine: _CachingEngine, connector: KVConnector | None) -> None:
        super().__init__(engine._engine, prefix_caching=True)
        self._caching = engine
        if connector is not None:
            self.connector = connector

    def prefix_cache_stats(self) -> tuple[int, int, int]:
        return self._caching.stats


def test_the_first_delta_says_how_many_prompt_tokens_the_engine_reused() -> None:
    engine = _CachingEngine(cached=640, ttft_ms=50)
    driver = engine.driver()
    add(driver, "r1", PROMPT)
    unfinished, outputs = driver.iterate()
    # No token yet (the first comes after 50 ms): a delta of its own says the engine took it.
    assert unfinished
    assert [(o.request_id, o.tokens.token_ids, o.cached_tokens) for o in outputs] == [
        ("r1", [], 640)
    ]
    tokens: list[int] = []
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        _, outputs = driver.iterate()
        assert all(o.cached_tokens is None for o in outputs)  # said once
        tokens += [t for o in outputs for t in o.tokens.token_ids]
        if any(o.finish is not None for o in outputs):
            break
    assert tokens == [19923]


def test_later_deltas_carry_no_cached_tokens_and_a_plain_engine_reports_zero() -> None:
    driver = make_adapter(ttft_ms=0)
    add(driver, "r1", PROMPT)
    seen: list[int | None] = []
    for _ in range(1000):
        unfinished, outputs = driver.iterate()
        seen += [o.cached_tokens for o in outputs]
        if not unfinished and not outputs:
            break
    assert seen[0] == 0 and all(value is None for value in seen[1:]) and len(seen) > 1


def test_a_request_aborted_before_its_first_iteration_reports_nothing() -> None:
    driver = _CachingEngine(cached=128, ttft_ms=50).driver()
    add(driver, "r1", PROMPT)
    driver.abort(["r1"])
    assert driver.iterate()[1] == []


def test_prefix_cache_counters_pass_through_and_stay_one_object_while_unchanged() -> None:
    engine = _CachingEngine(cached=0)
    driver = engine.driver()
    engine.stats = (1000, 900, 2)
    first = driver.prefix_cache_stats()
    assert first == PrefixCacheStats(1000, 900, 2)
    assert driver.prefix_cache_stats() is first
    engine.stats = (1200, 900, 3)
    assert driver.prefix_cache_stats() == PrefixCacheStats(1200, 900, 3)
    assert make_adapter().prefix_cache_stats() is None  # no cache, no counters


class _EndingRole(KVConnector):
    """A role that ends requests outside the engine's scheduler, as DeepInfer's COMPLETION
    engine ends one whose KV pull failed (no output handle exists for it)."""

    def __init__(self) -> None:
        self.ended: list[tuple[str, str]] = []

    def take_ended(self) -> list[tuple[str, str]]:
        ended, self.ended = self.ended, []
        return ended


def test_a_request_the_engine_ends_outside_its_scheduler_finishes_with_its_reason() -> None:
    role = _EndingRole()
    driver = _CachingEngine(cached=0, ttft_ms=60_000).driver(role)
    add(driver, "r1", PROMPT)
    add(driver, "r2", PROMPT)
    driver.iterate()
    role.ended = [("r1", "kv_transfer_failed:timeout"), ("gone", "kv_transfer_failed:timeout")]
    _, outputs = driver.iterate()
    assert [(o.request_id, o.finish, o.detail, o.tokens.token_ids) for o in outputs] == [
        ("r1", Finish.KV_TRANSFER_FAILED, "timeout", [])
    ]
    assert driver.num_live == 1  # r1 ended; r2 still runs
    driver.abort(["r2"])
