"""POST /v1/chat/completions, /v1/completions, /v1/responses and /v1/messages: one
GenerationProtocol each.

Chat Completions and Completions stream unnamed `data:` chunks and end with `[DONE]`; after
the stream has started an error is one `data: {"error": ...}` message. Responses and Messages
stream named events, with no `[DONE]`, and end a failed stream with their own `error` event.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response

from deepinfer_server.api.endpoint import json_frame, serve_generation
from deepinfer_server.api.generation_protocol import GenerationProtocol, P, Session
from deepinfer_server.api.sse import DONE_FRAME, data_frames
from deepinfer_server.api.store_session import open_session
from deepinfer_server.errors import ApiError
from deepinfer_server.protocol.chat.output import ChatOutput
from deepinfer_server.protocol.chat.request import prepare_chat
from deepinfer_server.protocol.completions.output import CompletionOutput
from deepinfer_server.protocol.completions.request import prepare_completion
from deepinfer_server.protocol.core.error_shapes import (
    anthropic_error_body,
    openai_error_body,
    responses_error_event,
)
from deepinfer_server.protocol.core.json_types import JsonObject
from deepinfer_server.protocol.core.recipe import RecipeContext
from deepinfer_server.protocol.messages.output import messages_output
from deepinfer_server.protocol.messages.request import prepare_messages
from deepinfer_server.protocol.responses.output import responses_output
from deepinfer_server.protocol.responses.request import prepare_responses
from deepinfer_server.services.token_stream import ProtocolOutput


def _joined(payloads: list[str]) -> bytes:
    return "".join(payloads).encode()


def _openai_error_frame(error: ApiError) -> bytes:
    return json_frame(None, openai_error_body(error))


def _data_framed(
    id_prefix: str,
    prepare: Callable[[JsonObject, RecipeContext], P | list[P]],
    make_output: Callable[[P, str, RecipeContext], ProtocolOutput],
) -> GenerationProtocol[P]:
    """An OpenAI protocol that streams unnamed `data:` chunks ending with `[DONE]`."""
    return GenerationProtocol(
        id_prefix=id_prefix,
        prepare=prepare,
        make_output=make_output,
        frames=data_frames,
        done_frame=DONE_FRAME,
        error_frame=_openai_error_frame,
    )


CHAT = _data_framed("chatcmpl-", prepare_chat, ChatOutput)
COMPLETIONS = _data_framed("cmpl-", prepare_completion, CompletionOutput)


def _event_framed(
    id_prefix: str,
    prepare: Callable[[JsonObject, RecipeContext], P | list[P]],
    make_output: Callable[[P, str, RecipeContext], ProtocolOutput],
    error_event: Callable[[ApiError], JsonObject],
    open_session: Callable[[Request, JsonObject], Awaitable[Session[P] | None]] | None = None,
) -> GenerationProtocol[P]:
    """A protocol that streams named events, with no `[DONE]`, and ends a failed stream with
    its own `error` event."""
    return GenerationProtocol(
        id_prefix=id_prefix,
        prepare=prepare,
        make_output=make_output,
        frames=_joined,
        done_frame=b"",
        error_frame=lambda error: json_frame("error", error_event(error)),
        open_session=open_session,
    )


RESPONSES = _event_framed(
    "resp_", prepare_responses, responses_output, responses_error_event, open_session
)
MESSAGES = _event_framed("msg_", prepare_messages, messages_output, anthropic_error_body)


def generate(protocol: GenerationProtocol[P]) -> Callable[[Request], Awaitable[Response]]:
    """The route handler serving `protocol` (the route table names one per endpoint)."""

    async def serve(request: Request) -> Response:
        return await serve_generation(request, protocol)

    return serve
