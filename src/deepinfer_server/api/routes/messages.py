"""POST /v1/messages (Anthropic Messages API; JSON and Anthropic SSE events)."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from deepinfer_server.api.serving import GenerationProtocol, json_frame, serve_generation
from deepinfer_server.protocol.messages import (
    anthropic_error_body,
    messages_output,
    prepare_messages,
)

MESSAGES_PATH = "/v1/messages"

MESSAGES = GenerationProtocol(
    id_prefix="msg_",
    prepare=prepare_messages,
    make_output=messages_output,
    frames=lambda payloads: "".join(payloads).encode(),
    done_frame=b"",
    error_frame=lambda error: json_frame("error", anthropic_error_body(error)),
)


async def messages(request: Request) -> Response:
    return await serve_generation(request, MESSAGES)
