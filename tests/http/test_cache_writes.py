"""The prompt tokens the engine writes to its cache for a request that asked for retention:
`cache_control`'s longest ttl and `prompt_cache_retention` reach the engine as
`retention_seconds`, Messages reports the written tokens beyond those read as
`cache_creation_input_tokens` (out of `input_tokens`: input + creation + read is the prompt)
and Responses as `input_tokens_details.cache_write_tokens`; without retention both are 0."""

from __future__ import annotations

from typing import Any

import pytest

from tests.http.harness import MODEL, Script, run, serve
from tests.http.test_cached_usage import CACHED, THINKING, _anthropic, _openai, _prompt_tokens

SYSTEM: Any = [{"type": "text", "text": "Be terse.", "cache_control": {"type": "ephemeral"}}]
HELLO: Any = [{"role": "user", "content": "hello"}]


@pytest.mark.parametrize("ttl, seconds", [(None, 300), ("1h", 3600)])
def test_messages_report_the_written_prompt_as_created(ttl: str | None, seconds: int) -> None:
    async def body() -> None:
        async with serve(script=Script(text="Hi.", cached_tokens=CACHED, writes=True)) as h:
            client = _anthropic(h)
            marker: Any = {"type": "ephemeral", **({"ttl": ttl} if ttl else {})}
            system = [{"type": "text", "text": "Be terse.", "cache_control": marker}]
            message = await client.messages.create(
                model=MODEL, max_tokens=64, system=system, messages=HELLO, thinking=THINKING
            )
            prompt = _prompt_tokens(h)
            assert h.coordinator.submitted[-1][2].retention_seconds == seconds
            usage = message.usage
            assert usage.cache_read_input_tokens == CACHED
            assert usage.cache_creation_input_tokens == prompt - CACHED
            assert usage.input_tokens == 0  # the whole prompt is written
            assert usage.cache_creation is not None
            by_ttl = usage.cache_creation
            hour = by_ttl.ephemeral_1h_input_tokens
            assert (by_ttl.ephemeral_5m_input_tokens, hour) == (
                (0, prompt - CACHED) if ttl == "1h" else (prompt - CACHED, 0)
            )
            async with client.messages.stream(
                model=MODEL, max_tokens=64, system=system, messages=HELLO, thinking=THINKING
            ) as stream:
                events = [event async for event in stream]
            start = next(e for e in events if e.type == "message_start").message.usage
            assert start.cache_creation_input_tokens == prompt - CACHED
            assert start.input_tokens + start.cache_creation_input_tokens + CACHED == prompt
            delta = next(e for e in events if e.type == "message_delta").usage
            assert delta.cache_creation_input_tokens == prompt - CACHED

    run(body)


def test_messages_without_a_breakpoint_create_nothing() -> None:
    async def body() -> None:
        async with serve(script=Script(text="Hi.", cached_tokens=CACHED, writes=True)) as h:
            message = await _anthropic(h).messages.create(
                model=MODEL, max_tokens=64, messages=HELLO, thinking=THINKING
            )
            assert h.coordinator.submitted[-1][2].retention_seconds == 0
            assert message.usage.cache_creation_input_tokens == 0
            assert message.usage.input_tokens == _prompt_tokens(h) - CACHED

    run(body)


@pytest.mark.parametrize("retention, seconds", [("24h", 86400), ("in_memory", 600), (None, 0)])
def test_responses_report_the_written_prompt(retention: Any, seconds: int) -> None:
    async def body() -> None:
        async with serve(script=Script(text="Hi.", cached_tokens=CACHED, writes=True)) as h:
            client = _openai(h)
            response = await client.responses.create(
                model=MODEL, input="hello", prompt_cache_retention=retention
            )
            assert h.coordinator.submitted[-1][2].retention_seconds == seconds
            written = _prompt_tokens(h) - CACHED if seconds else 0
            assert response.usage is not None
            assert response.usage.input_tokens_details.cache_write_tokens == written
            assert response.usage.input_tokens == _prompt_tokens(h)
            events = await client.responses.create(
                model=MODEL, input="hello", prompt_cache_retention=retention, stream=True
            )
            ends = [e async for e in events if e.type == "response.completed"]
            assert ends[0].response.usage is not None
            assert ends[0].response.usage.input_tokens_details.cache_write_tokens == written

    run(body)


def test_chat_hands_the_retention_to_the_engine() -> None:
    async def body() -> None:
        async with serve(script=Script(text="Hi.")) as h:
            await _openai(h).chat.completions.create(
                model=MODEL, messages=HELLO, prompt_cache_retention="24h"
            )
            assert h.coordinator.submitted[-1][2].retention_seconds == 86400

    run(body)
