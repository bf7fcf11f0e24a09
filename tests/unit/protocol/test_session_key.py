"""The session a request names: each source alone, the order when several are present, and
what does not count (empty strings, values of the wrong type)."""

from __future__ import annotations

from typing import Any

import pytest
from starlette.datastructures import Headers

from deepinfer_server.errors import BadRequestError
from deepinfer_server.protocol.chat.request import read_chat_body
from deepinfer_server.protocol.core.session_key import session_key

_NO_HEADERS = Headers({})


@pytest.mark.parametrize(
    ("body", "headers", "key"),
    [
        ({"prompt_cache_key": "pck"}, {}, "pck"),
        ({"conversation": "conv_1"}, {}, "conv_1"),
        ({"conversation": {"id": "conv_2"}}, {}, "conv_2"),
        ({"previous_response_id": "resp_1"}, {}, "resp_1"),
        ({}, {"X-Session-Id": "header"}, "header"),
        ({}, {"x-claude-code-session-id": "claude"}, "claude"),
        ({"metadata": {"user_id": "user_abc"}}, {}, "user_abc"),
        ({"messages": []}, {}, None),
    ],
)
def test_each_source_names_the_session(
    body: dict[str, Any], headers: dict[str, str], key: str | None
) -> None:
    assert session_key(body, Headers(headers)) == key


def test_the_first_source_present_wins() -> None:
    # From the last in the order to the first: each source added takes over from the others.
    sources: list[tuple[dict[str, Any], dict[str, str], str]] = [
        ({"metadata": {"user_id": "user"}}, {}, "user"),
        ({}, {"x-claude-code-session-id": "claude"}, "claude"),
        ({}, {"x-session-id": "header"}, "header"),
        ({"previous_response_id": "resp"}, {}, "resp"),
        ({"conversation": "conv"}, {}, "conv"),
        ({"prompt_cache_key": "pck"}, {}, "pck"),
    ]
    body: dict[str, Any] = {}
    headers: dict[str, str] = {}
    for fields, header, key in sources:
        body.update(fields)
        headers.update(header)
        assert session_key(body, Headers(headers)) == key


def test_empty_and_mistyped_values_name_no_session() -> None:
    body = {
        "prompt_cache_key": "",
        "conversation": {"id": 7},
        "previous_response_id": None,
        "metadata": {"user_id": 5},
    }
    assert session_key(body, Headers({"x-session-id": ""})) is None
    assert session_key({"metadata": "user"}, _NO_HEADERS) is None
    body["metadata"] = {"user_id": "user"}
    assert session_key(body, _NO_HEADERS) == "user"  # the first that counts


def test_a_prompt_cache_key_that_is_no_string_is_refused() -> None:
    with pytest.raises(BadRequestError) as refused:
        read_chat_body({"model": "m", "messages": [], "prompt_cache_key": 5})
    assert refused.value.param == "prompt_cache_key"
    assert "'prompt_cache_key' must be a string" in refused.value.message
    assert read_chat_body({"model": "m", "prompt_cache_key": "k"}).prompt_cache_key == "k"
