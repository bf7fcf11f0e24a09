"""Structured outputs and forced tool calls through the engine's grammar, with official clients.

The simulated engine constrains its echo with xgrammar exactly where DeepInfer's matcher would
(after `</think>` in thinking mode, the default), so every answer below must satisfy its schema.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import anthropic
import openai
import pydantic
import pytest

from tests.conftest import MODEL
from tests.dsml import WEATHER_TOOL
from tests.lanes import require_grammar
from tests.server import LiveServer

require_grammar()
pytestmark = pytest.mark.grammar
jsonschema = pytest.importorskip("jsonschema")


class Person(pydantic.BaseModel):
    name: str
    age: int
    tags: list[str]


STRICT_WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {**WEATHER_TOOL["function"], "strict": True},
}


def _ask(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def test_chat_parse_returns_a_schema_valid_object_with_free_reasoning(
    client: openai.OpenAI,
) -> None:
    completion = client.chat.completions.parse(
        model=MODEL, messages=_ask("Tell me about Ada."), response_format=Person
    )
    message = completion.choices[0].message
    assert isinstance(message.parsed, Person)
    # Thinking is on by default: the reasoning is the engine's own, unconstrained.
    assert message.model_extra is not None and message.model_extra["reasoning_content"]
    jsonschema.validate(json.loads(message.content or ""), Person.model_json_schema())


def test_responses_parse_returns_a_parsed_object(client: openai.OpenAI) -> None:
    response = client.responses.parse(model=MODEL, input="Tell me about Ada.", text_format=Person)
    assert isinstance(response.output_parsed, Person)


@pytest.mark.parametrize("thinking", [None, {"type": "disabled"}])
@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_forced_tool_calls_validate_against_the_schema(
    client: openai.OpenAI, tool_choice: Any, thinking: Any
) -> None:
    other = {
        "type": "function",
        "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
    }
    response = client.chat.completions.create(
        model=MODEL,
        messages=_ask("What is the weather like?"),
        tools=[other, WEATHER_TOOL] if isinstance(tool_choice, dict) else [WEATHER_TOOL],
        tool_choice=tool_choice,
        extra_body={"thinking": thinking} if thinking else None,
    )
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.function.name == "get_weather"
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, WEATHER_TOOL["function"]["parameters"])


def test_strict_tools_with_a_response_format_are_accepted(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model=MODEL,
        messages=_ask("Tell me about Ada."),
        tools=[STRICT_WEATHER],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "Person", "schema": Person.model_json_schema(), "strict": True},
        },
    )
    message = response.choices[0].message
    if message.tool_calls:
        for call in message.tool_calls:
            jsonschema.validate(
                json.loads(call.function.arguments), WEATHER_TOOL["function"]["parameters"]
            )
    else:
        jsonschema.validate(json.loads(message.content or ""), Person.model_json_schema())


def test_vllm_structured_outputs_regex_and_choice(client: openai.OpenAI) -> None:
    regex = r"[0-9]{3}-[a-z]{2}"
    response = client.chat.completions.create(
        model=MODEL,
        messages=_ask("anything"),
        extra_body={"structured_outputs": {"regex": regex}},
    )
    assert re.fullmatch(regex, response.choices[0].message.content or "")
    response = client.chat.completions.create(
        model=MODEL,
        messages=_ask("yes"),
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
    )
    assert response.choices[0].message.content in ("yes", "no")


def test_json_object_is_an_object(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model=MODEL,
        messages=_ask("Answer in JSON, please."),
        response_format={"type": "json_object"},
    )
    assert isinstance(json.loads(response.choices[0].message.content or ""), dict)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"structured_outputs": {"regex": "[0-9"}}, "structured_outputs.regex"),
        ({"structured_outputs": {"grammar": "root ::= ("}}, "structured_outputs.grammar"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "no-such-type"}},
                }
            },
            "response_format",
        ),
    ],
)
def test_invalid_grammars_are_400_and_the_server_stays_healthy(
    shared_server: LiveServer, client: openai.OpenAI, extra: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as excinfo:
        client.chat.completions.create(model=MODEL, messages=_ask("x"), extra_body=extra)
    assert excinfo.value.status_code == 400
    body = excinfo.value.body
    assert isinstance(body, dict) and (body.get("param") or "").startswith(param)
    response = client.chat.completions.create(model=MODEL, messages=_ask("still fine"))
    assert response.choices[0].message.content == "still fine"


def test_anthropic_output_config_format_and_forced_tool(shared_server: LiveServer) -> None:
    client = anthropic.Anthropic(base_url=shared_server.base_url, api_key="x", max_retries=0)
    schema = Person.model_json_schema()
    message = client.messages.create(
        model=MODEL,
        max_tokens=300,
        messages=_ask("Tell me about Ada."),
        extra_body={"output_config": {"format": {"type": "json_schema", "schema": schema}}},
    )
    text = "".join(block.text for block in message.content if block.type == "text")
    jsonschema.validate(json.loads(text), schema)
    tool = {"name": "get_weather", "input_schema": WEATHER_TOOL["function"]["parameters"]}
    forced = client.messages.create(
        model=MODEL,
        max_tokens=300,
        messages=_ask("Weather?"),
        tools=[tool],  # type: ignore[list-item]
        tool_choice={"type": "tool", "name": "get_weather"},
    )
    assert forced.stop_reason == "tool_use"
    uses = [block for block in forced.content if block.type == "tool_use"]
    assert uses and all(u.name == "get_weather" for u in uses)
    for use in uses:
        jsonschema.validate(use.input, tool["input_schema"])


def test_pydantic_ai_output_type(shared_server: LiveServer) -> None:
    pydantic_ai = pytest.importorskip("pydantic_ai")
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    async def run() -> Any:
        async with openai.AsyncOpenAI(
            base_url=f"{shared_server.base_url}/v1", api_key="x", max_retries=0
        ) as openai_client:
            model = OpenAIChatModel(MODEL, provider=OpenAIProvider(openai_client=openai_client))
            agent = pydantic_ai.Agent(model, output_type=Person)
            return await agent.run("Tell me about Ada.")

    result = asyncio.run(run())
    assert isinstance(result.output, Person)
