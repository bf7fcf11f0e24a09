"""What Anthropic clients (Claude Code, the SDK, LiteLLM's anthropic/ route) need of
/v1/messages, /v1/messages/count_tokens and /v1/models."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx2
import pytest
from anthropic.lib.tools import beta_async_tool

from deepinfer_server.api.app import build_app
from tests.dsml import tool_calls_block
from tests.http.agent_harness import last_prompt
from tests.http.harness import MODEL, Harness, Script, run, serve

MESSAGES = "/v1/messages"
COUNT = "/v1/messages/count_tokens"
ANTHROPIC = {"anthropic-version": "2023-06-01"}
WEATHER = {
    "name": "get_weather",
    "description": "Current weather of a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}


def messages_body(**extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "max_tokens": 64,
        "messages": [{"role": "user", "content": "hi"}],
        **extra,
    }


def test_context_overflow_speaks_anthropics_words() -> None:
    """Claude Code retries with a smaller max_tokens only on Anthropic's wording."""

    async def body() -> None:
        async with serve("--no-clamp-max-tokens") as h:  # 4096-token context, strict
            response = await h.client.post(MESSAGES, json=messages_body(max_tokens=4094))
            assert response.status_code == 400
            error = response.json()["error"]
            assert error["type"] == "invalid_request_error"
            prompt = error["message"].split(": ", 1)[1].split(" + ")[0]
            assert error["message"] == (
                f"input length and `max_tokens` exceed context limit: {prompt} + 4094 > 4096, "
                "decrease input length or `max_tokens` and try again"
            )
            long = messages_body(messages=[{"role": "user", "content": "word " * 5000}])
            response = await h.client.post(MESSAGES, json=long)
            assert response.status_code == 400
            assert response.json()["error"]["message"].startswith("prompt is too long: ")
            assert response.json()["error"]["message"].endswith(" tokens > 4096 maximum")
            assert not h.coordinator.submitted

    run(body)


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"system": [{"type": "text", "text": "You are terse."}], "tools": [WEATHER]},
        {"thinking": {"type": "disabled"}},
        {"thinking": {"type": "adaptive"}, "output_config": {"effort": "high"}},
    ],
    ids=["bare", "system-and-tools", "no-thinking", "adaptive"],
)
def test_count_tokens_counts_what_messages_encodes(extra: dict[str, Any]) -> None:
    async def body() -> None:
        async with serve() as h:
            request = messages_body(**extra)
            answer = await h.client.post(MESSAGES, json=request)
            assert answer.status_code == 200, answer.text
            del request["max_tokens"]  # count_tokens bodies have none
            counted = await h.client.post(f"{COUNT}?beta=true", json=request, headers=ANTHROPIC)
            assert counted.status_code == 200, counted.text
            assert counted.json() == {"input_tokens": len(h.coordinator.submitted[-1][1])}
            assert len(h.coordinator.submitted) == 1  # counting runs nothing

    run(body)


def test_count_tokens_errors_are_anthropics() -> None:
    async def body() -> None:
        async with serve() as h:
            unknown = await h.client.post(COUNT, json={**messages_body(), "model": "nope"})
            assert unknown.status_code == 404
            assert unknown.json()["type"] == "error"
            assert unknown.json()["error"]["type"] == "not_found_error"
            bad = await h.client.post(
                COUNT, content=b"{", headers={"content-type": "application/json"}
            )
            assert bad.status_code == 400 and bad.json()["type"] == "error"

    run(body)


def test_model_retrieve_in_each_protocols_shape() -> None:
    async def body() -> None:
        async with serve("--served-model-name", MODEL, "other/name") as h:
            openai = (await h.client.get(f"/v1/models/{MODEL}")).json()
            assert openai["id"] == MODEL and openai["object"] == "model"
            assert (await h.client.get("/v1/models/other/name")).json()["id"] == "other/name"
            claude = (await h.client.get(f"/v1/models/{MODEL}", headers=ANTHROPIC)).json()
            assert claude.keys() == {
                *("type", "id", "display_name", "created_at"),
                *("max_input_tokens", "max_tokens", "max_model_len"),
            }
            assert claude["type"] == "model" and claude["id"] == MODEL
            assert claude["created_at"].endswith("Z")
            listed = (await h.client.get("/v1/models", headers=ANTHROPIC)).json()
            assert [m["id"] for m in listed["data"]] == [MODEL, "other/name"]
            assert listed["has_more"] is False
            assert (listed["first_id"], listed["last_id"]) == (MODEL, "other/name")

            missing = await h.client.get("/v1/models/nope")
            assert missing.status_code == 404
            assert missing.json()["error"]["code"] == "model_not_found"
            missing = await h.client.get("/v1/models/nope", headers=ANTHROPIC)
            assert missing.status_code == 404
            assert missing.json()["error"]["type"] == "not_found_error"

    run(body)


