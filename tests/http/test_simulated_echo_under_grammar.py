"""The simulated engine's echo under a grammar, through the official openai
client and the real protocol layer, answered by a real simulated engine in-process.

Where the grammar forces tokens the echo used to be read on by position, so the rest came out
shifted (`{"city": "</=\\"true\\">Paris"}`) or lost (`{"answer": ""}`), and an answer format
with tools looped on empty tool calls. Under a grammar the echo's intent is kept: a DSML call in
the echo becomes that call, other text goes into the first string field of a minimal valid
call or object.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pydantic
import pytest

from tests.dsml import WEATHER_TOOL, tool_calls_block
from tests.http.engine_harness import MODEL, SimulatedEngine, serve_engine
from tests.http.harness import run
from tests.lanes import require_grammar

require_grammar()
pytestmark = pytest.mark.grammar

NO_THINKING: dict[str, Any] = {"thinking": {"type": "disabled"}}
ANSWER_SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string"}},
    "required": ["answer"],
    "additionalProperties": False,
}
ANSWER_FORMAT: Any = {
    "type": "json_schema",
    "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA, "strict": True},
}
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


@pytest.fixture(scope="module")
def engine() -> Iterator[SimulatedEngine]:
    built = SimulatedEngine.start()
    yield built
    built.close()


class Person(pydantic.BaseModel):
    name: str
    age: int


def _after_tool_result(result: str) -> list[dict[str, Any]]:
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})},
    }
    return [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": result},
    ]


def _ask(text: str) -> Any:
    return [{"role": "user", "content": text}]


def _calls(message: Any) -> list[tuple[str, dict[str, Any]]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


@pytest.mark.parametrize("thinking", [None, NO_THINKING], ids=["thinking", "no-thinking"])
@pytest.mark.parametrize(
    "tool_choice",
    ["required", {"type": "function", "function": {"name": "get_weather"}}],
    ids=["required", "named"],
)
def test_a_forced_tool_call_is_the_call_the_echo_holds(
    engine: SimulatedEngine, tool_choice: Any, thinking: Any
) -> None:
    # With thinking the grammar forces "\n\n<｜DSML｜ calls>\n" after </think>; without, the
    # prompt already ends with that line. Either way the echoed call comes out whole.
    async def body() -> None:
        async with serve_engine(engine) as harness:
            response = await harness.openai.chat.completions.create(
                model=MODEL,
                messages=_ask(tool_calls_block("get_weather", city="Paris")),
                tools=[TIME_TOOL, WEATHER_TOOL],  # type: ignore[list-item]
                tool_choice=tool_choice,
                extra_body=thinking,
            )
            choice = response.choices[0]
            assert choice.finish_reason == "tool_calls"
            assert _calls(choice.message) == [("get_weather", {"city": "Paris"})]

    run(body, timeout=120)


@pytest.mark.parametrize("thinking", [None, NO_THINKING], ids=["thinking", "no-thinking"])
def test_a_forced_call_without_one_in_the_echo_carries_the_echo_text(
    engine: SimulatedEngine, thinking: Any
) -> None:
    async def body() -> None:
        async with serve_engine(engine) as harness:
            response = await harness.openai.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "Lisbon, please"}],
                tools=[WEATHER_TOOL],  # type: ignore[list-item]
                tool_choice="required",
                extra_body=thinking,
            )
            assert _calls(response.choices[0].message) == [
                ("get_weather", {"city": "Lisbon, please"})
            ]

    run(body, timeout=120)


@pytest.mark.parametrize("thinking", [None, NO_THINKING], ids=["thinking", "no-thinking"])
@pytest.mark.parametrize("tools", [None, [WEATHER_TOOL]], ids=["no-tools", "tools"])
def test_an_answer_format_after_a_tool_result_holds_the_result(
    engine: SimulatedEngine, thinking: Any, tools: Any
) -> None:
    async def body() -> None:
        async with serve_engine(engine) as harness:
            response = await harness.openai.chat.completions.create(
                model=MODEL,
                messages=_after_tool_result("Sunny, 24 C"),  # type: ignore[arg-type]
                response_format=ANSWER_FORMAT,
                extra_body=thinking,
                **({"tools": tools} if tools else {}),
            )
            choice = response.choices[0]
            assert choice.finish_reason == "stop"
            assert json.loads(choice.message.content or "") == {"answer": "Sunny, 24 C"}

    run(body, timeout=120)


def test_an_answer_format_puts_the_echo_in_the_first_string_field(engine: SimulatedEngine) -> None:
    async def body() -> None:
        async with serve_engine(engine) as harness:
            completion = await harness.openai.chat.completions.parse(
                model=MODEL,
                messages=[{"role": "user", "content": "Tell me about Ada."}],
                response_format=Person,
            )
            assert completion.choices[0].message.parsed == Person(name="Tell me about Ada.", age=0)

    run(body, timeout=120)


def test_an_answer_format_with_tools_takes_the_call_the_echo_holds(engine: SimulatedEngine) -> None:
    async def body() -> None:
        async with serve_engine(engine) as harness:
            response = await harness.openai.chat.completions.create(
                model=MODEL,
                messages=_ask(tool_calls_block("get_weather", city="Oslo")),
                tools=[WEATHER_TOOL],  # type: ignore[list-item]
                response_format=ANSWER_FORMAT,
            )
            choice = response.choices[0]
            assert choice.finish_reason == "tool_calls"
            assert _calls(choice.message) == [("get_weather", {"city": "Oslo"})]

    run(body, timeout=120)


def test_an_output_tool_agent_ends_with_a_valid_answer(engine: SimulatedEngine) -> None:
    # pydantic-ai's default output mode: a `final_result` tool beside the agent's own tools,
    # tool_choice "required". Every forced call used to be the first tool with empty
    # arguments, so the agent looped until its request limit.
    pydantic_ai = pytest.importorskip("pydantic_ai")
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider
    from pydantic_ai.usage import UsageLimits

    cities: list[str] = []

    async def body() -> Any:
        async with serve_engine(engine) as harness:
            provider = OpenAIProvider(openai_client=harness.openai)
            agent = pydantic_ai.Agent(OpenAIChatModel(MODEL, provider=provider), output_type=Person)

            @agent.tool_plain
            def get_weather(city: str) -> str:
                """The weather of a city."""
                cities.append(city)
                return f"Sunny in {city}"

            return await agent.run("Paris", usage_limits=UsageLimits(request_limit=4))

    result = run(body, timeout=180)
    assert cities == ["Paris"]
    assert result.output == Person(name="Sunny in Paris", age=0)
