"""The route table's stored objects: stored Responses (a background one's events and cancel)
and OpenAI's Conversations."""

from __future__ import annotations

from deepinfer_server.api.dialects import Dialect
from deepinfer_server.api.route import Endpoint, with_parameters
from deepinfer_server.api.route_table.entries import on_object, post_body
from deepinfer_server.api.routes.conversations import (
    create_conversation,
    create_items,
    delete_conversation,
    delete_item,
    list_items,
    retrieve_conversation,
    retrieve_item,
    update_conversation,
)
from deepinfer_server.api.routes.stored_responses import (
    cancel_response,
    delete_response,
    list_input_items,
    retrieve_response,
)
from deepinfer_server.openapi import operations as op
from deepinfer_server.protocol.responses.stored import ITEMS_INCLUDE, RESPONSE_INCLUDE

#: In the order the document lists them.
STORED: tuple[Endpoint, ...] = (
    Endpoint(
        "/v1/responses/{response_id}",
        "GET",
        retrieve_response,
        Dialect.OPENAI,
        with_parameters(
            op.get(
                "A stored response (a background one's events again with stream=true); 404 "
                "in another API key's scope",
                {**op.JSON_OBJECT, **op.STREAM},
            ),
            op.RESPONSE_ID,
            op.include(RESPONSE_INCLUDE),
            *op.STREAM_AGAIN,
        ),
        protected=True,
    ),
    on_object(
        "POST",
        "/v1/responses/{response_id}/cancel",
        cancel_response,
        "Cancel a background response still running",
        op.RESPONSE_ID,
    ),
    on_object(
        "DELETE",
        "/v1/responses/{response_id}",
        delete_response,
        "Delete a stored response",
        op.RESPONSE_ID,
    ),
    on_object(
        "GET",
        "/v1/responses/{response_id}/input_items",
        list_input_items,
        "A stored response's input items, a page at a time",
        op.RESPONSE_ID,
        op.include(ITEMS_INCLUDE),
        *op.PAGE,
    ),
    post_body(
        "/v1/conversations",
        create_conversation,
        "Create a conversation (OpenAI's Conversations API)",
        "ConversationCreateRequest",
    ),
    on_object(
        "GET",
        "/v1/conversations/{conversation_id}",
        retrieve_conversation,
        "A conversation; 404 in another API key's scope",
        op.CONVERSATION_ID,
    ),
    post_body(
        "/v1/conversations/{conversation_id}",
        update_conversation,
        "Replace a conversation's metadata",
        "ConversationUpdateRequest",
        op.CONVERSATION_ID,
    ),
    on_object(
        "DELETE",
        "/v1/conversations/{conversation_id}",
        delete_conversation,
        "Delete a conversation and its items",
        op.CONVERSATION_ID,
    ),
    on_object(
        "GET",
        "/v1/conversations/{conversation_id}/items",
        list_items,
        "A conversation's items, a page at a time",
        op.CONVERSATION_ID,
        op.include(ITEMS_INCLUDE),
        *op.PAGE,
    ),
    post_body(
        "/v1/conversations/{conversation_id}/items",
        create_items,
        "Add up to 20 items to a conversation",
        "ConversationItemsRequest",
        op.CONVERSATION_ID,
        op.include(ITEMS_INCLUDE),
    ),
    on_object(
        "GET",
        "/v1/conversations/{conversation_id}/items/{item_id}",
        retrieve_item,
        "One item of a conversation",
        op.CONVERSATION_ID,
        op.ITEM_ID,
        op.include(ITEMS_INCLUDE),
    ),
    on_object(
        "DELETE",
        "/v1/conversations/{conversation_id}/items/{item_id}",
        delete_item,
        "Delete an item of a conversation (answers the conversation)",
        op.CONVERSATION_ID,
        op.ITEM_ID,
    ),
)
