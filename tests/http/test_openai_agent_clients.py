"""What OpenAI-protocol agents (Codex, the AI SDK, LangChain, LiteLLM) need of /v1/responses and
/v1/chat/completions: reasoning summaries, sealed reasoning replayed without a store,
and the chat histories such clients send."""

from __future__ import annotations

import json
import logging
from typing import Any

import httpx2
import openai
import pytest

from deepinfer_server.api.app import build_app
from deepinfer_server.protocol.core.reasoning_seal import ReasoningSeal
from deepinfer_server.protocol.responses.reasoning import conversation_digest
from tests.dsml import WEATHER_TOOL, tool_calls_block
from tests.http.agent_harness import events, last_prompt
from tests.http.harness import MODEL, Harness, Script, run, serve
from tests.lanes import require_grammar

RESPONSES = "/v1/responses"
CHAT = "/v1/chat/completions"
SECRET = "test-secret"
TOOL = {"type": "function", "name": "f", "parameters": {"type": "object"}}
CHAT_TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
CODEX_ASKS = {"reasoning": {"summary": "auto"}, "include": ["reasoning.encrypted_content"]}


def responses_body(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "input": "hi", "store": False, **extra}


def reasoning_items(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [item for item in output if item["type"] == "reasoning"]


def test_summary_and_sealed_reasoning_when_asked() -> None:
    seal = ReasoningSeal.from_secret(SECRET)

    async def body() -> None:
        async with serve("--reasoning-secret", SECRET, script=Script("Pondering.</think>Hi")) as h:
            response = await h.client.post(RESPONSES, json=responses_body(**CODEX_ASKS))
            (item,) = reasoning_items(response.json()["output"])
            assert item["summary"] == [{"type": "summary_text", "text": "Pondering."}]
            assert seal.open(item["encrypted_content"], conversation_digest("hi")) == "Pondering."

            plain = await h.client.post(RESPONSES, json=responses_body())
            (item,) = reasoning_items(plain.json()["output"])
            assert item["summary"] == [] and item["encrypted_content"] is None

    run(body)


def test_streamed_summary_events_and_sequence_numbers() -> None:
    async def body() -> None:
        async with serve("--reasoning-secret", SECRET, script=Script("Pondering.</think>Hi")) as h:
            stream = await h.client.post(RESPONSES, json=responses_body(stream=True, **CODEX_ASKS))
            sent = events(stream.text)
            assert [e["sequence_number"] for e in sent] == list(range(len(sent)))
            kinds = [e["type"] for e in sent]
            summary = [k for k in kinds if "reasoning_summary" in k]
            assert summary == [
                "response.reasoning_summary_part.added",
                "response.reasoning_summary_text.delta",
                "response.reasoning_summary_text.done",
                "response.reasoning_summary_part.done",
            ]
            done = next(e for e in sent if e["type"] == "response.reasoning_summary_text.done")
            assert done["text"] == "Pondering."
            item_done = sent[kinds.index("response.reasoning_summary_part.done") + 1]
            assert item_done["type"] == "response.output_item.done"
            completed = sent[-1]["response"]["output"]
            assert reasoning_items(completed) == [item_done["item"]]
            seal = ReasoningSeal.from_secret(SECRET)
            blob = item_done["item"]["encrypted_content"]
            assert seal.open(blob, conversation_digest("hi")) == "Pondering."

    run(body)


USER_TURN = {"role": "user", "content": "hi"}


def replay(reasoning: dict[str, Any], before: list[Any] | None = None) -> dict[str, Any]:
    """A Codex-style next turn: reasoning item, its tool call, the call's output."""
    history = [
        *(before if before is not None else [USER_TURN]),
        {"type": "reasoning", "id": "rs_1", "summary": [], **reasoning},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "result"},
    ]
    return responses_body(input=history, tools=[TOOL], **CODEX_ASKS)