@pytest.mark.parametrize(
    ("tool", "name", "in_prompt"),
    [
        ({**WEATHER, "type": "custom"}, "get_weather", '"city"'),
        ({"type": "bash_20250124", "name": "bash"}, "bash", '"restart"'),
        (
            {"type": "text_editor_20250728", "name": "str_replace_based_edit_tool"},
            "str_replace_based_edit_tool",
            '"old_str"',
        ),
    ],
    ids=["custom", "bash", "text-editor"],
)
def test_client_tool_types_become_function_tools(
    tool: dict[str, Any], name: str, in_prompt: str
) -> None:
    async def body() -> None:
        async with serve() as h:
            response = await h.client.post(MESSAGES, json=messages_body(tools=[tool]))
            assert response.status_code == 200, response.text
            prompt = last_prompt(h.coordinator)
            assert f'"name": "{name}"' in prompt and in_prompt in prompt

    run(body)


def test_server_tools_stay_rejected() -> None:
    async def body() -> None:
        async with serve() as h:
            tool = {"type": "web_search_20250305", "name": "web_search"}
            response = await h.client.post(MESSAGES, json=messages_body(tools=[tool]))
            assert response.status_code == 400
            assert "server tools" in response.json()["error"]["message"]

    run(body)


def test_redacted_thinking_is_dropped() -> None:
    async def body() -> None:
        async with serve() as h:
            history = [
                {"role": "user", "content": "hi"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "redacted_thinking", "data": "SECRETBLOB"},
                        {"type": "text", "text": "earlier answer"},
                    ],
                },
                {"role": "user", "content": "again"},
            ]
            response = await h.client.post(MESSAGES, json=messages_body(messages=history))
            assert response.status_code == 200, response.text
            prompt = last_prompt(h.coordinator)
            assert "earlier answer" in prompt and "SECRETBLOB" not in prompt

            history[1]["content"] = [{"type": "redacted_thinking", "data": "SECRETBLOB"}]
            response = await h.client.post(MESSAGES, json=messages_body(messages=history))
            assert response.status_code == 200, response.text
            assert "SECRETBLOB" not in last_prompt(h.coordinator)

    run(body)


def _sdk_client(h: Harness, sent: list[tuple[dict[str, Any], int, dict[str, Any]]]) -> Any:
    """The anthropic SDK on the in-process app; `sent` gets (request body, status, answer)."""

    async def record(response: httpx2.Response) -> None:
        await response.aread()
        answer = json.loads(response.text) if response.status_code != 200 else {}
        sent.append((json.loads(response.request.content), response.status_code, answer))

    transport = httpx2.ASGITransport(app=build_app(h.state))
    http = httpx2.AsyncClient(transport=transport, event_hooks={"response": [record]})
    return anthropic.AsyncAnthropic(
        base_url="http://test", api_key="unused", http_client=http, max_retries=0
    )


