"""POST /tokenize, POST /detokenize and GET /tokenizer_info: vLLM's tokenizer endpoints
(`protocol/tokenization`), behind the API keys as the /v1 routes are."""

from __future__ import annotations

from collections.abc import Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from deepinfer_server.api.auth import tenant_of
from deepinfer_server.api.body import read_json_body
from deepinfer_server.api.state import AppState
from deepinfer_server.protocol.core.json_types import JsonObject
from deepinfer_server.protocol.core.recipe import RecipeContext
from deepinfer_server.protocol.tokenization.request import detokenize, tokenize, tokenizer_info


async def tokenize_route(request: Request) -> Response:
    """POST /tokenize: the body's prompt or messages as tokens."""
    return await _answer(request, tokenize)


async def detokenize_route(request: Request) -> Response:
    """POST /detokenize: the body's tokens as text."""
    return await _answer(request, detokenize)


async def tokenizer_info_route(request: Request) -> Response:
    """GET /tokenizer_info: the tokenizer's configuration."""
    state: AppState = request.app.state.server
    return JSONResponse(tokenizer_info(state.recipe))


async def _answer(
    request: Request, prepare: Callable[[JsonObject, RecipeContext], JsonObject]
) -> Response:
    """The JSON body read and answered by `prepare` (a large one on a preparation worker,
    in turn between API keys, as a generation request's is prepared)."""
    state: AppState = request.app.state.server
    received = await read_json_body(request, state.config, state.receiving)
    answer = await state.prepare_body(
        prepare, received.value, len(received.raw), tenant_of(request.state)
    )
    return JSONResponse(answer)
