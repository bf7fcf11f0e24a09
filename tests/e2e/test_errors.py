"""Every bad input gets an OpenAI error envelope with the right status, never a traceback."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from tests.conftest import MODEL
from tests.server import LiveServer

USER = [{"role": "user", "content": "hi"}]


def _post(
    server: LiveServer, body: bytes | dict[str, Any], path: str = "/v1/chat/completions"
) -> httpx.Response:
    if isinstance(body, dict):
        return httpx.post(server.base_url + path, json=body, timeout=30)
    return httpx.post(
        server.base_url + path,
        content=body,
        headers={"content-type": "application/json"},
        timeout=30,
    )


def _assert_envelope(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    assert "Traceback" not in response.text
    return dict(body["error"])


BAD_BODIES: dict[str, dict[str, Any]] = {
    "n_out_of_range": {"n": 0},
    "logprobs": {"logprobs": 1},
    "presence_penalty": {"presence_penalty": 0.5},
    "top_logprobs": {"logprobs": False, "top_logprobs": 3},
    "image_part": {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "look"},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                ],
            }
        ]
    },
    "json_schema_without_schema": {
        "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}
    },
    "regex_format": {"response_format": {"type": "regex", "regex": "a+"}},
    "unknown_format": {"response_format": {"type": "yaml"}},
    "unknown_role": {"messages": [{"role": "wizard", "content": "x"}]},
    "no_messages": {"messages": []},
    "messages_wrong_type": {"messages": "hi"},
    "max_tokens_string": {"max_tokens": "5"},
    "max_tokens_negative": {"max_tokens": -1},
    "max_tokens_huge": {"max_tokens": 10**12},
    "max_completion_tokens_negative": {"max_completion_tokens": -3},
    "max_completion_tokens_float": {"max_completion_tokens": 2.5},
    "temperature_string": {"temperature": "hot"},
    "temperature_out_of_range": {"temperature": 7},
    "top_p_out_of_range": {"top_p": 3},
    "seed_negative": {"seed": -1},
    "ignore_eos_not_bool": {"ignore_eos": "yes"},
    "stream_options_without_stream": {"stream_options": {"include_usage": True}},
    "stream_options_not_object": {"stream": True, "stream_options": 3},
    "required_tool_choice_without_tools": {"tool_choice": "required"},
    "prompt_longer_than_context": {"messages": [{"role": "user", "content": "word " * 5000}]},
    "missing_model": {"model": None},
}


#: The field each 400 names (`param`), so a client can point at what to fix.
PARAMS: dict[str, str | None] = {
    "ignore_eos_not_bool": "ignore_eos",
    "image_part": "messages[0]",
    "json_schema_without_schema": "response_format",
    "logprobs": "logprobs",
    "max_completion_tokens_float": "max_completion_tokens",
    "max_completion_tokens_negative": "max_completion_tokens",
    "max_tokens_huge": "max_tokens",
    "max_tokens_negative": "max_tokens",
    "max_tokens_string": "max_tokens",
    "messages_wrong_type": "messages",
    "missing_model": "model",
    "n_out_of_range": "n",
    "presence_penalty": "presence_penalty",
    "no_messages": "messages",
    "prompt_longer_than_context": "messages",
    "regex_format": "response_format",
    "required_tool_choice_without_tools": "tool_choice",
    "seed_negative": "seed",
    "stream_options_not_object": "stream_options",
    "stream_options_without_stream": "stream_options",
    "temperature_out_of_range": "temperature",
    "temperature_string": "temperature",
    "top_logprobs": "top_logprobs",
    "top_p_out_of_range": "top_p",
    "unknown_format": "response_format",
    "unknown_role": "messages[0].role",
}


@pytest.mark.parametrize("name", sorted(BAD_BODIES))
def test_bad_request_is_400_naming_the_field(shared_server: LiveServer, name: str) -> None:
    body: dict[str, Any] = {"model": MODEL, "messages": USER, **BAD_BODIES[name]}
    if body["model"] is None:
        del body["model"]
    error = _assert_envelope(_post(shared_server, body), 400)
    assert error["param"] == PARAMS[name]
    if "context" in name:
        assert error["code"] == "context_length_exceeded"


@pytest.mark.parametrize(
    "raw",
    [b"{not json", b'{"model": "\xff\xfe"}', b'{"model": "\\ud800"}', b"[1, 2]", b"", b"null"],
    ids=["malformed", "invalid_utf8", "lone_surrogate", "array", "empty", "null"],
)
def test_undecodable_body_is_400(shared_server: LiveServer, raw: bytes) -> None:
    _assert_envelope(_post(shared_server, raw), 400)


def test_unknown_model_is_404_model_not_found(shared_server: LiveServer) -> None:
    error = _assert_envelope(_post(shared_server, {"model": "gpt-4o", "messages": USER}), 404)
    assert error["code"] == "model_not_found"
    assert error["param"] == "model"


def test_openai_client_raises_typed_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="other", messages=USER)  # type: ignore[arg-type]
    with pytest.raises(openai.BadRequestError) as excinfo:
        client.chat.completions.create(model=MODEL, messages=USER, n=0)  # type: ignore[arg-type]
    assert "n" in excinfo.value.message


def test_unknown_route_and_method(shared_server: LiveServer) -> None:
    _assert_envelope(httpx.get(shared_server.base_url + "/v1/nothing", timeout=30), 404)
    _assert_envelope(httpx.get(shared_server.base_url + "/v1/chat/completions", timeout=30), 405)


def test_sse_framing_and_usage_null_on_every_chunk(shared_server: LiveServer) -> None:
    body = {"model": MODEL, "messages": USER, "stream": True, "thinking": {"type": "disabled"}}
    with httpx.stream(
        "POST", shared_server.base_url + "/v1/chat/completions", json=body, timeout=30
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode()
    assert raw.endswith("data: [DONE]\n\n")
    events = raw.split("\n\n")[:-1]
    assert all(event.startswith("data: ") for event in events)
    chunks = [httpx.Response(200, content=e[6:]).json() for e in events[:-1]]
    assert all("usage" in c and c["usage"] is None for c in chunks)


def test_health_ok(shared_server: LiveServer) -> None:
    response = httpx.get(shared_server.base_url + "/health", timeout=30)
    assert response.status_code == 200
    assert response.json() == {"status": "ok"}
