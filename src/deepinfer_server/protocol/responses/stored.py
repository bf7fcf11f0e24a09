"""Stored Responses conversations: what of a request is stored, and how stored items return.

A stored response keeps the request's own `input` as items with IDs (`input_items`, what
`GET /v1/responses/{id}/input_items` lists) and the response object. A later request continues
it with `previous_response_id` (the whole chain's items come first, `expand`) or names stored
items with `{"type": "item_reference", "id": ...}` (`resolve_references`). Reasoning that comes
back from the store is sealed for its place in the new input (`seal_stored_reasoning`), so it
reaches the prompt through the one path replayed reasoning ever takes: a blob that verifies.
"""

from __future__ import annotations

import secrets
from typing import Any

from deepinfer_server.errors import BadRequestError, ErrorKind, StoredObjectNotFound
from deepinfer_server.protocol.core.json_types import JsonObject
from deepinfer_server.protocol.core.reasoning_seal import ReasoningSeal
from deepinfer_server.protocol.responses.reasoning import (
    ENCRYPTED_CONTENT,
    ConversationDigest,
    reasoning_text,
)

Item = JsonObject

ITEM_REFERENCE = "item_reference"
#: ID prefixes of input items that come without one (OpenAI's, where it has one).
_ID_PREFIXES = {
    "message": "msg",
    "function_call": "fc",
    "function_call_output": "fco",
    "custom_tool_call": "ctc",
    "custom_tool_call_output": "ctco",
    "reasoning": "rs",
}
#: Part types of a message's string content, by role.
_TEXT_PART = {"assistant": "output_text"}
#: `include` values stored items honour as they are: images are always stored and listed with
#: their URLs, so asking for them changes nothing.
ITEMS_INCLUDE = frozenset({"message.input_image.image_url"})
#: `include` values `GET /v1/responses/{id}` honours: the stored items' own, and its reasoning
#: sealed for the conversation as stored.
RESPONSE_INCLUDE = ITEMS_INCLUDE | {ENCRYPTED_CONTENT}


def check_include(values: list[str], supported: frozenset[str], where: str) -> None:
    """A 400 for an `include` value that `where` (conversation items, a stored response...)
    cannot honour."""
    for value in values:
        if value not in supported:
            raise BadRequestError(
                f"include {value!r} is not supported for {where}; supported: "
                + ", ".join(sorted(supported)),
                param="include",
                kind=ErrorKind.UNSUPPORTED,
            )


def input_list(body: JsonObject) -> list[Any]:
    """The request's `input` as a list of items (a string is one user message)."""
    value = body.get("input")
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    if isinstance(value, list):
        return list(value)
    return []


def new_item_id(kind: str) -> str:
    return f"{_ID_PREFIXES.get(kind, 'item')}_{secrets.token_hex(12)}"


def with_id(item: Any) -> Any:
    """A stored input item: `type` and `id` filled in, a message's string content as one text
    part (the shapes `input_items` lists); anything else unchanged."""
    if not isinstance(item, dict):
        return item
    kind = item.get("type", "message")  # a message may leave out its type
    if not isinstance(kind, str):
        return item  # no item type: the request's validation answers it with a 400
    stored = {**item, "type": kind}
    if not isinstance(stored.get("id"), str) or not stored["id"]:
        stored["id"] = new_item_id(kind)
    if kind == "message":
        role = stored.get("role", "user")
        content = stored.get("content")
        if isinstance(content, str) and isinstance(role, str):
            stored["content"] = [{"type": _TEXT_PART.get(role, "input_text"), "text": content}]
        stored.setdefault("status", "completed")
    return stored


def referenced_ids(items: list[Any], *, reasoning: bool = True) -> list[str]:
    """The IDs the store must resolve: item references, and (with `reasoning`) reasoning items
    that carry an ID but no `encrypted_content` (a client that relies on the store for them)."""
    wanted = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("id"), str):
            continue
        if item.get("type") == ITEM_REFERENCE or (reasoning and _unsealed_reasoning(item)):
            wanted.append(item["id"])
    return wanted


def _unsealed_reasoning(item: Item) -> bool:
    return item.get("type") == "reasoning" and item.get("encrypted_content") is None


def resolve_references(
    items: list[Any], found: dict[str, Item], first_index: int = 0
) -> tuple[list[Any], set[int]]:
    """The items with each reference replaced by the stored item, and the positions of the
    items that came from the store. A reference the store does not hold is a 404 naming it;
    a reasoning item it does not hold stays as sent (and keeps no text)."""
    resolved: list[Any] = []
    from_store: set[int] = set()
    for index, item in enumerate(items):
        if not isinstance(item, dict):
            resolved.append(item)
            continue
        kind = item.get("type")
        if kind == ITEM_REFERENCE:
            item_id = item.get("id")
            if not isinstance(item_id, str) or item_id not in found:
                raise StoredObjectNotFound(
                    f"Item with id {item_id!r} not found.",
                    param=f"input[{first_index + index}].id",
                    kind=ErrorKind.ITEM_NOT_FOUND,
                )
            from_store.add(index)
            resolved.append(found[item_id])
        elif (
            kind == "reasoning"
            and item.get("encrypted_content") is None
            and item.get("id") in found
        ):
            from_store.add(index)
            resolved.append(found[item["id"]])
        else:
            resolved.append(item)
    return resolved, from_store


def seal_stored_reasoning(items: list[Any], trusted: set[int], seal: ReasoningSeal) -> list[Any]:
    """The items with each trusted reasoning item (one that came from the store) sealed for its
    place in this conversation, as if the client had replayed its `encrypted_content`."""
    conversation = ConversationDigest()
    sealed = []
    for index, item in enumerate(items):
        if index in trusted and isinstance(item, dict) and item.get("type") == "reasoning":
            item = {
                **item,
                "encrypted_content": seal.seal(reasoning_text(item), conversation.digest),
            }
        sealed.append(item)
        conversation.add(item)
    return sealed


def check_previous_response_id(body: JsonObject) -> str | None:
    value = body.get("previous_response_id")
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise BadRequestError(
            "'previous_response_id' must be a response ID", param="previous_response_id"
        )
    return value


def previous_not_found(response_id: str) -> StoredObjectNotFound:
    return StoredObjectNotFound(
        f"Previous response with id {response_id!r} not found.",
        param="previous_response_id",
        kind=ErrorKind.PREVIOUS_RESPONSE_NOT_FOUND,
    )


def response_not_found(response_id: str, hint: str = "") -> StoredObjectNotFound:
    return StoredObjectNotFound(f"Response with id {response_id!r} not found.{hint}")


def storable_response(response: JsonObject) -> JsonObject:
    """The response object as stored: reasoning blobs left out (they are sealed again for
    whoever asks, `include` on GET)."""
    output = response.get("output")
    if not isinstance(output, list):
        return response
    items = [
        {**item, "encrypted_content": None}
        if isinstance(item, dict) and item.get("type") == "reasoning"
        else item
        for item in output
    ]
    return {**response, "output": items}
