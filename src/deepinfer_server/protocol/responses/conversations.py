"""OpenAI's Conversations API, the protocol side: what a conversation, its items and a
Responses request's `conversation` may be, and the errors for what is not stored.

A conversation's items are Responses input items, stored in the shapes `input_items` lists
(`stored.with_id`). Limits are OpenAI's: at most `MAX_ITEMS_PER_CALL` items per create or add,
metadata of at most 16 string pairs (keys up to 64 characters, values up to 512).
"""

from __future__ import annotations

from typing import Any

from deepinfer_server.errors import BadRequestError, ErrorKind, StoredObjectNotFound
from deepinfer_server.protocol.core.json_types import JsonObject
from deepinfer_server.protocol.responses.request import INPUT_ITEM_TYPES
from deepinfer_server.protocol.responses.stored import ITEM_REFERENCE, with_id

Item = JsonObject

#: Items one create or add takes (OpenAI's bound).
MAX_ITEMS_PER_CALL = 20
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512
_ROLES = frozenset({"user", "assistant", "system", "developer"})


def read_conversation(body: JsonObject) -> str | None:
    """The `conversation` of a Responses request (an ID, or `{"id": ...}`), or None.
    With `previous_response_id` it is a 400, as OpenAI answers."""
    value = body.get("conversation")
    if value is None:
        return None
    if isinstance(value, dict):
        value = value.get("id")
    if not isinstance(value, str) or not value:
        raise BadRequestError(
            "'conversation' must be a conversation ID or an object with its 'id'",
            param="conversation",
        )
    if body.get("previous_response_id") is not None:
        raise BadRequestError(
            "Mutually exclusive parameters: Ensure you are only providing one of: "
            "'previous_response_id' or 'conversation'.",
            param="conversation",
        )
    return value


def read_metadata(value: Any, *, param: str = "metadata") -> dict[str, str]:
    """Checked metadata (None: none)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise BadRequestError("'metadata' must be an object of strings", param=param)
    if len(value) > MAX_METADATA_PAIRS:
        raise BadRequestError(
            f"'metadata' holds at most {MAX_METADATA_PAIRS} pairs; it has {len(value)}",
            param=param,
        )
    for key, text in value.items():
        if len(key) > MAX_METADATA_KEY:
            raise BadRequestError(
                f"metadata keys are at most {MAX_METADATA_KEY} characters", param=f"{param}.{key}"
            )
        if not isinstance(text, str) or len(text) > MAX_METADATA_VALUE:
            raise BadRequestError(
                f"metadata values are strings of at most {MAX_METADATA_VALUE} characters",
                param=f"{param}.{key}",
            )
    return dict(value)


def read_items(value: Any, *, param: str = "items", required: bool = False) -> list[Item]:
    """Checked items to add to a conversation, each with its `id` (None: none, unless
    `required`)."""
    if value is None and not required:
        return []
    if not isinstance(value, list) or (required and not value):
        raise BadRequestError(f"'{param}' must be a non-empty list of input items", param=param)
    if len(value) > MAX_ITEMS_PER_CALL:
        raise BadRequestError(
            f"You may add up to {MAX_ITEMS_PER_CALL} items at a time; got {len(value)}",
            param=param,
        )
    return [_checked_item(item, f"{param}[{index}]") for index, item in enumerate(value)]


def _checked_item(item: Any, where: str) -> Item:
    if not isinstance(item, dict):
        raise BadRequestError(f"{where} must be an input item object", param=where)
    kind = item.get("type", "message")
    if kind == ITEM_REFERENCE:
        raise BadRequestError(
            f"{where}: item references are not supported in a conversation's items; send "
            "the item itself",
            param=f"{where}.type",
            kind=ErrorKind.UNSUPPORTED,
        )
    if not isinstance(kind, str) or kind not in INPUT_ITEM_TYPES:
        raise BadRequestError(
            f"{where}: input item type {kind!r} is not supported; supported: "
            + ", ".join(sorted(INPUT_ITEM_TYPES)),
            param=f"{where}.type",
            kind=ErrorKind.UNSUPPORTED,
        )
    if kind == "message":
        if item.get("role", "user") not in _ROLES:
            raise BadRequestError(
                f"{where}.role must be one of " + ", ".join(sorted(_ROLES)),
                param=f"{where}.role",
            )
        if not isinstance(item.get("content"), str | list):
            raise BadRequestError(
                f"{where}.content must be a string or a list of content parts",
                param=f"{where}.content",
            )
    stored: Item = with_id(item)
    return stored


def conversation_not_found(conversation_id: str) -> StoredObjectNotFound:
    return StoredObjectNotFound(
        f"Conversation with id {conversation_id!r} not found.", kind=ErrorKind.NOT_FOUND
    )


def item_not_found(item_id: str) -> StoredObjectNotFound:
    return StoredObjectNotFound(
        f"Item with id {item_id!r} not found.", kind=ErrorKind.ITEM_NOT_FOUND
    )