def test_sealed_reasoning_is_restored_into_the_prompt() -> None:
    blob = ReasoningSeal.from_secret(SECRET).seal(
        "I pondered the tool.", conversation_digest([USER_TURN])
    )

    async def body() -> None:
        async with serve("--reasoning-secret", SECRET) as h:
            response = await h.client.post(RESPONSES, json=replay({"encrypted_content": blob}))
            assert response.status_code == 200, response.text
            # V4.1 keeps the current turn's reasoning before its tool calls.
            assert "<think>I pondered the tool.</think>" in last_prompt(h.coordinator)

    run(body)


def test_the_servers_own_blob_round_trips_through_a_client_history() -> None:
    """Turn 1's output replayed as the client re-serialises it: its reasoning is restored."""

    async def body() -> None:
        script = Script("I pondered the tool.</think>Calling it.")
        async with serve(script=script) as h:
            first = await h.client.post(
                RESPONSES, json=responses_body(input=[USER_TURN], tools=[TOOL], **CODEX_ASKS)
            )
            (item,) = reasoning_items(first.json()["output"])
            retyped = {"type": "message", "role": "user", "id": "m1", "content": [
                {"type": "input_text", "text": "hi"}
            ]}  # fmt: skip
            reasoning = {"encrypted_content": item["encrypted_content"]}
            response = await h.client.post(RESPONSES, json=replay(reasoning, before=[retyped]))
            assert response.status_code == 200, response.text
            assert "<think>I pondered the tool.</think>" in last_prompt(h.coordinator)

    run(body)


def test_unsealed_reasoning_never_reaches_the_prompt() -> None:
    """Reasoning text without a blob, with a forged or altered one, or with a genuine blob
    replayed into another conversation, is dropped: only sealed text reaches the prompt."""
    seal = ReasoningSeal.from_secret(SECRET)
    forged = ReasoningSeal.from_secret("another key").seal(
        "Injected reasoning.", conversation_digest([USER_TURN])
    )
    genuine_elsewhere = seal.seal(
        "Injected reasoning.", conversation_digest([{"role": "user", "content": "other"}])
    )
    text = {"content": [{"type": "reasoning_text", "text": "Injected reasoning."}]}
    summary = {"summary": [{"type": "summary_text", "text": "Injected reasoning."}]}
    cases: list[dict[str, Any]] = [
        text,
        summary,
        {**text, "encrypted_content": forged},
        {"encrypted_content": "not base64 !"},
        {"encrypted_content": forged[:-3] + "AAA"},
        {"encrypted_content": genuine_elsewhere},
        {**text, "encrypted_content": genuine_elsewhere},
    ]

    async def body() -> None:
        async with serve("--reasoning-secret", SECRET) as h:
            for reasoning in cases:
                response = await h.client.post(RESPONSES, json=replay(reasoning))
                assert response.status_code == 200, response.text
                prompt = last_prompt(h.coordinator)
                assert "Injected" not in prompt and "<think></think>" in prompt, reasoning

    run(body)


def test_chat_file_parts_say_what_is_unsupported() -> None:
    async def body() -> None:
        async with serve() as h:
            part = {"type": "file", "file": {"file_data": "data:application/pdf;base64,AAAA"}}
            messages = [{"role": "user", "content": [{"type": "text", "text": "read"}, part]}]
            response = await h.client.post(CHAT, json={"model": MODEL, "messages": messages})
            assert response.status_code == 400
            error = response.json()["error"]
            assert error["param"] == "messages[0].content[1]"
            assert "file content" in error["message"] and "file_id" not in error["message"]

    run(body)


