"""The route table: every endpoint the server serves, declared once.

From `ROUTES`, `api/app.py` builds the Starlette routes, `api/routes/openapi.py` the OpenAPI
document's operations, and `api/error_responses.py` the API each path speaks (its error
envelope). A new endpoint is one `Endpoint` here plus its handler.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import cached_property

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import compile_path

from deepinfer_server.api.dialects import Dialect
from deepinfer_server.api.routes.batches import (
    cancel_batch,
    create_batch,
    create_file,
    delete_file,
    file_content,
    list_batches,
    list_files,
    retrieve_batch,
    retrieve_file,
)
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
from deepinfer_server.api.routes.count_tokens import count_tokens
from deepinfer_server.api.routes.generation import CHAT, COMPLETIONS, MESSAGES, RESPONSES, generate
from deepinfer_server.api.routes.message_batches import (
    cancel_message_batch,
    create_message_batch,
    delete_message_batch,
    list_message_batches,
    message_batch_results,
    retrieve_message_batch,
)
from deepinfer_server.api.routes.meta import health, metrics, root, server_version
from deepinfer_server.api.routes.models import list_models, retrieve_model
from deepinfer_server.api.routes.openapi import openapi_json
from deepinfer_server.api.routes.router_info import get_load, model_info, server_info
from deepinfer_server.api.routes.stored_responses import (
    cancel_response,
    delete_response,
    list_input_items,
    retrieve_response,
)
from deepinfer_server.api.routes.tokenization import (
    detokenize_route,
    tokenize_route,
    tokenizer_info_route,
)
from deepinfer_server.openapi import operations as op
from deepinfer_server.openapi.schema import Schema, one_of, ref
from deepinfer_server.protocol.responses.stored import ITEMS_INCLUDE, RESPONSE_INCLUDE

Handler = Callable[[Request], Awaitable[Response]]

_OPENAI = "OpenAIError"
_ANTHROPIC = "AnthropicError"


@dataclass(frozen=True, eq=False)
class Endpoint:
    """One method on one path: its handler, the API its clients speak, its OpenAPI operation."""

    #: The Starlette path (converters such as `{model_id:path}` allowed).
    path: str
    method: str
    handler: Handler
    dialect: Dialect
    operation: Schema

    @cached_property
    def openapi_path(self) -> str:
        """The path as OpenAPI writes it (no converters)."""
        return compile_path(self.path)[1]


def _with(operation: Schema, *parameters: Schema) -> Schema:
    return {**operation, "parameters": list(parameters)}


#: Every endpoint, in the order the app matches them and the document lists them.
ROUTES: tuple[Endpoint, ...] = (
    Endpoint(
        "/v1/chat/completions",
        "POST",
        generate(CHAT),
        Dialect.OPENAI,
        op.generation("OpenAI Chat Completions", "ChatCompletionRequest", _OPENAI),
    ),
    Endpoint(
        "/v1/completions",
        "POST",
        generate(COMPLETIONS),
        Dialect.OPENAI,
        op.generation(
            "OpenAI legacy completions, as vLLM serves them", "CompletionRequest", _OPENAI
        ),
    ),
    Endpoint(
        "/v1/responses",
        "POST",
        generate(RESPONSES),
        Dialect.OPENAI,
        op.generation("OpenAI Responses (stored unless store: false)", "ResponsesRequest", _OPENAI),
    ),
    Endpoint(
        "/v1/responses/{response_id}",
        "GET",
        retrieve_response,
        Dialect.OPENAI,
        _with(
            op.get(
                "A stored response (a background one's events again with stream=true); 404 "
                "in another API key's scope",
                {**op.JSON_OBJECT, **op.STREAM},
                protected=True,
            ),
            op.RESPONSE_ID,
            op.include(RESPONSE_INCLUDE),
            *op.STREAM_AGAIN,
        ),
    ),
    Endpoint(
        "/v1/responses/{response_id}/cancel",
        "POST",
        cancel_response,
        Dialect.OPENAI,
        _with(op.cancel("Cancel a background response still running"), op.RESPONSE_ID),
    ),
    Endpoint(
        "/v1/responses/{response_id}",
        "DELETE",
        delete_response,
        Dialect.OPENAI,
        _with(op.get("Delete a stored response", protected=True), op.RESPONSE_ID),
    ),
    Endpoint(
        "/v1/responses/{response_id}/input_items",
        "GET",
        list_input_items,
        Dialect.OPENAI,
        _with(
            op.get("A stored response's input items, a page at a time", protected=True),
            op.RESPONSE_ID,
            op.include(ITEMS_INCLUDE),
            *op.PAGE,
        ),
    ),
    Endpoint(
        "/v1/conversations",
        "POST",
        create_conversation,
        Dialect.OPENAI,
        op.post_object(
            "Create a conversation (OpenAI's Conversations API)", "ConversationCreateRequest"
        ),
    ),
    Endpoint(
        "/v1/conversations/{conversation_id}",
        "GET",
        retrieve_conversation,
        Dialect.OPENAI,
        _with(
            op.get("A conversation; 404 in another API key's scope", protected=True),
            op.CONVERSATION_ID,
        ),
    ),
    Endpoint(
        "/v1/conversations/{conversation_id}",
        "POST",
        update_conversation,
        Dialect.OPENAI,
        _with(
            op.post_object("Replace a conversation's metadata", "ConversationUpdateRequest"),
            op.CONVERSATION_ID,
        ),
    ),
    Endpoint(
        "/v1/conversations/{conversation_id}",
        "DELETE",
        delete_conversation,
        Dialect.OPENAI,
        _with(op.get("Delete a conversation and its items", protected=True), op.CONVERSATION_ID),
    ),
    Endpoint(
        "/v1/conversations/{conversation_id}/items",
        "GET",
        list_items,
        Dialect.OPENAI,
        _with(
            op.get("A conversation's items, a page at a time", protected=True),
            op.CONVERSATION_ID,
            op.include(ITEMS_INCLUDE),
            *op.PAGE,
        ),
    ),
    Endpoint(
        "/v1/conversations/{conversation_id}/items",
        "POST",
        create_items,
        Dialect.OPENAI,
        _with(
            op.post_object("Add up to 20 items to a conversation", "ConversationItemsRequest"),
            op.CONVERSATION_ID,
            op.include(ITEMS_INCLUDE),
        ),
    ),
    Endpoint(
        "/v1/conversations/{conversation_id}/items/{item_id}",
        "GET",
        retrieve_item,
        Dialect.OPENAI,
        _with(
            op.get("One item of a conversation", protected=True),
            op.CONVERSATION_ID,
            op.ITEM_ID,
            op.include(ITEMS_INCLUDE),
        ),
    ),
    Endpoint(
        "/v1/conversations/{conversation_id}/items/{item_id}",
        "DELETE",
        delete_item,
        Dialect.OPENAI,
        _with(
            op.get("Delete an item of a conversation (answers the conversation)", protected=True),
            op.CONVERSATION_ID,
            op.ITEM_ID,
        ),
    ),
    Endpoint(
        "/v1/files",
        "POST",
        create_file,
        Dialect.OPENAI,
        op.upload("Upload a batch input file (JSONL, purpose 'batch')", "FileUpload"),
    ),
    Endpoint(
        "/v1/files",
        "GET",
        list_files,
        Dialect.OPENAI,
        _with(op.get("The API key's files, newest first", protected=True), op.PURPOSE, *op.PAGE),
    ),
    Endpoint(
        "/v1/files/{file_id}",
        "GET",
        retrieve_file,
        Dialect.OPENAI,
        _with(op.get("A file", protected=True), op.FILE_ID),
    ),
    Endpoint(
        "/v1/files/{file_id}/content",
        "GET",
        file_content,
        Dialect.OPENAI,
        _with(
            op.get(
                "A file's content (a batch's output and error files: JSONL)",
                {"application/jsonl": {"schema": {"type": "string"}}},
                protected=True,
            ),
            op.FILE_ID,
        ),
    ),
    Endpoint(
        "/v1/files/{file_id}",
        "DELETE",
        delete_file,
        Dialect.OPENAI,
        _with(op.get("Delete a file", protected=True), op.FILE_ID),
    ),
    Endpoint(
        "/v1/batches",
        "POST",
        create_batch,
        Dialect.OPENAI,
        op.post_object(
            "Create a batch from an input file, run at the lowest priority (input_file_id, "
            "endpoint, completion_window '24h', metadata)",
            "BatchRequest",
        ),
    ),
    Endpoint(
        "/v1/batches",
        "GET",
        list_batches,
        Dialect.OPENAI,
        _with(op.get("The API key's batches, newest first", protected=True), *op.PAGE),
    ),
    Endpoint(
        "/v1/batches/{batch_id}",
        "GET",
        retrieve_batch,
        Dialect.OPENAI,
        _with(op.get("A batch, with its request_counts", protected=True), op.BATCH_ID),
    ),
    Endpoint(
        "/v1/batches/{batch_id}/cancel",
        "POST",
        cancel_batch,
        Dialect.OPENAI,
        _with(op.cancel("Cancel a batch (cancelling, then cancelled)"), op.BATCH_ID),
    ),
    Endpoint(
        "/v1/messages",
        "POST",
        generate(MESSAGES),
        Dialect.ANTHROPIC,
        op.generation("Anthropic Messages", "MessagesRequest", _ANTHROPIC),
    ),
    Endpoint(
        "/v1/messages/batches",
        "POST",
        create_message_batch,
        Dialect.ANTHROPIC,
        op.post_object(
            "Create a message batch of requests: [{custom_id, params}], run at the lowest priority",
            "MessageBatchRequest",
            _ANTHROPIC,
        ),
    ),
    Endpoint(
        "/v1/messages/batches",
        "GET",
        list_message_batches,
        Dialect.ANTHROPIC,
        _with(
            op.get(
                "The API key's message batches, newest first", protected=True, envelope=_ANTHROPIC
            ),
            op.AFTER_ID,
            op.PAGE[1],
        ),
    ),
    Endpoint(
        "/v1/messages/batches/{batch_id}",
        "GET",
        retrieve_message_batch,
        Dialect.ANTHROPIC,
        _with(
            op.get("A message batch, with its request_counts", protected=True, envelope=_ANTHROPIC),
            op.BATCH_ID,
        ),
    ),
    Endpoint(
        "/v1/messages/batches/{batch_id}",
        "DELETE",
        delete_message_batch,
        Dialect.ANTHROPIC,
        _with(
            op.get("Delete an ended message batch", protected=True, envelope=_ANTHROPIC),
            op.BATCH_ID,
        ),
    ),
    Endpoint(
        "/v1/messages/batches/{batch_id}/cancel",
        "POST",
        cancel_message_batch,
        Dialect.ANTHROPIC,
        _with(op.cancel("Cancel a message batch (canceling, then ended)", _ANTHROPIC), op.BATCH_ID),
    ),
    Endpoint(
        "/v1/messages/batches/{batch_id}/results",
        "GET",
        message_batch_results,
        Dialect.ANTHROPIC,
        _with(
            op.get(
                "An ended message batch's results (JSONL)",
                {"application/x-jsonl": {"schema": {"type": "string"}}},
                protected=True,
                envelope=_ANTHROPIC,
            ),
            op.BATCH_ID,
        ),
    ),
    Endpoint(
        "/v1/messages/count_tokens",
        "POST",
        count_tokens,
        Dialect.ANTHROPIC,
        op.count_tokens(
            "Anthropic token count: the prompt tokens /v1/messages would encode", _ANTHROPIC
        ),
    ),
    Endpoint(
        "/v1/models",
        "GET",
        list_models,
        Dialect.EITHER,
        op.get(
            "The served models with their context window, max_model_len (Anthropic's shape "
            "with an anthropic-version header)",
            op.json_content(one_of(ref("ModelList"), ref("AnthropicModelList"))),
            protected=True,
        ),
    ),
    Endpoint(
        "/v1/models/{model_id:path}",
        "GET",
        retrieve_model,
        Dialect.EITHER,
        _with(
            op.get(
                "One served model; 404 for a name not served",
                op.json_content(one_of(ref("Model"), ref("AnthropicModel"))),
                protected=True,
            ),
            op.MODEL_ID,
        ),
    ),
    Endpoint(
        "/tokenize",
        "POST",
        tokenize_route,
        Dialect.OPENAI,
        op.post_json(
            "vLLM's tokenize: a prompt, or Chat messages rendered as /v1/chat/completions renders "
            "them (count is that request's prompt_tokens)",
            "TokenizeRequest",
            "TokenizeResponse",
        ),
    ),
    Endpoint(
        "/detokenize",
        "POST",
        detokenize_route,
        Dialect.OPENAI,
        op.post_json(
            "vLLM's detokenize: token IDs to text", "DetokenizeRequest", "DetokenizeResponse"
        ),
    ),
    Endpoint(
        "/tokenizer_info",
        "GET",
        tokenizer_info_route,
        Dialect.OPENAI,
        op.get(
            "vLLM's tokenizer_info: the tokenizer's configuration (special tokens, class)",
            op.json_content(ref("TokenizerInfo")),
            protected=True,
        ),
    ),
    Endpoint(
        "/",
        "GET",
        root,
        Dialect.OPENAI,
        op.get(
            "The server's name, version and starting links (HEAD / answers 200 without a body)",
            op.json_content(ref("ServerRoot")),
        ),
    ),
    Endpoint(
        "/health", "GET", health, Dialect.OPENAI, op.get("200 {status: ok}, else 503 with a reason")
    ),
    Endpoint(
        "/metrics",
        "GET",
        metrics,
        Dialect.OPENAI,
        op.get("Prometheus metrics", {"text/plain": {"schema": {"type": "string"}}}),
    ),
    Endpoint(
        "/version",
        "GET",
        server_version,
        Dialect.OPENAI,
        op.get("Server, deepseek-recipe and DeepInfer versions"),
    ),
    Endpoint(
        "/get_load",
        "GET",
        get_load,
        Dialect.OPENAI,
        _with(
            op.get("Requests running and waiting, as vLLM Router or the SGLang gateway reads them"),
            op.LOAD_FORMAT,
        ),
    ),
    Endpoint(
        "/server_info",
        "GET",
        server_info,
        Dialect.OPENAI,
        op.get("What the SGLang gateway reads when registering a worker"),
    ),
    Endpoint(
        "/get_server_info", "GET", server_info, Dialect.OPENAI, op.get("Alias of /server_info")
    ),
    Endpoint(
        "/model_info", "GET", model_info, Dialect.OPENAI, op.get("The SGLang gateway's model info")
    ),
    Endpoint("/get_model_info", "GET", model_info, Dialect.OPENAI, op.get("Alias of /model_info")),
    Endpoint("/openapi.json", "GET", openapi_json, Dialect.OPENAI, op.get("This document")),
)
