"""Reading structured-output options from raw request bodies (no xgrammar needed)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from deepinfer_server.grammar import (
    GrammarError,
    chat_constraint,
    in_thinking_mode,
    messages_constraint,
    responses_constraint,
)
from tests.dsml import WEATHER_TOOL

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def _strict(tool: Any) -> Any:
    """A copy of a Chat function tool with `strict: true`."""
    copy = json.loads(json.dumps(tool))
    copy["function"]["strict"] = True
    return copy


def test_chat_response_formats() -> None:
    body = {
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}
    }
    constraint = in_thinking_mode(chat_constraint(body), True)
    assert constraint is not None
    assert constraint.kind == "json_schema" and json.loads(constraint.spec) == SCHEMA
    assert constraint.thinking and constraint.tools is None
    assert chat_constraint({"response_format": {"type": "json_object"}}) is not None
    assert chat_constraint({"response_format": {"type": "text"}}) is None
    assert chat_constraint({}) is None


def test_chat_bad_formats_name_the_param() -> None:
    with pytest.raises(GrammarError) as info:
        chat_constraint({"response_format": {"type": "json_schema", "json_schema": {}}})
    assert info.value.param == "response_format"
    with pytest.raises(GrammarError) as info:
        chat_constraint({"structured_outputs": {"choice": []}})
    assert info.value.param == "structured_outputs.choice"
    with pytest.raises(GrammarError) as info:
        chat_constraint({"guided_json": "{not json"})
    assert info.value.param == "guided_json"
    with pytest.raises(GrammarError):
        chat_constraint({"structured_outputs": {"regex": "a", "choice": ["b"]}})


def test_vllm_options() -> None:
    regex = chat_constraint({"structured_outputs": {"regex": "[a-z]+"}})
    assert regex is not None and (regex.kind, regex.spec) == ("regex", "[a-z]+")
    grammar = chat_constraint({"guided_grammar": 'root ::= "x"'})
    assert grammar is not None and grammar.kind == "ebnf"
    choice = chat_constraint({"guided_choice": ["yes", "no"]})
    assert choice is not None and json.loads(choice.spec) == ["yes", "no"]


def test_chat_tool_choice() -> None:
    required = chat_constraint({"tools": [WEATHER_TOOL], "tool_choice": "required"})
    assert required is not None and required.tools is not None
    assert required.tools.mode == "required" and required.kind is None
    named = chat_constraint(
        {
            "tools": [WEATHER_TOOL],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        }
    )
    assert named is not None and named.tools is not None and named.tools.name == "get_weather"
    with pytest.raises(GrammarError) as info:
        chat_constraint(
            {
                "tools": [WEATHER_TOOL],
                "tool_choice": {"type": "function", "function": {"name": "x"}},
            }
        )
    assert info.value.param == "tool_choice"
    assert chat_constraint({"tools": [WEATHER_TOOL]}) is None
    strict_tool = _strict(WEATHER_TOOL)
    auto = chat_constraint({"tools": [strict_tool]})
    assert auto is not None and auto.tools is not None and auto.tools.mode == "strict_auto"


def test_tools_and_format_make_one_constraint() -> None:
    body = {"tools": [WEATHER_TOOL], "response_format": {"type": "json_object"}}
    both = chat_constraint(body)
    assert both is not None and both.kind == "json_object"
    assert both.tools is not None and both.tools.mode == "auto"
    none = chat_constraint({**body, "tool_choice": "none"})
    assert none is not None and none.tools is None


def test_responses_and_messages() -> None:
    fmt = {"format": {"type": "json_schema", "name": "x", "schema": SCHEMA, "strict": True}}
    responses = responses_constraint({"text": fmt})
    assert responses is not None and responses.param == "text.format"
    tool = {"type": "function", "name": "f", "parameters": SCHEMA}
    forced = responses_constraint(
        {"tools": [tool], "tool_choice": {"type": "function", "name": "f"}}
    )
    assert forced is not None and forced.tools is not None and forced.tools.mode == "named"
    strict_default = responses_constraint({"tools": [tool]})
    assert strict_default is not None and strict_default.tools is not None
    messages = in_thinking_mode(
        messages_constraint(
            {"output_config": {"format": {"type": "json_schema", "schema": SCHEMA}}}
        ),
        True,
    )
    assert messages is not None and messages.param == "output_config.format"
    anthropic_tool = {"name": "f", "input_schema": SCHEMA}
    any_tool = messages_constraint({"tools": [anthropic_tool], "tool_choice": {"type": "any"}})
    assert any_tool is not None and any_tool.tools is not None and any_tool.tools.mode == "required"
    named = messages_constraint(
        {"tools": [anthropic_tool], "tool_choice": {"type": "tool", "name": "f"}}
    )
    assert named is not None and named.tools is not None and named.tools.name == "f"