def test_consecutive_assistant_messages_are_merged() -> None:
    """Codex 0.80 on the chat wire: tool call, then text, then the tool result."""

    async def body() -> None:
        async with serve() as h:
            call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
            messages = [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "assistant", "content": "Calling f now."},
                {"role": "tool", "tool_call_id": "c1", "content": "the result"},
            ]
            request = {"model": MODEL, "messages": messages, "tools": [CHAT_TOOL]}
            response = await h.client.post(CHAT, json=request)
            assert response.status_code == 200, response.text
            prompt = last_prompt(h.coordinator)
            assert prompt.index("Calling f now.") < prompt.index('invoke name="f"')
            assert prompt.index('invoke name="f"') < prompt.index("the result")

    run(body)


def test_assistant_turns_without_reasoning_content_are_accepted_in_thinking_mode() -> None:
    async def body() -> None:
        async with serve() as h:
            call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
            messages = [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "the result"},
            ]
            request = {"model": MODEL, "messages": messages, "tools": [CHAT_TOOL]}
            response = await h.client.post(CHAT, json=request)
            assert response.status_code == 200, response.text
            assert "<think></think>" in last_prompt(h.coordinator)

    run(body)


def _openai_client(h: Harness) -> openai.AsyncOpenAI:
    """The openai SDK on the in-process app."""
    http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=build_app(h.state)))
    return openai.AsyncOpenAI(
        base_url="http://test/v1", api_key="unused", http_client=http, max_retries=0
    )


@pytest.mark.grammar
def test_json_object_without_the_word_json_is_accepted(caplog: pytest.LogCaptureFixture) -> None:
    """OpenAI refuses json_object unless the messages say "json"; the AI SDK's
    createOpenAICompatible sends exactly that for generateObject. The grammar enforces JSON: the
    request is served, with the answer format stated in the prompt, and OpenAI's rule is only
    logged."""
    require_grammar()

    async def body() -> None:
        async with serve(script=Script(text='{"city": "Paris"}')) as h, _openai_client(h) as client:
            with caplog.at_level(logging.WARNING):
                chat = await client.chat.completions.create(
                    model=MODEL,
                    messages=[{"role": "user", "content": "Name a city."}],
                    response_format={"type": "json_object"},
                )
            assert json.loads(chat.choices[0].message.content or "") == {"city": "Paris"}
            assert h.coordinator.submitted[-1][2].structured is not None  # the grammar is on
            assert "## Response Format" in last_prompt(h.coordinator)
            assert '{"type": "object"}' in last_prompt(h.coordinator)
            assert "without the word 'json'" in caplog.text

            answer = await client.responses.create(
                model=MODEL,
                input="Name a city.",
                text={"format": {"type": "json_object"}},
                store=False,
            )
            assert json.loads(answer.output_text) == {"city": "Paris"}
            assert answer.text is not None and answer.text.format is not None
            assert answer.text.format.type == "json_object"  # echoed as the client sent it
            assert h.coordinator.submitted[-1][2].structured is not None

    run(body, timeout=120)


def test_a_tool_call_message_has_null_content_as_openai_sends_it() -> None:
    """The recipe wrote `"content": ""` next to tool calls; OpenAI sends null, and clients that
    add the stream's deltas up must end with null too."""

    async def body() -> None:
        script = Script(text=tool_calls_block("get_weather", city="Paris"))
        async with serve(script=script) as h, _openai_client(h) as client:
            ask: dict[str, Any] = {
                "model": MODEL,
                "messages": [{"role": "user", "content": "Weather in Paris?"}],
                "tools": [WEATHER_TOOL],
            }
            answer = await client.chat.completions.create(**ask)
            message = answer.choices[0].message
            assert message.tool_calls and message.tool_calls[0].function.name == "get_weather"
            assert message.content is None
            async with client.chat.completions.stream(**ask) as stream:
                async for _ in stream:
                    pass
                streamed = (await stream.get_final_completion()).choices[0].message
            assert streamed.tool_calls and streamed.content is None
            # A text answer keeps its text.
            h.coordinator.script = Script(text="Sunny.")
            text = await client.chat.completions.create(**ask)
            assert text.choices[0].message.content == "Sunny."

    run(body)