def test_the_sdks_tool_runner_falls_back_from_threads_and_completes_the_loop() -> None:
    """`beta.messages.tool_runner` threads by default (turn 2 would send only the tool result);
    a `thread` is refused with the code on which it resends the whole conversation."""
    calls: list[str] = []

    async def body() -> None:
        async with serve(script=Script(text=tool_calls_block("get_weather", city="Paris"))) as h:

            @beta_async_tool
            async def get_weather(city: str) -> str:
                """Current weather of a city."""
                calls.append(city)
                h.coordinator.script = Script(text="It is sunny in Paris.")
                return "sunny"

            sent: list[tuple[dict[str, Any], int, dict[str, Any]]] = []
            async with _sdk_client(h, sent) as client:
                runner = client.beta.messages.tool_runner(
                    model=MODEL,
                    max_tokens=256,
                    messages=[{"role": "user", "content": "Weather in Paris?"}],
                    tools=[get_weather],
                )
                final = await runner.until_done()
            assert calls == ["Paris"]
            assert [b.text for b in final.content if b.type == "text"] == ["It is sunny in Paris."]
            (refused, status, answer), *rest = sent
            assert refused["thread"] == {"type": "create"} and status == 400
            assert answer["error"]["type"] == "invalid_request_error"
            assert answer["error"]["details"] == {"error_code": "thread_unsupported_request"}
            # Then unthreaded: turn 1 again, turn 2 with the whole conversation.
            assert [(len(b["messages"]), "thread" in b, s) for b, s, _ in rest] == [
                (1, False, 200),
                (3, False, 200),
            ]
            assert not h.coordinator.handles

    run(body)


def test_any_thread_is_refused_with_the_sdks_code() -> None:
    async def body() -> None:
        async with serve() as h:
            thread = {"type": "continue", "previous_message_id": "msg_1"}
            for path in (MESSAGES, COUNT):
                response = await h.client.post(path, json=messages_body(thread=thread))
                assert response.status_code == 400, response.text
                error = response.json()["error"]
                assert error["details"] == {"error_code": "thread_unsupported_request"}
                assert "thread" in error["message"]
            unthreaded = await h.client.post(MESSAGES, json=messages_body(thread=None))
            assert unthreaded.status_code == 200, unthreaded.text
            assert len(h.coordinator.submitted) == 1

    run(body)


def test_no_thinking_block_unless_the_request_enables_thinking() -> None:
    """Anthropic's semantics: a request without `thinking` gets the non-thinking prompt and no
    thinking block, so the quickstart's `content[0].text` is the answer; `enabled` and
    `adaptive` think and show it, whatever `--default-thinking` says."""

    async def body() -> None:
        async with serve("--default-thinking", "enabled") as h:
            sent: list[tuple[dict[str, Any], int, dict[str, Any]]] = []
            async with _sdk_client(h, sent) as client:
                request = {
                    "model": MODEL,
                    "max_tokens": 64,
                    "messages": [{"role": "user", "content": "hi"}],
                }
                message = await client.messages.create(**request)
                assert message.content[0].text == "Hello from the fake engine"
                assert [block.type for block in message.content] == ["text"]
                prompt = last_prompt(h.coordinator)
                assert (
                    prompt.endswith("<｜Assistant｜></think>") and "Reasoning Effort" not in prompt
                )

                async with client.messages.stream(**request) as stream:
                    streamed = await stream.get_final_message()
                assert [block.type for block in streamed.content] == ["text"]

                for thinking in ({"type": "enabled", "budget_tokens": 1024}, {"type": "adaptive"}):
                    message = await client.messages.create(**request, thinking=thinking)
                    assert [block.type for block in message.content] == ["thinking", "text"]
                    assert last_prompt(h.coordinator).endswith("<｜Assistant｜><think>")
            assert all(status == 200 for _, status, _ in sent)

    run(body)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"output_config": {"effort": "low"}}, "thinking is off for this request"),
        (
            {"thinking": {"type": "disabled"}, "output_config": {"effort": "max"}},
            "thinking is off for this request",
        ),
        (
            {"thinking": {"type": "adaptive"}, "output_config": {"effort": "none"}},
            "'none' turns thinking off",
        ),
        ({"thinking": {"type": "adaptive"}, "output_config": {"effort": "extreme"}}, "one of"),
    ],
    ids=[
        "effort-without-thinking",
        "effort-with-thinking-disabled",
        "none-with-adaptive",
        "unknown",
    ],
)
def test_an_effort_that_cannot_apply_is_refused(extra: dict[str, Any], message: str) -> None:
    async def body() -> None:
        async with serve() as h:
            for path in (MESSAGES, COUNT):
                response = await h.client.post(path, json=messages_body(**extra))
                assert response.status_code == 400, response.text
                assert response.json()["type"] == "error"
                error = response.json()["error"]
                assert error["type"] == "invalid_request_error" and message in error["message"]
            assert not h.coordinator.submitted

    run(body)
