"""The simulated engine's matcher: any preferred stream ends as output the grammar accepts,
and forced tool calls parse back through deepseek-recipe into schema-valid calls."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from deepseek_recipe import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ConversionOptions,
    InferenceChunk,
    InferenceFinishReason,
    ModelVersion,
    PromptUsage,
    StreamProcessor,
    Tokenizer,
)

from deepinfer_server.grammar import Constraint, chat_constraint, in_thinking_mode
from deepinfer_server.grammar._xgr import Vocab
from deepinfer_server.grammar.compiler import GrammarBounds, GrammarCompiler
from deepinfer_server.grammar.matcher import SimulatedMatcher
from deepinfer_server.model.tokenizer import embedded_tokenizer_json
from tests.dsml import WEATHER_TOOL, tool_calls_block
from tests.lanes import require_grammar

require_grammar()
pytestmark = pytest.mark.grammar

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 2},
        "age": {"type": "integer", "minimum": 0},
        "tags": {"type": "array", "items": {"type": "string"}},
        "kind": {"enum": ["a", "b"]},
    },
    "required": ["name", "age", "tags", "kind"],
}
ECHOES = [
    "Hello there, friend.",
    '{"name": "Bob", "age": 42, "tags": ["x"], "kind": "b"}',
    '{"name": "B',
    "    \n\n   \t   ",
    '{"name": "Bob", "age": -1',
]
EXTRA_TOOL = {
    "type": "function",
    "function": {
        "name": "book",
        "parameters": {
            "type": "object",
            "properties": {
                "when": {"type": "string", "pattern": "^[0-9]{4}$"},
                "seats": {"type": "integer"},
                "opts": {
                    "type": "object",
                    "properties": {"x": {"type": "boolean"}},
                    "required": ["x"],
                },
            },
            "required": ["when", "seats", "opts"],
        },
    },
}


def _strict(tool: Any) -> Any:
    """A copy of a Chat function tool with `strict: true`."""
    copy = json.loads(json.dumps(tool))
    copy["function"]["strict"] = True
    return copy


@pytest.fixture(scope="module")
def compiler() -> Iterator[GrammarCompiler]:
    # Not a test of the compile bound: a loaded machine must not turn a compile into a refusal.
    bounds = GrammarBounds(compile_timeout_s=120.0)
    compiler = GrammarCompiler(Vocab.from_tokenizer_json(embedded_tokenizer_json()), bounds=bounds)
    yield compiler
    compiler.close()


def _generate(compiler: GrammarCompiler, constraint: Constraint, echo: str, budget: int) -> str:
    vocab = compiler.vocab
    so_args = compiler.so_args_for(constraint)
    matcher = SimulatedMatcher.from_so_args(so_args, compiler, budget)
    preferred = vocab.encode(echo)
    out: list[int] = []
    for position in range(budget):
        token = matcher.choose(preferred[position] if position < len(preferred) else vocab.eos_id)
        if token == vocab.eos_id:
            break
        out.append(token)
    assert matcher.finished or not matcher.constrained, "the grammar did not finish in budget"
    return str(vocab.tokenizer.decode(out, skip_special_tokens=False))


def _check_person(value: Any) -> None:
    assert set(value) == {"name", "age", "tags", "kind"}
    assert isinstance(value["name"], str) and len(value["name"]) >= 2
    assert isinstance(value["age"], int) and value["age"] >= 0
    assert all(isinstance(tag, str) for tag in value["tags"]) and value["kind"] in ("a", "b")


@pytest.mark.parametrize("echo", ECHOES)
def test_json_schema_from_any_stream(compiler: GrammarCompiler, echo: str) -> None:
    body = {
        "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}
    }
    constraint = chat_constraint(body)
    assert constraint is not None
    text = _generate(compiler, constraint, echo, budget=64)
    _check_person(json.loads(text))
    if echo.startswith('{"name": "Bob", "age": 42'):
        assert json.loads(text)["name"] == "Bob"


@pytest.mark.parametrize(
    ("options", "check"),
    [
        ({"regex": "(ab)+c[0-9]{3}"}, lambda t: __import__("re").fullmatch("(ab)+c[0-9]{3}", t)),
        ({"choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
        ({"grammar": 'root ::= "x" [0-9]+ ("!" | "?")'}, lambda t: t[0] == "x" and t[-1] in "!?"),
        (
            {"json": {"type": "array", "items": {"type": "number"}, "minItems": 2}},
            lambda t: len(json.loads(t)) >= 2,
        ),
    ],
)
def test_other_kinds(compiler: GrammarCompiler, options: dict[str, Any], check: Any) -> None:
    constraint = chat_constraint({"structured_outputs": options})
    assert constraint is not None
    for echo in ("no way", "x12!", "yes"):
        assert check(_generate(compiler, constraint, echo, budget=32))


def test_thinking_trigger_leaves_reasoning_free(compiler: GrammarCompiler) -> None:
    body = {
        "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}
    }
    constraint = in_thinking_mode(chat_constraint(body), True)
    assert constraint is not None
    reasoning = "I think <｜DSML｜ calls> {not json at all"
    text = _generate(compiler, constraint, reasoning + "</think>Hello", budget=80)
    head, answer = text.split("</think>")
    assert head == reasoning
    _check_person(json.loads(answer))


def _parse(body: dict[str, Any], text: str) -> dict[str, Any]:
    """The message deepseek-recipe makes of `text` as the model's answer to `body`."""
    tokenizer_json = embedded_tokenizer_json()
    options = ConversionOptions().with_model_alias("m", ModelVersion.DeepseekV41Flash)
    converted = ChatCompletionRequest({"model": "m", **body}).convert(options)
    generator = ChatCompletionRequest.chunk_generator(converted, "id", "m")
    processor = StreamProcessor(
        generator, converted.parsing_options, Tokenizer.from_str(tokenizer_json)
    )
    response = ChatCompletionResponse("id", "m", 0, 1, 0)
    vocab = Vocab.from_tokenizer_json(tokenizer_json)
    chunks = processor.push(InferenceChunk.ready(prompt_usage=PromptUsage(prompt_tokens=1)))
    chunks += processor.push(InferenceChunk.tokens(vocab.encode(text)))
    if not processor.finished:
        chunks += processor.push(InferenceChunk.finish(InferenceFinishReason.Stop))
    chunks += processor.finish()
    for chunk in chunks:
        response.accumulate(chunk)  # type: ignore[arg-type]
    message: dict[str, Any] = json.loads(response.to_json())["choices"][0]["message"]
    return message


