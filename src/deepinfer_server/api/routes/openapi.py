"""GET /openapi.json: the server's OpenAPI 3.1 description (open, as vLLM serves it)."""

from __future__ import annotations

from functools import cache
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from deepinfer_server.api.route import Endpoint
from deepinfer_server.api.state import AppState
from deepinfer_server.openapi import build_document
from deepinfer_server.openapi.operations import BEARER
from deepinfer_server.openapi.schema import Schema


@cache
def openapi_document(
    served_model_names: tuple[str, ...], endpoints: tuple[Endpoint, ...]
) -> dict[str, Any]:
    """The document of a server of these model names serving `endpoints` (the route table's
    `ROUTES`, or the table an app was built with); built once per arguments, the caller must
    not change it."""
    operations = ((e.method.lower(), e.openapi_path, _operation(e)) for e in endpoints)
    return build_document(served_model_names, operations)


def _operation(endpoint: Endpoint) -> Schema:
    """The endpoint's operation, with the API keys as its `security` when it is protected."""
    if not endpoint.protected:
        return endpoint.operation
    return {**endpoint.operation, "security": BEARER}


@cache
def _document_json(served_model_names: tuple[str, ...], endpoints: tuple[Endpoint, ...]) -> bytes:
    return orjson.dumps(openapi_document(served_model_names, endpoints))


async def openapi_json(request: Request) -> Response:
    """The document for this server's model names and routes (serialized once per process)."""
    state: AppState = request.app.state.server
    endpoints: tuple[Endpoint, ...] = request.app.state.endpoints
    return Response(
        _document_json(state.config.served_model_names, endpoints), media_type="application/json"
    )
