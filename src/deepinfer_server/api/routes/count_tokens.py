"""POST /v1/messages/count_tokens: the prompt tokens of a Messages request, `{"input_tokens": N}`.

Claude Code calls it in interactive sessions and for `/context`; the Anthropic SDK's
`messages.count_tokens` too. Errors take Anthropic's envelope (the path is under /v1/messages).
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from deepinfer_server.api.auth import tenant_of
from deepinfer_server.api.body import read_json_body
from deepinfer_server.api.state import AppState
from deepinfer_server.protocol.messages.request import count_message_tokens


async def count_tokens(request: Request) -> Response:
    state: AppState = request.app.state.server
    received = await read_json_body(request, state.config, state.receiving)
    tokens = await state.prepare_body(
        count_message_tokens, received.value, len(received.raw), tenant_of(request.state)
    )
    return JSONResponse({"input_tokens": tokens})
