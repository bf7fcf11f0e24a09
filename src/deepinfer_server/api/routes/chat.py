"""POST /v1/chat/completions (JSON and SSE)."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from deepinfer_server.api.serving import GenerationProtocol, json_frame, serve_generation
from deepinfer_server.api.sse import DONE_FRAME, data_frames
from deepinfer_server.protocol.chat_output import ChatOutput
from deepinfer_server.protocol.chat_request import prepare_chat

CHAT = GenerationProtocol(
    id_prefix="chatcmpl-",
    prepare=prepare_chat,
    make_output=ChatOutput,
    frames=data_frames,
    done_frame=DONE_FRAME,
    # After the stream started, an error is one `data: {"error": ...}` message, then [DONE].
    error_frame=lambda error: json_frame(None, error.to_body()),
)


async def chat_completions(request: Request) -> Response:
    return await serve_generation(request, CHAT)
