"""The driver's reasoning budget on the simulated engine: the engine request ends at the budget,
`</think>` is forced, and the one that continues is added after the next step; multi-token
steps, aborts in between and an output limit spent at the budget leave nothing behind."""

from __future__ import annotations

from functools import cache

from tokenizers import Tokenizer

from deepinfer_server.engines.llm_engine_driver import LLMEngineDriver
from deepinfer_server.ipc.codec import pack_token_ids
from deepinfer_server.ipc.messages import AddRequest, Finish, SamplingOptions
from tests.unit.engines.test_llm_engine_driver import _tokenizer_json, drain, make_adapter

REASONING = "step " * 40
ANSWER = "Done."


@cache
def _tokenizer() -> Tokenizer:
    return Tokenizer.from_str(_tokenizer_json())


def _end_id() -> int:
    end = _tokenizer().token_to_id("</think>")
    assert end is not None
    return int(end)


def _ids(text: str) -> list[int]:
    return list(_tokenizer().encode(text, add_special_tokens=False).ids)


def _add(driver: LLMEngineDriver, budget: int, max_tokens: int = 200) -> None:
    prompt = _ids(
        f"<｜begin▁of▁sentence｜><｜User｜>{REASONING}</think>{ANSWER}<｜Assistant｜><think>"
    )
    sampling = SamplingOptions(max_tokens, thinking_budget=budget, thinking_end_id=_end_id())
    assert driver.add(AddRequest("r", pack_token_ids(prompt), sampling)) is None


def test_multi_token_steps_stop_at_the_budget() -> None:
    driver = make_adapter(tokens_per_step=4)
    _add(driver, budget=10)  # not a multiple of the step's 4 tokens
    tokens, finish = drain(driver)["r"]
    assert tokens == [*_ids(REASONING)[:10], _end_id(), *_ids(ANSWER)]
    assert finish is Finish.STOP and driver.num_live == 0


def test_an_output_limit_spent_at_the_budget_ends_with_length() -> None:
    driver = make_adapter()
    _add(driver, budget=5, max_tokens=6)  # 5 reasoning tokens and </think>: nothing left
    tokens, finish = drain(driver)["r"]
    assert tokens == [*_ids(REASONING)[:5], _end_id()]
    assert finish is Finish.LENGTH and driver.num_live == 0


def test_an_abort_before_the_continuation_starts_leaves_nothing() -> None:
    driver = make_adapter()
    _add(driver, budget=3)
    seen: list[int] = []
    while _end_id() not in seen:
        _, deltas = driver.iterate()
        seen += [token for delta in deltas for token in delta.tokens.token_ids]
    driver.abort(["r"])  # the continuation is due after the next step
    assert driver.num_live == 0
    assert drain(driver) == {}
    unfinished, deltas = driver.iterate()
    assert not unfinished and deltas == []
    assert not driver._aborts  # nothing to re-abort forever


def test_a_budget_of_zero_answers_at_once() -> None:
    driver = make_adapter()
    _add(driver, budget=0)
    tokens, finish = drain(driver)["r"]
    assert tokens == [_end_id(), *_ids(ANSWER)] and finish is Finish.STOP


def test_an_output_limit_of_one_is_the_forced_end_alone() -> None:
    driver = make_adapter()
    _add(driver, budget=0, max_tokens=1)
    tokens, finish = drain(driver)["r"]
    assert tokens == [_end_id()] and finish is Finish.LENGTH and driver.num_live == 0
    _add(driver, budget=0, max_tokens=1)
    driver.abort(["r"])  # before its forced token: the engine never had it
    assert drain(driver) == {} and not driver._aborts
