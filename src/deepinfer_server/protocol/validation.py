"""Checks of request fields that deepseek-recipe leaves to the server (recipe-notes.md)."""

from __future__ import annotations

from typing import Any

import orjson

from deepinfer_server.errors import BadRequestError, ModelNotFoundError

UINT32_MAX = 2**32 - 1


def parse_object(body: Any) -> dict[str, Any]:
    """The decoded body, which must be a JSON object."""
    if not isinstance(body, dict):
        raise BadRequestError("the request body must be a JSON object")
    return body


def decode_json(body: bytes) -> dict[str, Any]:
    """Decode a request body; 400 for malformed JSON, invalid UTF-8 or lone surrogates."""
    try:
        return parse_object(orjson.loads(body))
    except orjson.JSONDecodeError as exc:
        raise BadRequestError(f"the request body is not valid JSON: {exc}") from exc


def optional_bool(body: dict[str, Any], name: str, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise BadRequestError(f"'{name}' must be a boolean", param=name)
    return value


def optional_uint(body: dict[str, Any], name: str, maximum: int = UINT32_MAX) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequestError(f"'{name}' must be an integer", param=name)
    if not 0 <= value <= maximum:
        raise BadRequestError(f"'{name}' must be between 0 and {maximum}", param=name)
    return value


def check_model(body: dict[str, Any], served_model_names: tuple[str, ...]) -> None:
    """404 model_not_found for a model this server does not serve."""
    model = body.get("model")
    if isinstance(model, str) and model not in served_model_names:
        names = ", ".join(served_model_names)
        raise ModelNotFoundError(
            f"The model '{model}' does not exist; this server serves: {names}", param="model"
        )


_CHAT_ROLES = frozenset({"system", "user", "assistant", "tool", "function", "latest_reminder"})
_NUMBERS = ("temperature", "top_p", "presence_penalty", "frequency_penalty")


def check_chat_fields(body: dict[str, Any]) -> None:
    """Type and range checks of Chat Completions fields, so that each 400 names its field.

    deepseek-recipe checks these too, but its messages do not say which field was wrong.
    `developer` messages become `system` messages, as OpenAI treats them for these models.
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
        if role == "developer":
            message["role"] = "system"
        elif role not in _CHAT_ROLES:
            raise BadRequestError(
                f"unknown role {role!r}: expected one of {', '.join(sorted(_CHAT_ROLES))} "
                "or developer",
                param=f"messages[{index}].role",
            )
    for name in _NUMBERS:
        value = body.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise BadRequestError(f"'{name}' must be a number", param=name)
    optional_uint(body, "seed", maximum=2**64 - 1)
    optional_bool(body, "logprobs")
    optional_uint(body, "top_logprobs", maximum=20)
    if body.get("stream_options") is not None and not body.get("stream"):
        raise BadRequestError("'stream_options' needs 'stream': true", param="stream_options")
