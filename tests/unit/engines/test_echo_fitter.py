"""EchoFitter: the simulated echo rewritten into what the request's grammar allows."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from deepinfer_server.engines.simulated import echo_fitter
from deepinfer_server.engines.simulated.echo_fitter import MAX_FILL_TOKENS, EchoFitter
from deepinfer_server.grammar import (
    GrammarCompiler,
    SimulatedMatcher,
    Vocab,
    chat_constraint,
    in_thinking_mode,
)
from deepinfer_server.grammar.compiler import GrammarBounds
from deepinfer_server.model.tokenizer import embedded_tokenizer_json
from tests.dsml import WEATHER_TOOL, tool_calls_block
from tests.lanes import require_grammar

require_grammar()
pytestmark = pytest.mark.grammar

TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string"}},
            "required": ["zone"],
        },
    },
}


def _answer_format(**string_schema: Any) -> dict[str, Any]:
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "string", **string_schema}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    return {"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": True}}


@pytest.fixture(scope="module")
def compiler() -> Iterator[GrammarCompiler]:
    # Not a test of the compile bound: a loaded machine must not turn a compile into a refusal.
    bounds = GrammarBounds(compile_timeout_s=120.0)
    vocab = Vocab.from_tokenizer_json(embedded_tokenizer_json())
    built = GrammarCompiler(vocab, bounds=bounds, workers=1)
    yield built
    built.close()


def _fitter(compiler: GrammarCompiler, body: dict[str, Any], thinking: bool = False) -> EchoFitter:
    constraint = in_thinking_mode(
        chat_constraint({"messages": [{"role": "user", "content": "x"}], **body}), thinking
    )
    assert constraint is not None
    so_args = compiler.so_args_for(constraint)
    return EchoFitter(compiler.compile(so_args), compiler.vocab, so_args)


def _fit(
    compiler: GrammarCompiler,
    body: dict[str, Any],
    echo: str,
    *,
    thinking: bool = False,
    prompt: str = "<｜User｜>x",
    max_tokens: int = 300,
) -> tuple[str, list[int] | None]:
    vocab = compiler.vocab
    fitted = _fitter(compiler, body, thinking).fit(
        vocab.encode(echo), vocab.encode(prompt), max_tokens
    )
    return str(vocab.tokenizer.decode(fitted.script, skip_special_tokens=False)), fitted.plan


def test_an_echo_that_fits_stays_and_becomes_the_plan(compiler: GrammarCompiler) -> None:
    echo = '{"answer": "as it is"}'
    text, plan = _fit(compiler, {"response_format": _answer_format()}, echo)
    assert text == echo
    assert plan == [*compiler.vocab.encode(echo), compiler.vocab.eos_id]


def test_the_reasoning_before_the_trigger_is_kept(compiler: GrammarCompiler) -> None:
    body = {"response_format": _answer_format()}
    text, plan = _fit(compiler, body, "free <｜DSML｜ reasoning</think>hello", thinking=True)
    assert text == 'free <｜DSML｜ reasoning</think>{"answer":"hello"}'
    assert plan is not None and plan[-1] == compiler.vocab.eos_id
    assert compiler.vocab.tokenizer.decode(plan[:-1]) == '{"answer":"hello"}'


def test_the_echo_is_escaped_in_json_and_raw_in_a_dsml_parameter(compiler: GrammarCompiler) -> None:
    echo = 'say "hi"\nthen </go> and </｜x </'
    text, _ = _fit(compiler, {"response_format": _answer_format()}, echo)
    assert json.loads(text) == {"answer": echo}
    forced = {"tools": [WEATHER_TOOL], "tool_choice": "required"}
    text, _ = _fit(compiler, forced, echo)
    # A raw value ends at the first "</｜": there "</" is kept apart.
    assert 'string="true">say "hi"\nthen </go> and < /｜x < /</｜DSML｜ parameter>' in text


def test_an_echo_past_a_max_length_is_cut(compiler: GrammarCompiler) -> None:
    echo = "a sentence far longer than twenty characters"
    text, _ = _fit(compiler, {"response_format": _answer_format(maxLength=20)}, echo)
    assert json.loads(text) == {"answer": echo[:16]}


def test_a_string_the_planner_filled_is_replaced(compiler: GrammarCompiler) -> None:
    text, _ = _fit(compiler, {"response_format": _answer_format(minLength=3)}, "Lisbon")
    assert json.loads(text) == {"answer": "Lisbon"}


def test_a_dsml_call_in_the_echo_is_the_forced_call(compiler: GrammarCompiler) -> None:
    body = {"tools": [TIME_TOOL, WEATHER_TOOL], "tool_choice": "required"}
    echo = "Sure." + tool_calls_block("get_weather", city="Rome")
    # The forced call's prompt already ends with the block's opening line.
    text, _ = _fit(compiler, body, echo)
    assert text == tool_calls_block("get_weather", city="Rome").removeprefix("<｜DSML｜ calls>\n")
    text, _ = _fit(compiler, body, "</think>" + echo, thinking=True)
    assert text == "</think>\n\n" + tool_calls_block("get_weather", city="Rome")


def test_text_beside_a_call_that_does_not_fit_stays(compiler: GrammarCompiler) -> None:
    strict = {"type": "function", "function": {**WEATHER_TOOL["function"], "strict": True}}
    echo = "</think>Sure." + tool_calls_block("no_such_tool", x="1")
    text, plan = _fit(compiler, {"tools": [strict]}, echo, thinking=True)
    assert (text, plan is not None) == ("</think>Sure.", True)


def test_a_forced_call_takes_a_tool_the_conversation_did_not_call(
    compiler: GrammarCompiler,
) -> None:
    body = {"tools": [WEATHER_TOOL, TIME_TOOL], "tool_choice": "required"}
    assert '<｜DSML｜ invoke name="get_weather">' in _fit(compiler, body, "Oslo")[0]
    earlier = "<｜User｜>hi<｜Assistant｜></think>" + tool_calls_block("get_weather", city="Oslo")
    text, _ = _fit(compiler, body, "<tool_result>Rain</tool_result>", prompt=earlier)
    assert text == tool_calls_block("get_time", zone="Rain").removeprefix("<｜DSML｜ calls>\n")


def test_nothing_that_fits_the_budget_leaves_the_script(compiler: GrammarCompiler) -> None:
    text, plan = _fit(
        compiler, {"response_format": _answer_format(minLength=200)}, "hi", max_tokens=8
    )
    assert (text, plan) == ("hi", None)


def test_no_trigger_in_the_script_leaves_it(compiler: GrammarCompiler) -> None:
    body = {"response_format": _answer_format()}
    assert _fit(compiler, body, "no end of reasoning", thinking=True) == (
        "no end of reasoning",
        None,
    )


def test_the_fit_plans_a_bounded_number_of_tokens(
    compiler: GrammarCompiler, monkeypatch: pytest.MonkeyPatch
) -> None:
    chosen = [0]

    class Counting(SimulatedMatcher):
        def choose(self, preferred: int) -> int:
            chosen[0] += 1
            return super().choose(preferred)

    monkeypatch.setattr(echo_fitter, "SimulatedMatcher", Counting)
    # A grammar whose every completion is endless: no fit, within the planning bound.
    endless = {"structured_outputs": {"regex": "a{100000000}"}}
    text, plan = _fit(compiler, endless, "free text", max_tokens=10_000)
    assert (text, plan) == ("free text", None)
    assert 0 < chosen[0] <= MAX_FILL_TOKENS
