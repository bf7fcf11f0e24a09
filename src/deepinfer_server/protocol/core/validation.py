"""Checks that deepseek-recipe 0.2.0 leaves to the server: the body is one bounded JSON object,
the model is served, and fields the recipe passes through unchecked have their types."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from deepinfer_server.errors import BadRequestError, ErrorKind, ModelNotFoundError
from deepinfer_server.protocol.core.json_types import JsonObject

UINT32_MAX = 2**32 - 1
#: The deepest nesting of arrays and objects accepted anywhere in a request body. Real requests
#: (tool schemas included) stay far below it; deepseek-recipe recurses per level.
MAX_JSON_DEPTH = 64


def parse_object(body: Any) -> JsonObject:
    """The decoded body, which must be a JSON object."""
    if not isinstance(body, dict):
        raise BadRequestError("the request body must be a JSON object")
    return body


def decode_json(body: bytes) -> JsonObject:
    """Decode a request body; 400 for malformed JSON, invalid UTF-8, lone surrogates, or
    nesting deeper than MAX_JSON_DEPTH."""
    try:
        decoded = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise BadRequestError(f"the request body is not valid JSON: {exc}") from exc
    check_depth(decoded)
    return parse_object(decoded)


def check_depth(value: Any, limit: int = MAX_JSON_DEPTH) -> None:
    """400 if arrays and objects nest deeper than `limit` levels anywhere in `value`."""
    level: list[Any] = [value]
    for depth in range(limit + 1):
        children: list[Any] = []
        for item in level:
            if isinstance(item, dict):
                children.extend(item.values())
            elif isinstance(item, list):
                children.extend(item)
        if not children:
            return
        level = [c for c in children if isinstance(c, dict | list)]
        if not level:
            return
        if depth == limit - 1:
            raise BadRequestError(
                f"the request body nests arrays and objects more than {limit} levels deep"
            )


def optional_bool(body: JsonObject, name: str, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise BadRequestError(f"'{name}' must be a boolean", param=name)
    return value


def optional_uint(body: JsonObject, name: str, maximum: int = UINT32_MAX) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequestError(f"'{name}' must be an integer", param=name)
    if not 0 <= value <= maximum:
        raise BadRequestError(f"'{name}' must be between 0 and {maximum}", param=name)
    return value


#: The range of a request's `priority` (a signed 32-bit integer; vLLM takes any integer).
PRIORITY_MIN = -(2**31)
PRIORITY_MAX = 2**31 - 1


def refuse_given(
    body: Mapping[str, Any],
    name: str,
    message: str,
    *,
    param: str | None = None,
    kind: ErrorKind | None = None,
) -> None:
    """A 400 (`kind`'s, else a plain bad request) saying `message` and naming `param` (default
    `name`) when the body gives `name` (null is not given)."""
    if body.get(name) is not None:
        raise BadRequestError(message, param=param or name, kind=kind)


def read_priority(body: Mapping[str, Any]) -> int:
    """`priority` (vLLM's extension: lower starts first among the API key's queued requests;
    default 0), or 400 for anything but an integer in range."""
    value = body.get("priority")
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequestError("'priority' must be an integer", param="priority")
    if not PRIORITY_MIN <= value <= PRIORITY_MAX:
        raise BadRequestError(
            f"'priority' must be between {PRIORITY_MIN} and {PRIORITY_MAX}", param="priority"
        )
    return value


def check_model(body: JsonObject, served_model_names: tuple[str, ...]) -> None:
    """404 model_not_found for a model this server does not serve."""
    model = body.get("model")
    if isinstance(model, str) and model not in served_model_names:
        names = ", ".join(served_model_names)
        raise ModelNotFoundError(
            f"The model '{model}' does not exist; this server serves: {names}", param="model"
        )


def reject_file_parts(message: JsonObject, index: int) -> None:
    """400 naming what is unsupported: documents (`file` parts), whatever they carry."""
    content = message.get("content")
    if not isinstance(content, list):
        return
    for part_index, part in enumerate(content):
        if isinstance(part, dict) and part.get("type") == "file":
            raise BadRequestError(
                "file content (documents such as PDFs) is not supported by this server; send "
                "the document's text instead",
                param=f"messages[{index}].content[{part_index}]",
                kind=ErrorKind.UNSUPPORTED,
                code="unsupported_content",
            )


_CHAT_ROLES = frozenset({"system", "user", "assistant", "tool", "function", "latest_reminder"})
#: The sampling fields deepseek-recipe checks for Chat, whose 400 would not name them.
_NUMBERS = ("temperature", "top_p")


def check_chat_fields(body: JsonObject) -> None:
    """Type checks of Chat Completions fields that are not typed body fields (`ChatBody`
    declares and checks those), so that each 400 names its field.

    deepseek-recipe checks these too, but its messages do not say which field was wrong.
    """
    if not isinstance(body.get("model"), str):
        raise BadRequestError("'model' is required and must be a string", param="model")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequestError("'messages' must be a non-empty array", param="messages")
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise BadRequestError("each message must be an object", param=f"messages[{index}]")
        role = message.get("role")
        if role != "developer" and (not isinstance(role, str) or role not in _CHAT_ROLES):
            raise BadRequestError(
                f"unknown role {role!r}: expected one of {', '.join(sorted(_CHAT_ROLES))} "
                "or developer",
                param=f"messages[{index}].role",
            )
        reasoning = message.get("reasoning_content")
        if role == "assistant" and reasoning is not None and not isinstance(reasoning, str):
            raise BadRequestError(
                f"'messages[{index}].reasoning_content' must be a string",
                param=f"messages[{index}].reasoning_content",
            )
        calls = message.get("tool_calls")
        if role == "assistant" and calls is not None and not isinstance(calls, list):
            raise BadRequestError(
                f"'messages[{index}].tool_calls' must be an array",
                param=f"messages[{index}].tool_calls",
            )
        reject_file_parts(message, index)
    for name in _NUMBERS:
        value = body.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise BadRequestError(f"'{name}' must be a number", param=name)
