"""KV-cache blocks: the simulated engine's block model and the KV usage the driver reports."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from deepinfer_server.engines.llm_engine_driver import LLMEngineDriver
from deepinfer_server.engines.simulated.abilities import SimulatedAbilities
from deepinfer_server.engines.simulated.kv_blocks import AllocStatus, KVBlocks
from deepinfer_server.engines.simulated.outputs import RequestOutput
from deepinfer_server.model.kv_block import blocks_for
from tests.unit.engines.test_simulated_engine import make_engine, prompt, run_to_end


@dataclass
class _Seq:
    request_id: str
    tokens: int
    output: int


def _plan(pool: KVBlocks, running: list[_Seq]) -> tuple[list[str], list[str]]:
    scheduled, preempted = pool.plan_decode(
        running, lambda s: s.request_id, lambda s: s.output, lambda s: s.tokens + 1
    )
    return [s.request_id for s in scheduled], [s.request_id for s in preempted]


def test_blocks_are_128_tokens_and_block_0_is_never_free() -> None:
    assert [blocks_for(n) for n in (1, 128, 129, 256)] == [1, 1, 2, 2]
    pool = KVBlocks(10)
    assert pool.get_num_free_gpu_blocks() == 9
    pool.allocate("a", 129)
    assert pool.get_num_free_gpu_blocks() == 7
    pool.free("a")
    assert pool.get_num_free_gpu_blocks() == 9


def test_prefill_waits_for_blocks_and_never_fits_the_whole_pool() -> None:
    pool = KVBlocks(10)
    assert pool.can_prefill(10 * 128) is AllocStatus.NEVER
    assert pool.can_prefill(9 * 128) is AllocStatus.OK
    pool.allocate("a", 5 * 128)
    assert pool.can_prefill(5 * 128) is AllocStatus.LATER
    assert pool.can_prefill(4 * 128) is AllocStatus.OK

    # Above 90% of the blocks in use, no prefill even when its blocks are free.
    pool = KVBlocks(100)
    pool.allocate("a", 90 * 128)
    assert pool.can_prefill(128) is AllocStatus.OK
    pool.allocate("b", 128)
    assert pool.get_num_free_gpu_blocks() == 8
    assert pool.can_prefill(128) is AllocStatus.LATER


def test_decode_preempts_the_longest_output_first() -> None:
    pool = KVBlocks(4)  # 3 allocatable blocks
    running = [_Seq("long", 128, 100), _Seq("short", 128, 5), _Seq("mid", 128, 50)]
    for seq in running:
        pool.allocate(seq.request_id, seq.tokens)
    # Every sequence needs a second block and none is free: the longest output goes first,
    # and then the next longest, until the shortest fits.
    assert _plan(pool, running) == (["short"], ["long", "mid"])
    assert pool.get_num_free_gpu_blocks() == 1


def _tokens_by_request(engine: object) -> tuple[dict[str, list[int]], dict[str, int]]:
    tokens: dict[str, list[int]] = {}
    finished_at: dict[str, int] = {}
    for step, batch in enumerate(run_to_end(engine)):  # type: ignore[arg-type]
        for request_id, token, reason in batch:
            tokens.setdefault(request_id, []).append(token)
            if reason:
                assert reason == "length", (request_id, reason)
                finished_at[request_id] = step
    return tokens, finished_at


def _start_two(engine: object) -> None:
    for request_id in ("a", "b"):
        engine.add_request(  # type: ignore[attr-defined]
            "0", request_id, {"max_tokens": 200, "ignore_eos": True}, prompt(f"story {request_id}")
        )


def test_a_full_pool_preempts_and_recomputes_without_duplicate_tokens() -> None:
    reference = make_engine()
    _start_two(reference)
    expected, finished_together = _tokens_by_request(reference)
    assert finished_together["a"] == finished_together["b"]

    # 3 allocatable blocks: both prompts fit one block each, but at 128 tokens only one of
    # them can grow; the other is preempted, waits, and is recomputed once blocks are free.
    engine = make_engine(kv_blocks=4)
    _start_two(engine)
    tokens, finished_at = _tokens_by_request(engine)
    assert tokens == expected  # nothing lost, nothing repeated
    assert finished_at["a"] != finished_at["b"]
    assert engine.scheduler.get_num_free_gpu_blocks() == 3


def test_a_prompt_bigger_than_the_pool_is_ignored_as_too_long() -> None:
    engine = make_engine(kv_blocks=2)
    long_prompt = np.concatenate([prompt("x")] * 100)
    engine.add_request("0", "r", {"max_tokens": 4}, long_prompt)
    outputs = [o for batch in run_to_end(engine) for o in batch]
    assert [reason for _, _, reason in outputs] == ["prompt_length_exceeded"]


def test_the_driver_reports_kv_usage_from_the_engines_blocks() -> None:
    engine = make_engine(kv_blocks=11)
    driver = LLMEngineDriver(engine, RequestOutput, SimulatedAbilities(engine))
    assert driver.kv_cache_usage() == 0.0
    engine.add_request("0", "r", {"max_tokens": 300, "ignore_eos": True}, prompt("hi"))
    engine.has_unfinished_requests()
    engine.step()
    assert driver.kv_cache_usage() == 0.1  # one block of ten allocatable
    list(run_to_end(engine))
    assert driver.kv_cache_usage() == 0.0


def test_an_engine_without_kv_read_out_reports_none() -> None:
    class Bare:
        eos_id = 1

    assert LLMEngineDriver(Bare(), RequestOutput).kv_cache_usage() is None  # type: ignore[arg-type]


def test_a_too_long_sequence_is_ignored_even_while_blocks_are_short() -> None:
    # 2 allocatable blocks, "a" holds one: "b" (2 blocks) would have to wait for "a", but it
    # is longer than the context, and that is checked first: it ends at once.
    engine = make_engine(kv_blocks=3, max_model_len=150, zero_overhead_scheduling=False)
    engine.add_request("0", "a", {"max_tokens": 100, "ignore_eos": True}, prompt("first"))
    engine.has_unfinished_requests()
    engine.step()
    engine.add_request("0", "b", {"max_tokens": 4}, np.concatenate([prompt("x")] * 31))
    order = [(rid, reason) for batch in run_to_end(engine) for rid, _, reason in batch if reason]
    assert order == [("b", "prompt_length_exceeded"), ("a", "length")]


class _FreeMatcher:
    """A grammar that allows every token: what matters here is only that there is one."""

    def choose(self, preferred: int) -> int:
        return preferred


def test_a_preempted_structured_request_ends_and_its_neighbour_completes() -> None:
    # As DeepInfer's `_preempt` (scheduler.hpp) with stop_preempted_request=False: a sequence
    # under a grammar cannot be recomputed and ends "insufficient_system_resource"; the twin
    # shows the same on DeepInfer's own scheduler (tests/e2e/test_deepinfer_twin_failures.py).
    engine = make_engine(kv_blocks=4)  # 3 allocatable blocks
    params = {"max_tokens": 300, "ignore_eos": True}
    structured = engine.add_request("0", "so", dict(params), prompt("story so"))
    assert structured is not None
    structured.matcher = _FreeMatcher()  # type: ignore[assignment]
    for _ in range(20):  # a head start: the longest output is preempted first
        engine.has_unfinished_requests()
        engine.step()
    engine.add_request("0", "plain", dict(params), prompt("story plain"))
    counts: dict[str, int] = {}
    finishes: dict[str, str] = {}
    for batch in run_to_end(engine):
        for request_id, _, reason in batch:
            counts[request_id] = counts.get(request_id, 0) + 1
            if reason:
                finishes[request_id] = reason
    assert finishes == {"so": "insufficient_system_resource", "plain": "length"}
    assert counts["plain"] == 300
    assert engine.scheduler.get_num_free_gpu_blocks() == 3
