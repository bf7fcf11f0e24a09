"""POST /tokenize, POST /detokenize and GET /tokenizer_info: vLLM's tokenizer endpoints
(`protocol/tokenization`), behind the API keys as the /v1 routes are."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from deepinfer_server.api.auth import tenant_of
from deepinfer_server.api.body import read_json_body
from deepinfer_server.api.state import AppState
from deepinfer_server.protocol.tokenization.request import detokenize, tokenize, tokenizer_info


async def tokenize_route(request: Request) -> Response:
    state: AppState = request.app.state.server
    received = await read_json_body(request, state.config, state.receiving)
    answer = await state.prepare_body(
        tokenize, received.value, len(received.raw), tenant_of(request.state)
    )
    return JSONResponse(answer)


async def detokenize_route(request: Request) -> Response:
    state: AppState = request.app.state.server
    received = await read_json_body(request, state.config, state.receiving)
    answer = await state.prepare_body(
        detokenize, received.value, len(received.raw), tenant_of(request.state)
    )
    return JSONResponse(answer)


async def tokenizer_info_route(request: Request) -> Response:
    state: AppState = request.app.state.server
    return JSONResponse(tokenizer_info(state.recipe))
