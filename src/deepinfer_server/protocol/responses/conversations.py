"""OpenAI's Conversations API, the protocol side: what a conversation, its items and a
Responses request's `conversation` may be, and the errors for what is not stored.

A conversation's items are Responses input items, stored in the shapes `input_items` lists
(`stored.with_id`). Limits are OpenAI's: at most `MAX_ITEMS_PER_CALL` items per create or add,
metadata of at most 16 string pairs (keys up to 64 characters, values up to 512).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from deepinfer_server.errors import BadRequestError, ErrorKind, StoredObjectNotFound
from deepinfer_server.protocol.core.json_types import JsonObject
from deepinfer_server.protocol.core.validation import refuse_given
from deepinfer_server.protocol.responses.request import check_item_type
from deepinfer_server.protocol.responses.stored import ITEM_REFERENCE, with_id

Item = JsonObject

#: Items one create or add takes (OpenAI's bound).
MAX_ITEMS_PER_CALL = 20
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512
_ROLES = frozenset({"user", "assistant", "system", "developer"})
#: The tool calls and the outputs answering them, paired by `call_id` as deepseek-recipe pairs
#: them in a Responses request's input (any output may answer any call).
_CALLS = frozenset({"function_call", "custom_tool_call", "tool_search_call"})
_OUTPUTS = frozenset({"function_call_output", "custom_tool_call_output", "tool_search_output"})


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
    refuse_given(
        body,
        "previous_response_id",
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
    check_item_type(kind, where)
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


def check_added_items(stored: Sequence[Item], added: Sequence[Item], param: str = "items") -> None:
    """400 naming the first of the items `added` after those `stored` that would make every
    turn on the conversation a 400: an item ID already in it, or a tool call or output the
    recipe would refuse (a `call_id` missing or repeated, an output answering no call before
    it or answering one already answered)."""
    ids = {item.get("id") for item in stored}
    calls: set[object] = set()
    answered: set[object] = set()
    for item in stored:
        if item.get("type") in _CALLS:
            calls.add(item.get("call_id"))
        elif item.get("type") in _OUTPUTS:
            answered.add(item.get("call_id"))
    for index, item in enumerate(added):
        where = f"{param}[{index}]"
        if item.get("id") in ids:
            raise BadRequestError(
                f"{where}: item ID {item['id']!r} is already in the conversation",
                param=f"{where}.id",
            )
        ids.add(item.get("id"))
        kind, call_id = item.get("type"), item.get("call_id")
        if kind not in _CALLS and kind not in _OUTPUTS:
            continue
        problem = _pairing_problem(kind in _CALLS, call_id, calls, answered)
        if problem is not None:
            raise BadRequestError(f"{where}: {problem}", param=f"{where}.call_id")
        (calls if kind in _CALLS else answered).add(call_id)


def _pairing_problem(
    is_call: bool, call_id: object, calls: set[object], answered: set[object]
) -> str | None:
    if not isinstance(call_id, str):
        return "'call_id' must be a string"
    if is_call:
        return f"Duplicate 'call_id': {call_id}." if call_id in calls else None
    if call_id not in calls:
        return f"No tool call found for tool output with call_id {call_id}."
    return f"Duplicate tool output for call_id: {call_id}." if call_id in answered else None


def conversation_not_found(conversation_id: str) -> StoredObjectNotFound:
    return StoredObjectNotFound(
        f"Conversation with id {conversation_id!r} not found.", kind=ErrorKind.NOT_FOUND
    )


def item_not_found(item_id: str) -> StoredObjectNotFound:
    return StoredObjectNotFound(
        f"Item with id {item_id!r} not found.", kind=ErrorKind.ITEM_NOT_FOUND
    )
