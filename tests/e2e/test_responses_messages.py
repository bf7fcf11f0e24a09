"""The Responses API (official openai client) and the Messages API (official anthropic client)
against a live DP=2 server on the simulated engine."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from tests.conftest import MODEL
from tests.dsml import tool_calls_block
from tests.metrics_scrape import scrape, value
from tests.server import LiveServer, wait_until

REASONING = "The user wants their last message repeated back to them."
WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
}


@pytest.fixture()
def claude(shared_server: LiveServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=shared_server.base_url, api_key="unused", max_retries=0)


def _named_events(response: httpx.Response) -> Iterator[tuple[str, dict[str, object]]]:
    return _named_events_from(response.iter_lines())


def _named_events_from(lines: Iterable[str]) -> Iterator[tuple[str, dict[str, object]]]:
    event = ""
    for line in lines:
        if line.startswith("event: "):
            event = line[7:]
        elif line.startswith("data: "):
            yield event, json.loads(line[6:])


# Responses


def test_responses_text_with_reasoning(client: openai.OpenAI) -> None:
    response = client.responses.create(model=MODEL, input="Hello there", instructions="Be brief.")
    assert response.id.startswith("resp_")
    assert response.status == "completed"
    assert response.output_text == "Hello there"
    kinds = [item.type for item in response.output]
    assert kinds == ["reasoning", "message"]
    assert response.instructions == "Be brief."
    assert response.usage is not None and response.usage.output_tokens > 0
    assert response.usage.input_tokens > 0


def test_responses_stream_named_events_without_done(shared_server: LiveServer) -> None:
    body = {
        "model": MODEL,
        "input": "Streaming works.",
        "stream": True,
        "reasoning": {"effort": "high"},
    }
    with httpx.stream(
        "POST", shared_server.base_url + "/v1/responses", json=body, timeout=30
    ) as stream:
        lines = list(stream.iter_lines())
    raw_done = any("[DONE]" in line for line in lines)
    events = list(_named_events_from(lines))
    names = [name for name, _ in events]
    assert names[0] == "response.created" and names[-1] == "response.completed"
    assert all(name == payload["type"] for name, payload in events)
    text = "".join(str(p["delta"]) for n, p in events if n == "response.output_text.delta")
    assert text == "Streaming works."
    assert not raw_done


def test_responses_stream_with_the_client(client: openai.OpenAI) -> None:
    stream = client.responses.create(model=MODEL, input="Client stream.", stream=True)
    events = list(stream)
    assert events[-1].type == "response.completed"
    assert (
        "".join(e.delta for e in events if e.type == "response.output_text.delta")
        == "Client stream."
    )
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert reasoning == REASONING


def test_responses_max_output_tokens(client: openai.OpenAI) -> None:
    response = client.responses.create(
        model=MODEL, input="one two three four five six seven", max_output_tokens=3
    )
    assert response.status == "incomplete"
    assert response.usage is not None and response.usage.output_tokens == 3


def test_responses_function_tool_round_trip(client: openai.OpenAI) -> None:
    tools = [
        {
            "type": "function",
            "name": "get_weather",
            "description": "Weather of a city",
            "parameters": WEATHER_SCHEMA,
        }
    ]
    first = client.responses.create(
        model=MODEL,
        input=tool_calls_block("get_weather", city="Paris"),
        tools=tools,  # type: ignore[arg-type]
    )
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1
    call = calls[0]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    second = client.responses.create(
        model=MODEL,
        tools=tools,  # type: ignore[arg-type]
        input=[
            {"role": "user", "content": "Weather in Paris?"},
            *[item.model_dump(exclude_none=True) for item in first.output],  # type: ignore[misc]
            {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"},
        ],
    )
    assert "sunny" in second.output_text


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"previous_response_id": "resp_123"}, "previous_response_id"),
        ({"background": True, "store": False}, "store"),
    ],
)
def test_responses_unknown_previous_response_and_unstored_background_are_400(
    client: openai.OpenAI, extra: dict[str, object], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as excinfo:
        client.responses.create(model=MODEL, input="hi", **extra)  # type: ignore[arg-type]
    assert excinfo.value.body["param"] == param  # type: ignore[index]


def test_responses_unknown_model_is_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="gpt-5", input="hi")


# Messages


def test_messages_text_and_thinking(claude: anthropic.Anthropic) -> None:
    message = claude.messages.create(
        model=MODEL,
        max_tokens=256,
        messages=[{"role": "user", "content": "Hello there"}],
        thinking={"type": "enabled", "budget_tokens": 128},
    )
    assert message.id.startswith("msg_")
    assert [block.type for block in message.content] == ["thinking", "text"]
    assert message.content[0].thinking == REASONING  # type: ignore[union-attr]
    assert message.content[1].text == "Hello there"  # type: ignore[union-attr]
    assert message.stop_reason == "end_turn"
    assert message.usage.input_tokens > 0 and message.usage.output_tokens > 0


def test_messages_stream_events(claude: anthropic.Anthropic) -> None:
    with claude.messages.stream(
        model=MODEL,
        max_tokens=256,
        messages=[{"role": "user", "content": "Streamed answer"}],
    ) as stream:
        events = list(stream)
        final = stream.get_final_message()
    types = {event.type for event in events}
    assert {
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    } <= types
    assert final.content[-1].text == "Streamed answer"  # type: ignore[union-attr]


def test_messages_stop_sequences_and_max_tokens(claude: anthropic.Anthropic) -> None:
    stopped = claude.messages.create(
        model=MODEL,
        max_tokens=256,
        stop_sequences=["gamma"],
        messages=[{"role": "user", "content": "alpha beta gamma delta"}],
    )
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == "gamma"
    assert stopped.content[-1].text == "alpha beta "  # type: ignore[union-attr]
    capped = claude.messages.create(
        model=MODEL,
        max_tokens=3,
        messages=[{"role": "user", "content": "a b c d e f g h"}],
    )
    assert capped.stop_reason == "max_tokens" and capped.usage.output_tokens == 3


def test_messages_tool_use_round_trip(claude: anthropic.Anthropic) -> None:
    tools = [
        {"name": "get_weather", "description": "Weather of a city", "input_schema": WEATHER_SCHEMA}
    ]
    first = claude.messages.create(
        model=MODEL,
        max_tokens=256,
        tools=tools,  # type: ignore[arg-type]
        messages=[{"role": "user", "content": tool_calls_block("get_weather", city="Oslo")}],
    )
    assert first.stop_reason == "tool_use"
    uses = [block for block in first.content if block.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "get_weather" and uses[0].input == {"city": "Oslo"}
    second = claude.messages.create(
        model=MODEL,
        max_tokens=256,
        tools=tools,  # type: ignore[arg-type]
        messages=[
            {"role": "user", "content": "Weather in Oslo?"},
            {
                "role": "assistant",
                "content": [b.model_dump(exclude_none=True) for b in first.content],
            },  # type: ignore[misc]
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": uses[0].id, "content": "snowing"}
                ],
            },
        ],
    )
    assert "snowing" in second.content[-1].text  # type: ignore[union-attr]


def test_messages_errors_use_anthropics_shape(
    shared_server: LiveServer, claude: anthropic.Anthropic
) -> None:
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.create(
            model="claude-x", max_tokens=8, messages=[{"role": "user", "content": "hi"}]
        )
    raw = httpx.post(
        shared_server.base_url + "/v1/messages",
        json={"model": MODEL, "max_tokens": 8, "messages": []},
        timeout=30,
    )
    assert raw.status_code == 400
    body = raw.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert set(body["error"]) == {"type", "message"}
    malformed = httpx.post(
        shared_server.base_url + "/v1/messages",
        content=b"{",
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert malformed.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("path", ["/v1/responses", "/v1/messages"])
def test_disconnect_aborts_the_engine_request(shared_server: LiveServer, path: str) -> None:
    body: dict[str, object] = {"model": MODEL, "stream": True}
    if path == "/v1/responses":
        body.update(input="again " * 5, max_output_tokens=3000)
    else:
        body.update(messages=[{"role": "user", "content": "again " * 5}], max_tokens=3000)
    request_id = f"disconnect-{path.rsplit('/', 1)[-1]}"
    before = scrape(shared_server.base_url)
    with httpx.stream(
        "POST",
        shared_server.base_url + path,
        json=body,
        headers={"X-Request-Id": request_id},
        timeout=30,
    ) as stream:
        events = _named_events(stream)
        next(events), next(events), next(events)
    # Counted once the server has noticed the closed connection and the request's stream task
    # has aborted the engine request.

    def counted() -> float:
        after = scrape(shared_server.base_url)
        return value(after, "deepinfer:request_abort_total", reason="disconnect") - value(
            before, "deepinfer:request_abort_total", reason="disconnect"
        )

    wait_until(lambda: counted() >= 1, 30, "the disconnect counted")
    assert counted() == 1


def test_api_key_via_x_api_key_for_messages(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("team-b secret-2-from-file max_running=2\n")
    args = ("--api-key", "secret-1", "--api-key-file", str(keys), "--log-level", "debug")
    with LiveServer(*args) as server:
        good = anthropic.Anthropic(base_url=server.base_url, api_key="secret-1", max_retries=0)
        reply = good.messages.create(
            model=MODEL, max_tokens=16, messages=[{"role": "user", "content": "keyed"}]
        )
        assert reply.content[-1].text == "keyed"  # type: ignore[union-attr]
        named = anthropic.Anthropic(
            base_url=server.base_url, api_key="secret-2-from-file", max_retries=0
        )
        reply = named.messages.create(
            model=MODEL, max_tokens=16, messages=[{"role": "user", "content": "named"}]
        )
        assert reply.content[-1].text == "named"  # type: ignore[union-attr]
        server.wait_for_line("tenant=team-b", timeout=10)
        bad = anthropic.Anthropic(base_url=server.base_url, api_key="nope", max_retries=0)
        with pytest.raises(anthropic.AuthenticationError) as excinfo:
            bad.messages.create(
                model=MODEL, max_tokens=16, messages=[{"role": "user", "content": "x"}]
            )
        assert excinfo.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    # No key is in any line of the whole run, start-up, ranks and shutdown included.
    assert "secret-1" not in server.log
    assert "secret-2" not in server.log
