"""so_args building and compilation with xgrammar 0.2.2 (skipped without xgrammar)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from deepinfer_server.grammar import GrammarError, chat_constraint, in_thinking_mode
from deepinfer_server.grammar._xgr import Vocab
from deepinfer_server.grammar.compiler import GrammarBounds, GrammarCompiler, engine_env_defaults
from deepinfer_server.model.tokenizer import embedded_tokenizer_json
from tests.dsml import WEATHER_TOOL
from tests.lanes import require_grammar

require_grammar()
pytestmark = pytest.mark.grammar


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


def _schema_body(schema: Any) -> dict[str, Any]:
    return {
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    }


def test_pydantic_schemas_compile(compiler: GrammarCompiler) -> None:
    pydantic = pytest.importorskip("pydantic")

    class Address(pydantic.BaseModel):  # type: ignore[misc,name-defined]
        street: str
        zip_code: int | None = None

    class Person(pydantic.BaseModel):  # type: ignore[misc,name-defined]
        name: str
        tags: list[str]
        address: Address

    constraint = in_thinking_mode(chat_constraint(_schema_body(Person.model_json_schema())), True)
    assert constraint is not None
    so_args = compiler.so_args_for(constraint)
    assert so_args["schema_type"] == "json"
    assert so_args["trigger_token_ids"] == list(compiler.vocab.think_end_ids)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (_schema_body({"type": 5}), "response_format"),
        (_schema_body({"$ref": "#/$defs/missing"}), "response_format"),
        ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex"),
        ({"structured_outputs": {"grammar": 'root ::= "a" | '}}, "structured_outputs.grammar"),
        ({"guided_grammar": "root ::= undefined_rule"}, "guided_grammar"),
    ],
)
def test_invalid_grammars_are_400s(compiler: GrammarCompiler, body: Any, param: str) -> None:
    constraint = chat_constraint(body)
    assert constraint is not None
    with pytest.raises(GrammarError) as info:
        compiler.so_args_for(constraint)
    assert info.value.param == param
    assert "/project/cpp" not in info.value.message


def test_invalid_tool_schema_names_tools(compiler: GrammarCompiler) -> None:
    tool = {
        "type": "function",
        "function": {
            "name": "f",
            "parameters": {"type": "object", "properties": {"x": {"type": 7}}, "required": ["x"]},
        },
    }
    constraint = chat_constraint({"tools": [tool], "tool_choice": "required"})
    assert constraint is not None
    with pytest.raises(GrammarError) as info:
        compiler.so_args_for(constraint)
    assert info.value.param in ("tools", "tools[0]", "tool_choice")


def test_size_limit_and_cache(compiler: GrammarCompiler) -> None:
    small = GrammarCompiler(compiler.vocab, bounds=GrammarBounds(max_grammar_bytes=64))
    big = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(20)}}
    constraint = chat_constraint(_schema_body(big))
    assert constraint is not None
    with pytest.raises(GrammarError, match="limit"):
        small.so_args_for(constraint)
    so_args = compiler.so_args_for(constraint)
    first = compiler.compile(so_args)
    assert compiler.compile(so_args) is first
    entries, used = compiler.cache_info()
    assert entries >= 1 and used > 0
    assert int(engine_env_defaults()["DEEPINFER_XGRAMMAR_CACHE_LIMIT_BYTES"]) > 0


def test_tool_so_args_shapes(compiler: GrammarCompiler) -> None:
    vocab = compiler.vocab
    required = chat_constraint({"tools": [WEATHER_TOOL], "tool_choice": "required"})
    assert required is not None
    so_args = compiler.so_args_for(required)
    assert so_args["schema_type"] == "ebnf" and "trigger_token_ids" not in so_args
    strict_tool = _strict(WEATHER_TOOL)
    auto = chat_constraint({"tools": [strict_tool]})
    assert auto is not None
    trigger = compiler.so_args_for(auto)["trigger_token_ids"]
    assert vocab.tokenizer.decode(trigger, skip_special_tokens=False) == "｜DSML｜ calls"
    thinking = in_thinking_mode(chat_constraint({"tools": [strict_tool]}), True)
    assert thinking is not None
    assert compiler.so_args_for(thinking)["trigger_token_ids"] == list(vocab.think_end_ids)
    both = chat_constraint({"tools": [WEATHER_TOOL], "response_format": {"type": "json_object"}})
    assert both is not None
    assert compiler.so_args_for(both)["schema_type"] == "ebnf"
