"""Anthropic Messages API (`POST /v1/messages`): preparation, output and error shape."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from deepseek_recipe import (
    ConversationRequest,
    MessagesRequest,
    MessagesResponse,
    StreamProcessor,
)

from deepinfer_server.errors import ApiError
from deepinfer_server.ipc.messages import SamplingOptions
from deepinfer_server.protocol.named_events import NamedEventOutput
from deepinfer_server.protocol.prepare import engine_input
from deepinfer_server.protocol.recipe import RecipeContext, recipe_errors
from deepinfer_server.protocol.validation import check_model

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


@dataclass(frozen=True)
class PreparedMessages:
    """A validated Messages request, ready for the engine."""

    request: ConversationRequest
    prompt_token_ids: list[int]
    sampling: SamplingOptions
    stream: bool


def prepare_messages(body: dict[str, Any], recipe: RecipeContext) -> PreparedMessages:
    """Turn a decoded Messages body into prompt token IDs and sampling options."""
    check_model(body, recipe.served_model_names)
    with recipe_errors():
        converted = MessagesRequest(body).convert(recipe.options)
    engine = engine_input(converted, recipe, ignore_eos=False)
    return PreparedMessages(converted, engine.prompt_token_ids, engine.sampling, converted.stream)


def messages_output(
    prepared: PreparedMessages, message_id: str, recipe: RecipeContext
) -> NamedEventOutput:
    generator = MessagesRequest.chunk_generator(prepared.request, message_id, recipe.model_name)
    processor = StreamProcessor(generator, prepared.request.parsing_options, recipe.tokenizer)
    return NamedEventOutput(
        processor,
        MessagesResponse,
        message_id,
        recipe.model_name,
        len(prepared.prompt_token_ids),
        prepared.stream,
    )


def anthropic_error_body(error: ApiError) -> dict[str, Any]:
    """Anthropic's error shape: {"type": "error", "error": {"type", "message"}}."""
    status = error.status_code
    kind = _ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": error.message}}
