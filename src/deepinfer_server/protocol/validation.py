"""Checks of request fields that deepseek-recipe leaves to the server (recipe-notes.md)."""

from __future__ import annotations

from typing import Any

import orjson

from deepinfer_server.errors import BadRequestError, ModelNotFoundError

UINT32_MAX = 2**32 - 1
_IMAGE_PART_TYPES = frozenset({"image_url", "input_image", "image"})


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


def reject_images(messages: Any) -> None:
    """400 for image content parts, which this service does not support yet."""
    if not isinstance(messages, list):
        return
    for index, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for part_index, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") in _IMAGE_PART_TYPES:
                raise BadRequestError(
                    "image content is not supported by this server yet",
                    param=f"messages[{index}].content[{part_index}]",
                    code="unsupported_content",
                )


def reject_unsupported_chat_options(body: dict[str, Any]) -> None:
    """400 for Chat Completions options this service does not implement yet."""
    if body.get("logprobs"):
        raise BadRequestError("logprobs are not supported by this server yet", param="logprobs")
    if body.get("top_logprobs"):
        raise BadRequestError(
            "top_logprobs are not supported by this server yet", param="top_logprobs"
        )
    response_format = body.get("response_format")
    if isinstance(response_format, dict):
        kind = response_format.get("type")
        if kind not in (None, "text", "json_object"):
            raise BadRequestError(
                f"response_format type {kind!r} is not supported: only 'text' and "
                "'json_object' are (no constrained decoding yet)",
                param="response_format",
            )
