"""Prompt-cache retention requests checked as Anthropic and OpenAI check them: Anthropic
`cache_control` breakpoints on tools, system and content blocks (`tool_result` content
included) take only `ephemeral` with a ttl of `5m` or `1h`, at most four, else a 400
`invalid_request_error` in Anthropic's words (on /v1/messages and its count_tokens); OpenAI's
`prompt_cache_retention` on Chat Completions and Responses takes `in_memory` or `24h` (a
response echoes it), else a 400 `invalid_value`."""

from __future__ import annotations

from typing import Any

import anthropic
import openai
import pytest

from tests.http.harness import MODEL, Harness, client_http, run, serve

EPHEMERAL: Any = {"type": "ephemeral"}
ENDS = ("response.created", "response.completed")


def _anthropic(h: Harness) -> anthropic.AsyncAnthropic:
    transport = client_http.ASGITransport(app=h.app)
    http = client_http.AsyncClient(transport=transport, base_url="http://test")
    return anthropic.AsyncAnthropic(
        base_url="http://test", api_key="unused", max_retries=0, http_client=http
    )


def _blocks(*markers: Any) -> Any:
    return [
        {"type": "text", "text": f"part {n}", "cache_control": m} for n, m in enumerate(markers)
    ]


def _request(system: Any, content: Any, tool_marker: Any = None) -> Any:
    tool: Any = {"name": "lookup", "input_schema": {"type": "object", "properties": {}}}
    if tool_marker is not None:
        tool["cache_control"] = tool_marker
    return {
        "model": MODEL,
        "system": system,
        "tools": [tool],
        "messages": [{"role": "user", "content": content}],
    }


def test_four_breakpoints_of_either_ttl_are_accepted() -> None:
    async def test() -> None:
        async with serve() as h:
            client = _anthropic(h)
            body = _request(
                _blocks({"type": "ephemeral", "ttl": "1h"}),
                _blocks(EPHEMERAL, {"type": "ephemeral", "ttl": "5m"}),
                tool_marker={"type": "ephemeral", "ttl": "1h"},
            )
            message = await client.messages.create(max_tokens=16, **body)
            assert message.stop_reason == "end_turn"
            counted = await client.messages.count_tokens(**body)
            assert counted.input_tokens > 0

    run(test)


REFUSED: list[tuple[Any, str]] = [
    (
        _request(_blocks({"type": "persistent"}), "hi"),
        "system.0.cache_control: Input tag 'persistent' found using 'type' does not match any "
        "of the expected tags: 'ephemeral'",
    ),
    (
        _request("Be brief.", _blocks({"type": "ephemeral", "ttl": "2h"})),
        "messages.0.content.0.text.cache_control.ephemeral.ttl: Input should be '5m' or '1h'",
    ),
    (
        _request(
            "Be brief.",
            [
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_1",
                    "content": _blocks({"type": "ephemeral", "ttl": 300}),
                }
            ],
        ),
        "messages.0.content.0.tool_result.content.0.text.cache_control.ephemeral.ttl: Input "
        "should be '5m' or '1h'",
    ),
    (
        _request(_blocks(EPHEMERAL, EPHEMERAL), _blocks(EPHEMERAL, EPHEMERAL), EPHEMERAL),
        "A maximum of 4 blocks with cache_control may be provided. Found 5.",
    ),
]


@pytest.mark.parametrize(("body", "message"), REFUSED)
def test_anthropic_refuses_what_anthropic_refuses(body: Any, message: str) -> None:
    async def test() -> None:
        async with serve() as h:
            client = _anthropic(h)
            with pytest.raises(anthropic.BadRequestError) as refused:
                await client.messages.create(max_tokens=16, **body)
            error: Any = refused.value.body
            assert error["error"] == {"type": "invalid_request_error", "message": message}
            with pytest.raises(anthropic.BadRequestError, match="cache_control"):
                await client.messages.count_tokens(**body)
            assert h.coordinator.submitted == []

    run(test)


@pytest.mark.parametrize("retention", ["in_memory", "24h", None])
def test_openai_prompt_cache_retention_is_accepted(retention: Any) -> None:
    async def test() -> None:
        async with serve() as h, h.openai() as client:
            messages: Any = [{"role": "user", "content": "hi"}]
            chat = await client.chat.completions.create(
                model=MODEL, messages=messages, prompt_cache_retention=retention
            )
            assert chat.choices[0].finish_reason == "stop"
            response = await client.responses.create(
                model=MODEL, input="hi", prompt_cache_retention=retention
            )
            assert response.status == "completed"
            assert response.prompt_cache_retention == retention  # echoed as OpenAI does
            events = await client.responses.create(
                model=MODEL, input="hi", prompt_cache_retention=retention, stream=True
            )
            echoed = [e.response.prompt_cache_retention async for e in events if e.type in ENDS]
            assert echoed == [retention, retention]

    run(test)


@pytest.mark.parametrize("retention", ["1h", "in-memory", 24])
def test_openai_refuses_another_retention_in_its_shape(retention: Any) -> None:
    async def test() -> None:
        async with serve() as h, h.openai() as client:
            shown = f"'{retention}'" if isinstance(retention, str) else str(retention)
            message = f"Invalid value: {shown}. Supported values are: 'in_memory' and '24h'."
            extra = {"prompt_cache_retention": retention}
            with pytest.raises(openai.BadRequestError) as chat:
                await client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "hi"}], extra_body=extra
                )
            with pytest.raises(openai.BadRequestError) as responses:
                await client.responses.create(model=MODEL, input="hi", extra_body=extra)
            for refused in (chat.value, responses.value):
                assert refused.code == "invalid_value"
                assert refused.param == "prompt_cache_retention"
                assert refused.message.endswith(message)
            assert h.coordinator.submitted == []

    run(test)
