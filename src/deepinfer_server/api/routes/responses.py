"""POST /v1/responses (OpenAI Responses API; JSON and named SSE events, no [DONE])."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from deepinfer_server.api.serving import GenerationProtocol, json_frame, serve_generation
from deepinfer_server.errors import ApiError
from deepinfer_server.protocol.responses import prepare_responses, responses_output


def _joined(payloads: list[str]) -> bytes:
    return "".join(payloads).encode()


def _error_frame(error: ApiError) -> bytes:
    body = {
        "type": "error",
        "code": error.code or error.error_type,
        "message": error.message,
        "param": error.param,
        "sequence_number": 0,
    }
    return json_frame("error", body)


RESPONSES = GenerationProtocol(
    id_prefix="resp_",
    prepare=prepare_responses,
    make_output=responses_output,
    frames=_joined,
    done_frame=b"",
    error_frame=_error_frame,
)


async def responses(request: Request) -> Response:
    return await serve_generation(request, RESPONSES)
