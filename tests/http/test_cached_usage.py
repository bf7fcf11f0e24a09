"""Prompt tokens reused from the prefix cache, in every protocol's usage as the official clients
read it (Chat and legacy completions `prompt_tokens_details.cached_tokens`, Responses
`input_tokens_details.cached_tokens`, Anthropic `cache_read_input_tokens` with `input_tokens`
the rest), streamed and not, zero without reuse; Anthropic `cache_control` breakpoints (at
most four, as Anthropic allows) are accepted on every kind of block (what they write:
test_cache_writes.py)."""

from __future__ import annotations

from typing import Any

import anthropic
import httpx2
import openai
import pytest

from tests.http.harness import MODEL, Harness, Script, run, serve

CACHED = 20  # below every prompt here (about 30 tokens)
#: Messages think only when asked; thinking's prompt is the one longer than CACHED.
THINKING: Any = {"type": "adaptive"}
NO_THINKING = {"thinking": {"type": "disabled"}}


def _http_client(h: Harness) -> httpx2.AsyncClient:
    """The official SDKs run on httpx2 (a fork of httpx): a client of it over the same app."""
    transport = httpx2.ASGITransport(app=h.client._transport.app)  # type: ignore[attr-defined]
    return httpx2.AsyncClient(transport=transport, base_url="http://test")


def _openai(h: Harness) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url="http://test/v1", api_key="unused", http_client=_http_client(h)
    )


def _anthropic(h: Harness) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(
        base_url="http://test", api_key="unused", http_client=_http_client(h)
    )


def _prompt_tokens(h: Harness) -> int:
    return len(h.coordinator.submitted[-1][1])


@pytest.mark.parametrize("cached", [CACHED, 0])
def test_chat_usage_reports_the_cached_prompt_tokens(cached: int) -> None:
    async def body() -> None:
        async with serve(script=Script(text="Hi.", cached_tokens=cached)) as h:
            client = _openai(h)
            messages: Any = [{"role": "user", "content": "hello"}]
            response = await client.chat.completions.create(model=MODEL, messages=messages)
            usage = response.usage
            assert usage is not None and usage.prompt_tokens_details is not None
            assert usage.prompt_tokens_details.cached_tokens == cached
            assert usage.prompt_tokens == _prompt_tokens(h)
            stream = await client.chat.completions.create(
                model=MODEL, messages=messages, stream=True, stream_options={"include_usage": True}
            )
            chunks = [chunk async for chunk in stream]
            final = chunks[-1].usage
            assert final is not None and final.prompt_tokens_details is not None
            assert final.prompt_tokens_details.cached_tokens == cached

    run(body)


def test_responses_usage_reports_the_cached_input_tokens() -> None:
    async def body() -> None:
        async with serve(script=Script(text="Hi.", cached_tokens=CACHED)) as h:
            client = _openai(h)
            response = await client.responses.create(model=MODEL, input="hello")
            assert response.usage is not None
            assert response.usage.input_tokens_details.cached_tokens == CACHED
            assert response.usage.input_tokens == _prompt_tokens(h)
            events = [
                event
                async for event in await client.responses.create(
                    model=MODEL, input="hello", stream=True
                )
            ]
            completed = [e for e in events if e.type == "response.completed"]
            assert len(completed) == 1 and completed[0].response.usage is not None
            assert completed[0].response.usage.input_tokens_details.cached_tokens == CACHED

    run(body)


def test_anthropic_usage_reads_the_cached_tokens_and_counts_the_rest_as_input() -> None:
    async def body() -> None:
        async with serve(script=Script(text="Hi.", cached_tokens=CACHED)) as h:
            client = _anthropic(h)
            message = await client.messages.create(
                model=MODEL,
                max_tokens=64,
                messages=[{"role": "user", "content": "hello"}],
                thinking=THINKING,
            )
            prompt = _prompt_tokens(h)
            assert message.usage.cache_read_input_tokens == CACHED
            assert message.usage.input_tokens == prompt - CACHED
            assert message.usage.cache_creation_input_tokens == 0
            async with client.messages.stream(
                model=MODEL,
                max_tokens=64,
                messages=[{"role": "user", "content": "hello"}],
                thinking=THINKING,
            ) as stream:
                events = [event async for event in stream]
            start = next(e for e in events if e.type == "message_start")
            assert start.message.usage.cache_read_input_tokens == CACHED
            assert start.message.usage.input_tokens == prompt - CACHED
            delta = next(e for e in events if e.type == "message_delta")
            assert delta.usage.cache_read_input_tokens == CACHED

    run(body)


def test_anthropic_cache_control_breakpoints_are_accepted_on_every_kind_of_block() -> None:
    async def body() -> None:
        async with serve(script=Script(text="Hi.", cached_tokens=CACHED)) as h:
            ephemeral: Any = {"type": "ephemeral"}
            message = await _anthropic(h).messages.create(
                model=MODEL,
                max_tokens=64,
                system=[{"type": "text", "text": "Be terse.", "cache_control": ephemeral}],
                tools=[
                    {
                        "name": "get_weather",
                        "description": "Current weather of a city",
                        "input_schema": {"type": "object", "properties": {}},
                        "cache_control": {"type": "ephemeral", "ttl": "1h"},
                    }
                ],
                messages=[
                    {
                        "role": "user",
                        "content": [{"type": "text", "text": "hello", "cache_control": ephemeral}],
                    },
                    {
                        "role": "assistant",
                        "content": [
                            {
                                "type": "tool_use",
                                "id": "toolu_1",
                                "name": "get_weather",
                                "input": {},
                            }
                        ],
                    },
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "tool_result",
                                "tool_use_id": "toolu_1",
                                "content": "Sunny.",
                                "cache_control": ephemeral,
                            }
                        ],
                    },
                ],
            )
            assert message.content[-1].type == "text" and message.content[-1].text == "Hi."
            assert message.usage.cache_read_input_tokens == CACHED

    run(body)


def test_legacy_completions_usage_reports_the_cached_prompt_tokens() -> None:
    async def body() -> None:
        async with serve(script=Script(text="Hi.", cached_tokens=CACHED)) as h:
            client = _openai(h)
            completion = await client.completions.create(model=MODEL, prompt="hello", max_tokens=8)
            usage = completion.usage
            assert usage is not None and usage.prompt_tokens_details is not None
            assert usage.prompt_tokens_details.cached_tokens == CACHED
            stream = await client.completions.create(
                model=MODEL,
                prompt="hello",
                max_tokens=8,
                stream=True,
                stream_options={"include_usage": True},
            )
            chunks = [chunk async for chunk in stream]
            final = chunks[-1].usage
            assert final is not None and final.prompt_tokens_details is not None
            assert final.prompt_tokens_details.cached_tokens == CACHED

    run(body)
