"""GET /openapi.json: the server's OpenAPI 3.1 description (open, as vLLM serves it)."""

from __future__ import annotations

from functools import cache

import orjson
from starlette.requests import Request
from starlette.responses import Response

from deepinfer_server.api.state import AppState
from deepinfer_server.openapi import openapi_document


@cache
def _document_json(served_model_names: tuple[str, ...]) -> bytes:
    return orjson.dumps(openapi_document(served_model_names))


async def openapi_json(request: Request) -> Response:
    """The document for this server's model names (serialized once per process)."""
    state: AppState = request.app.state.server
    return Response(_document_json(state.config.served_model_names), media_type="application/json")
