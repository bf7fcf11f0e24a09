"""The session each API's request names reaches the rank choice, in process: `prompt_cache_key`
on Chat, Completions and Responses (the openai client's own argument), the session headers,
Messages' `metadata.user_id`, a stored Responses turn continued by `previous_response_id` or
in a `conversation`; a `prompt_cache_key` that is no string is a 400 naming it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from deepinfer_server.coordinator.session_routing import SessionNames
from tests.http.harness import MODEL, Harness, run, serve
from tests.http.test_stored_responses import run_stored

NO_THINKING = {"thinking": {"type": "disabled"}}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], **NO_THINKING}


def _last_session(h: Harness) -> SessionNames | None:
    (request_id, *_), *_ = h.coordinator.submitted[-1:]
    return h.coordinator.sessions[request_id]


async def _post(h: Harness, path: str, body: dict[str, Any], **headers: str) -> None:
    response = await h.client.post(path, json=body, headers=headers)
    assert response.status_code == 200, response.text


def test_each_api_names_its_session() -> None:
    async def body() -> None:
        async with serve() as h:
            async with h.openai() as client:
                await client.chat.completions.create(
                    model=MODEL,
                    messages=[{"role": "user", "content": "Hi"}],
                    prompt_cache_key="chat-session",
                    extra_body=NO_THINKING,
                )
                assert _last_session(h) == SessionNames("chat-session", ("chat-session",))
                await client.completions.create(
                    model=MODEL, prompt="Hi", max_tokens=4, extra_body={"prompt_cache_key": "c"}
                )
                assert _last_session(h) == SessionNames("c", ("c",))
                await client.responses.create(model=MODEL, input="Hi", prompt_cache_key="r")
                assert _last_session(h) == SessionNames("r", ("r",))
            await _post(h, "/v1/chat/completions", CHAT, **{"x-session-id": "header"})
            assert _last_session(h) == SessionNames("header", ("header",))
            messages = {
                "model": MODEL,
                "max_tokens": 8,
                "messages": [{"role": "user", "content": "Hi"}],
                "metadata": {"user_id": "user_1"},
            }
            await _post(h, "/v1/messages", messages)
            assert _last_session(h) == SessionNames("user_1", ("user_1",))
            await _post(h, "/v1/messages", messages, **{"x-claude-code-session-id": "cc"})
            assert _last_session(h) == SessionNames("cc", ("cc",))
            await _post(h, "/v1/chat/completions", CHAT)
            assert _last_session(h) is None

    run(body)


def test_a_prompt_cache_key_that_is_no_string_is_a_400() -> None:
    async def body() -> None:
        async with serve() as h:
            for path, request in [
                ("/v1/chat/completions", CHAT),
                ("/v1/completions", {"model": MODEL, "prompt": "Hi"}),
                ("/v1/responses", {"model": MODEL, "input": "Hi"}),
            ]:
                response = await h.client.post(path, json={**request, "prompt_cache_key": 7})
                assert response.status_code == 400, path
                error = response.json()["error"]
                assert error["param"] == "prompt_cache_key"
                assert error["message"] == "'prompt_cache_key' must be a string"
            assert h.coordinator.submitted == []

    run(body)


def test_a_stored_turn_is_continued_by_its_response_id(tmp_path: Path) -> None:
    async def test(h: Harness) -> None:
        async with h.openai() as client:
            first = await client.responses.create(model=MODEL, input="Hello")
            assert _last_session(h) == SessionNames(None, (first.id,))
            second = await client.responses.create(
                model=MODEL, input="Again", previous_response_id=first.id
            )
            assert _last_session(h) == SessionNames(first.id, (first.id, second.id))
            conversation = await client.conversations.create()
            third = await client.responses.create(
                model=MODEL, input="Hi", conversation=conversation.id
            )
            assert _last_session(h) == SessionNames(conversation.id, (conversation.id, third.id))

    run_stored(tmp_path, test)
