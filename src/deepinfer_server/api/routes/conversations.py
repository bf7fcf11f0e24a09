"""OpenAI's Conversations API: `/v1/conversations[/{id}]` (create, retrieve, update its
metadata, delete) and its items (`/v1/conversations/{id}/items[/{item_id}]`: add, list a page
at a time, retrieve, delete), on the Responses store (`store/conversations.py`).

Every call is in the request's scope (`api.store_scope.request_scope`): a conversation of
another API key is a 404, word for word as one that never existed. A store outage is a 503;
without a store (`--response-store none`) creating one is a 400 and every ID a 404.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from deepinfer_server.api.body import read_json_body
from deepinfer_server.api.routes.answers import json_answer, list_page
from deepinfer_server.api.routes.paging import include_values, page_limit, page_order
from deepinfer_server.api.state import AppState
from deepinfer_server.api.store_scope import request_scope
from deepinfer_server.errors import BadRequestError, ErrorKind
from deepinfer_server.protocol.core.json_types import JsonObject
from deepinfer_server.protocol.responses.conversations import (
    check_added_items,
    conversation_not_found,
    item_not_found,
    read_items,
    read_metadata,
)
from deepinfer_server.protocol.responses.stored import ITEMS_INCLUDE, check_include
from deepinfer_server.store.conversations import ConversationStore

_NO_STORE = "this server stores no conversations (--response-store none)"


async def _opened(request: Request) -> tuple[ConversationStore, str, str]:
    """The conversations, the request's scope and the conversation ID of the path (404
    without a store)."""
    state: AppState = request.app.state.server
    conversation_id: str = request.path_params["conversation_id"]
    if state.store is None:
        raise conversation_not_found(conversation_id)
    return (
        ConversationStore(state.store),
        await request_scope(request, state.store),
        conversation_id,
    )


async def _body(request: Request) -> JsonObject:
    state: AppState = request.app.state.server
    return (await read_json_body(request, state.config, state.receiving)).value


async def create_conversation(request: Request) -> Response:
    """A new conversation, with up to 20 first items and its metadata."""
    state: AppState = request.app.state.server
    body = await _body(request)
    if state.store is None:
        raise BadRequestError(_NO_STORE, kind=ErrorKind.UNSUPPORTED)
    metadata = read_metadata(body.get("metadata"))
    items = read_items(body.get("items"))
    check_added_items([], items)
    scope = await request_scope(request, state.store)
    conversation = await ConversationStore(state.store).create(scope, metadata, items)
    return json_answer(conversation.body())


async def retrieve_conversation(request: Request) -> Response:
    conversations, scope, conversation_id = await _opened(request)
    found = await conversations.get(scope, conversation_id)
    if found is None:
        raise conversation_not_found(conversation_id)
    return json_answer(found.body())


async def update_conversation(request: Request) -> Response:
    """Replace the conversation's metadata (the one thing an update changes)."""
    body = await _body(request)
    conversations, scope, conversation_id = await _opened(request)
    if "metadata" not in body:
        raise BadRequestError("Missing required parameter: 'metadata'.", param="metadata")
    found = await conversations.update(scope, conversation_id, read_metadata(body["metadata"]))
    if found is None:
        raise conversation_not_found(conversation_id)
    return json_answer(found.body())


async def delete_conversation(request: Request) -> Response:
    conversations, scope, conversation_id = await _opened(request)
    if not await conversations.delete(scope, conversation_id):
        raise conversation_not_found(conversation_id)
    return json_answer({"id": conversation_id, "object": "conversation.deleted", "deleted": True})


async def list_items(request: Request) -> Response:
    """The conversation's items, a page at a time (newest first unless `order=asc`)."""
    check_include(include_values(request), ITEMS_INCLUDE, "conversation items")
    limit, order = page_limit(request), page_order(request)
    conversations, scope, conversation_id = await _opened(request)
    page = await conversations.items(
        scope, conversation_id, after=request.query_params.get("after"), limit=limit, order=order
    )
    if page is None:
        raise conversation_not_found(conversation_id)
    return json_answer(list_page(page.items, page.has_more))


async def create_items(request: Request) -> Response:
    """Add up to 20 items at the end of the conversation; the items added."""
    check_include(include_values(request), ITEMS_INCLUDE, "conversation items")
    body = await _body(request)
    conversations, scope, conversation_id = await _opened(request)
    items = read_items(body.get("items"), required=True)
    stored = await conversations.items(scope, conversation_id, limit=None, order="asc")
    if stored is None:
        raise conversation_not_found(conversation_id)
    check_added_items(stored.items, items)
    if not await conversations.append(scope, conversation_id, items, generated=False):
        raise conversation_not_found(conversation_id)
    return json_answer(list_page(items, False))


async def retrieve_item(request: Request) -> Response:
    check_include(include_values(request), ITEMS_INCLUDE, "conversation items")
    conversations, scope, conversation_id = await _opened(request)
    item_id: str = request.path_params["item_id"]
    if await conversations.get(scope, conversation_id) is None:
        raise conversation_not_found(conversation_id)
    item = await conversations.item(scope, conversation_id, item_id)
    if item is None:
        raise item_not_found(item_id)
    return json_answer(item)


async def delete_item(request: Request) -> Response:
    """Delete an item from the conversation; the conversation, as OpenAI answers."""
    conversations, scope, conversation_id = await _opened(request)
    item_id: str = request.path_params["item_id"]
    deleted = await conversations.delete_item(scope, conversation_id, item_id)
    if deleted is None:
        raise conversation_not_found(conversation_id)
    if not deleted:
        raise item_not_found(item_id)
    found = await conversations.get(scope, conversation_id)
    if found is None:
        raise conversation_not_found(conversation_id)
    return json_answer(found.body())
