"""A refused field is named on every API, in the API's own error shape: OpenAI's `param` (and
the message), Anthropic's message (its shape has no `param`), for the fields the server types
and for those deepseek-recipe refuses in its own words."""

from __future__ import annotations

from typing import Any

import pytest

from tests.http.harness import MODEL, run, serve

_USER = [{"role": "user", "content": "hi"}]
_BODIES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {"model": MODEL, "messages": _USER},
    "/v1/completions": {"model": MODEL, "prompt": "hi"},
    "/v1/responses": {"model": MODEL, "input": "hi"},
    "/v1/messages": {"model": MODEL, "messages": _USER, "max_tokens": 8},
}
_CASES = [
    ("/v1/chat/completions", "stream", "yes"),
    ("/v1/chat/completions", "parallel_tool_calls", 3),
    ("/v1/chat/completions", "seed", -1),
    ("/v1/completions", "max_tokens", -1),
    ("/v1/completions", "stream", "yes"),
    ("/v1/responses", "max_output_tokens", -1),
    ("/v1/responses", "temperature", "hot"),
    ("/v1/responses", "instructions", 3),
    ("/v1/messages", "max_tokens", -1),
    ("/v1/messages", "stop_sequences", "x"),
    ("/v1/messages", "thinking", {"type": "sometimes"}),
    ("/v1/messages", "top_k", "x"),
]


@pytest.mark.parametrize(("path", "field", "value"), _CASES)
def test_a_refused_field_is_named_in_the_apis_shape(path: str, field: str, value: Any) -> None:
    async def body() -> None:
        async with serve() as h:
            response = await h.client.post(path, json={**_BODIES[path], field: value})
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            if path == "/v1/messages":
                assert response.json()["type"] == "error"
                assert "param" not in error
                assert error["message"].lstrip("'").startswith(field), error
            else:
                assert error["param"] == field, error
                assert field in error["message"], error

    run(body)