def _check_call(call: dict[str, Any]) -> None:
    arguments = json.loads(call["function"]["arguments"])
    if call["function"]["name"] == "get_weather":
        assert isinstance(arguments["city"], str) and set(arguments) == {"city"}
        return
    assert call["function"]["name"] == "book"
    assert len(arguments["when"]) == 4 and arguments["when"].isdigit()
    assert isinstance(arguments["seats"], int) and isinstance(arguments["opts"]["x"], bool)


@pytest.mark.parametrize(
    ("tool_choice", "echo"),
    [
        ("required", "What is the weather in Paris?"),
        ("required", tool_calls_block("get_weather", city="Paris").split("\n", 1)[1]),
        ({"type": "function", "function": {"name": "book"}}, "book me a table"),
        (
            {"type": "function", "function": {"name": "book"}},
            '<｜DSML｜ invoke name="get_weather">',
        ),
    ],
)
def test_forced_tool_call_parses(compiler: GrammarCompiler, tool_choice: Any, echo: str) -> None:
    body: dict[str, Any] = {
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [WEATHER_TOOL, EXTRA_TOOL],
        "tool_choice": tool_choice,
        "thinking": {"type": "disabled"},
    }
    constraint = chat_constraint(body)
    assert constraint is not None
    text = _generate(compiler, constraint, echo, budget=200)
    message = _parse(body, text)
    calls = message["tool_calls"]
    assert calls and message["content"] in ("", None)
    for call in calls:
        _check_call(call)
    if isinstance(tool_choice, dict):
        assert {call["function"]["name"] for call in calls} == {"book"}
    if "Paris" in echo and "DSML" in echo:
        assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}


def test_strict_tools_under_auto(compiler: GrammarCompiler) -> None:
    strict = _strict(EXTRA_TOOL)
    body: dict[str, Any] = {
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [strict],
        "thinking": {"type": "disabled"},
    }
    constraint = chat_constraint(body)
    assert constraint is not None
    plain = _generate(compiler, constraint, "Just text, no call.", budget=40)
    assert plain == "Just text, no call."
    echo = "Sure.\n\n<｜DSML｜ calls>\n" + '<｜DSML｜ invoke name="book">\nnonsense'
    text = _generate(compiler, constraint, echo, budget=200)
    message = _parse(body, text)
    assert message["content"].strip() == "Sure."
    for call in message["tool_calls"]:
        _check_call(call)


def test_tools_or_json(compiler: GrammarCompiler) -> None:
    body: dict[str, Any] = {
        "messages": [{"role": "user", "content": "hi json"}],
        "tools": [WEATHER_TOOL],
        "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}},
        "thinking": {"type": "disabled"},
    }
    constraint = chat_constraint(body)
    assert constraint is not None
    _check_person(json.loads(_generate(compiler, constraint, "plain words", budget=64)))
    call = "\n\n" + tool_calls_block("get_weather", city="Rome")
    message = _parse(body, _generate(compiler, constraint, call, budget=120))
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"city": "Rome"}
