"""The simulated engine honours DeepInfer 0.1.0's LLMEngine contract (deepinfer-contract.md §9)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from functools import cache

import numpy as np
import pytest
from tokenizers import Tokenizer

from deepinfer_server.engines.simulated.collectives import new_lockstep_group
from deepinfer_server.engines.simulated.engine import LLMEngine, SimEngineArgs
from deepinfer_server.engines.simulated.outputs import (
    POOL_CAPACITY,
    OutputPool,
    OutputRecord,
    RequestOutput,
)
from deepinfer_server.engines.simulated.script import REASONING_SENTENCE
from deepinfer_server.model.tokenizer import embedded_tokenizer_json

EOS = 1


@cache
def _tokenizer_json() -> str:
    return embedded_tokenizer_json()


@cache
def _tokenizer() -> Tokenizer:
    return Tokenizer.from_str(_tokenizer_json())


def prompt(text: str, thinking: bool = False) -> np.ndarray:
    tail = "<think>" if thinking else "</think>"
    ids = (
        _tokenizer()
        .encode(
            f"<｜begin▁of▁sentence｜><｜User｜>{text}<｜Assistant｜>{tail}",
            add_special_tokens=False,
        )
        .ids
    )
    return np.asarray(ids, dtype=np.int32)


def make_engine(**overrides: object) -> LLMEngine:
    args = SimEngineArgs(
        tokenizer_json=_tokenizer_json(),
        lockstep=new_lockstep_group(1, 5.0),
        ttft_ms=0.0,
        itl_ms=0.0,
    )
    for key, value in overrides.items():
        setattr(args, key, value)
    return LLMEngine.from_engine_args(args)


def read(handles: np.ndarray) -> list[tuple[str, int, str]]:
    return [
        (
            RequestOutput.get_request_id(h),
            RequestOutput.get_token_id(h),
            RequestOutput.get_finish_reason(h),
        )
        for h in handles
    ]


def run_to_end(engine: LLMEngine) -> Iterator[list[tuple[str, int, str]]]:
    while engine.has_unfinished_requests():
        yield read(engine.step())
    yield read(engine.flush_inflight_reqs())


def test_echoes_the_last_user_turn_then_eos() -> None:
    engine = make_engine()
    engine.add_request("0", "r1", {"max_tokens": 100}, prompt("Hello there"))
    outputs = [o for batch in run_to_end(engine) for o in batch]
    tokens = [token for _, token, _ in outputs]
    assert tokens[-1] == EOS
    assert outputs[-1][2] == "stop"
    assert _tokenizer().decode(tokens[:-1]) == "Hello there"


def test_thinking_mode_prepends_reasoning() -> None:
    engine = make_engine()
    engine.add_request("0", "r1", {"max_tokens": 100}, prompt("Hi", thinking=True))
    tokens = [t for batch in run_to_end(engine) for _, t, _ in batch][:-1]
    text = _tokenizer().decode(tokens, skip_special_tokens=False)
    assert text == f"{REASONING_SENTENCE}</think>Hi"


def test_zero_overhead_scheduling_returns_decode_tokens_one_step_late() -> None:
    engine = make_engine()
    engine.add_request("0", "r1", {"max_tokens": 3, "ignore_eos": True}, prompt("abc"))
    assert engine.has_unfinished_requests()
    assert len(engine.step()) == 1  # the prefill step returns the first token at once
    assert engine.has_unfinished_requests()
    assert len(engine.step()) == 0  # the first decode step's token is deferred
    assert engine.has_unfinished_requests()
    assert len(engine.step()) == 1  # ... and arrives with the next step
    assert not engine.has_unfinished_requests()  # finished, though its last token is in flight
    final = read(engine.flush_inflight_reqs())
    assert final == [("r1", final[0][1], "length")]


def test_without_zos_tokens_come_in_the_same_step() -> None:
    engine = make_engine(zero_overhead_scheduling=False)
    engine.add_request("0", "r1", {"max_tokens": 2, "ignore_eos": True}, prompt("abc"))
    engine.has_unfinished_requests()
    assert len(engine.step()) == 1
    engine.has_unfinished_requests()
    assert read(engine.step())[0][2] == "length"


def test_handles_are_released_by_the_next_step() -> None:
    engine = make_engine()
    engine.add_request("0", "r1", {"max_tokens": 5, "ignore_eos": True}, prompt("abc"))
    engine.has_unfinished_requests()
    handles = engine.step()
    clone = RequestOutput.clone(handles[0])
    assert RequestOutput.get_request_id(handles[0]) == "r1"
    engine.has_unfinished_requests()
    engine.step()
    with pytest.raises(RuntimeError, match="released"):
        RequestOutput.get_token_id(handles[0])
    assert clone.request_id == "r1"  # clones stay valid


def test_several_tokens_per_step_only_last_carries_finish_and_counts() -> None:
    engine = make_engine(tokens_per_step=4, zero_overhead_scheduling=False)
    engine.add_request("0", "r1", {"max_tokens": 6, "ignore_eos": True}, prompt("abcdef"))
    engine.has_unfinished_requests()
    engine.step()
    engine.has_unfinished_requests()
    handles = engine.step()
    assert len(handles) == 4
    assert [RequestOutput.get_draft_tok(h) for h in handles] == [0, 0, 0, 4]
    engine.has_unfinished_requests()
    handles = engine.step()
    assert len(handles) == 1  # max_tokens stops the burst
    assert RequestOutput.get_finish_reason(handles[0]) == "length"
    assert RequestOutput.get_num_output_tokens(handles[0]) == 6


def test_abort_running_emits_nothing_more() -> None:
    engine = make_engine()
    engine.add_request("0", "r1", {"max_tokens": 50, "ignore_eos": True}, prompt("abc"))
    engine.has_unfinished_requests()
    engine.step()
    engine.has_unfinished_requests()
    engine.step()  # a decode token is now in flight
    count, length = engine.abort_request("r1")
    assert count == 1 and length > 0
    assert not engine.has_unfinished_requests()
    assert len(engine.flush_inflight_reqs()) == 0  # the in-flight token is dropped
    assert engine.abort_request(["r1"]) == (0, 0)


def test_abort_waiting_emits_one_ignored_abort_output() -> None:
    engine = make_engine(ttft_ms=60_000.0)
    p = prompt("abc")
    engine.add_request("0", "r1", {"max_tokens": 50}, p)
    assert engine.abort_request(["r1"]) == (1, len(p))
    handles = engine.flush_inflight_reqs()
    assert len(handles) == 1
    output = RequestOutput.clone(handles[0])
    assert output.finish_reason == "abort" and output.finished
    assert output.token_id == int(p[-1])  # not a generated token
    assert output.token_logprobs == 1.0
    assert output.num_output_tokens == 1


def test_add_request_input_rules() -> None:
    engine = make_engine()
    assert engine.add_request("0", "bad", {}, np.asarray([0, 10**7], dtype=np.int32)) is None
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("0", "e", {}, np.asarray([], dtype=np.int32))
    with pytest.raises(TypeError):
        engine.add_request("0", "wrong-dtype", {}, np.asarray([0, 1], dtype=np.int64))
    with pytest.raises(TypeError):
        engine.add_request("0", "unknown-key", {"beam_width": 2}, prompt("x"))
    with pytest.raises(ValueError, match="top_p"):
        engine.add_request("0", "bad-top-p", {"top_p": 0.0}, prompt("x"))
    with pytest.raises(AttributeError):
        engine.add_request("0", "list", {}, [0, 1])  # type: ignore[arg-type]
    assert not engine.has_unfinished_requests()


def test_default_max_tokens_is_sixteen_and_none_values_fall_back() -> None:
    engine = make_engine()
    engine.add_request("0", "r1", {"max_tokens": None, "ignore_eos": True}, prompt("x"))
    outputs = [o for batch in run_to_end(engine) for o in batch]
    assert len(outputs) == 16 and outputs[-1][2] == "length"


def test_prompt_longer_than_the_context_fails_at_prefill() -> None:
    engine = make_engine(max_model_len=4)
    engine.add_request("0", "r1", {"max_tokens": 4}, prompt("a long prompt indeed"))
    outputs = [o for batch in run_to_end(engine) for o in batch]
    assert [reason for _, _, reason in outputs] == ["prompt_length_exceeded"]


def test_running_cap_queues_the_rest_inside_the_engine() -> None:
    engine = make_engine(max_num_seqs=1)
    engine.add_request("0", "a", {"max_tokens": 3, "ignore_eos": True}, prompt("a"))
    engine.add_request("0", "b", {"max_tokens": 3, "ignore_eos": True}, prompt("b"))
    order = [rid for batch in run_to_end(engine) for rid, _, _ in batch]
    assert order.count("a") == order.count("b") == 3
    # b is prefilled only once a has generated its last token (that token, deferred by
    # zero-overhead scheduling, may still be returned after b's immediate first token).
    assert order.index("b") >= 2


def test_engine_is_owned_by_its_thread() -> None:
    engine = make_engine()
    errors: list[BaseException] = []

    def other_thread() -> None:
        try:
            engine.has_unfinished_requests()
        except RuntimeError as exc:
            errors.append(exc)

    thread = threading.Thread(target=other_thread)
    thread.start()
    thread.join()
    assert errors and "thread" in str(errors[0])


def test_pool_capacity_is_enforced() -> None:
    pool = OutputPool()
    record = OutputRecord(request_id="r", prompt_len=1, token_id=5)
    handles = pool.publish([record] * POOL_CAPACITY)
    with pytest.raises(RuntimeError, match="exhausted"):
        pool.publish([record])
    pool.release(handles[:1])
    assert pool.get(int(pool.publish([record])[0])) == record


def test_injected_faults() -> None:
    with pytest.raises(RuntimeError, match="start-up"):
        make_engine(fault="startup")
    engine = make_engine(fault="step-error", fault_after_steps=1)
    engine.has_unfinished_requests()
    engine.step()
    with pytest.raises(RuntimeError, match="step-error"):
        engine.step()


def test_idle_flushes_hold_no_output_handles() -> None:
    engine = make_engine()
    for _ in range(100):
        engine.has_unfinished_requests()
        assert read(engine.flush_inflight_reqs()) == []
    assert len(engine._published) == 0  # nothing published, nothing to release later


def test_a_recomputed_sequence_longer_than_one_step_budget_still_runs() -> None:
    # KV pressure preempts a sequence; recomputing it (prompt + output) needs more than
    # max_num_batched_tokens: it must be prefilled alone rather than block the queue forever.
    engine = make_engine(
        max_model_len=2048,
        max_num_batched_tokens=256,
        kv_blocks=4,
        prefill_attempt_interval=1,
        prefill_any_attempt_interval=1,
    )
    engine.add_request("0", "A", {"max_tokens": 600, "ignore_eos": True}, prompt("hello"))
    engine.add_request("0", "B", {"max_tokens": 200, "ignore_eos": True}, prompt("hi"))
    finished = {}
    for _ in range(5000):
        if not engine.has_unfinished_requests():
            break
        finished.update({rid: reason for rid, _, reason in read(engine.step()) if reason})
    finished.update({rid: r for rid, _, r in read(engine.flush_inflight_reqs()) if r})
    assert set(finished) == {"A", "B"}


class _ForcingMatcher:
    """Stands in for a grammar that forces `forced` first and then allows anything."""

    def __init__(self, forced: list[int]) -> None:
        self.forced = forced

    def choose(self, preferred: int) -> int:
        return self.forced.pop(0) if self.forced else preferred


def test_the_script_goes_on_aligned_after_tokens_a_grammar_forced() -> None:
    engine = make_engine()
    sequence = engine.add_request("0", "r1", {"max_tokens": 100}, prompt("Hello there"))
    assert sequence is not None
    forced = _tokenizer().encode("{forced}", add_special_tokens=False).ids
    sequence.matcher = _ForcingMatcher(list(forced))  # type: ignore[assignment]
    tokens = [t for batch in run_to_end(engine) for _, t, _ in batch]
    assert tokens[-1] == EOS
    # Not shifted by the forced tokens: the whole echo follows them.
    assert _tokenizer().decode(tokens[:-1]) == "{forced}Hello there"
