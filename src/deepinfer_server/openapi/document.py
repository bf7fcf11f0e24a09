"""The server's OpenAPI 3.1 document (served at GET /openapi.json).

Each operation is declared with its route in the route table (`api/route_table/`), so a route
cannot be added without its description.
"""

from __future__ import annotations

from collections.abc import Iterable

from deepinfer_server import __version__
from deepinfer_server.openapi.errors import ERROR_SCHEMAS
from deepinfer_server.openapi.requests import REQUEST_BODIES
from deepinfer_server.openapi.responses import RESPONSE_SCHEMAS
from deepinfer_server.openapi.schema import Schema


def _paths(operations: Iterable[tuple[str, str, Schema]]) -> dict[str, dict[str, Schema]]:
    paths: dict[str, dict[str, Schema]] = {}
    for method, path, operation in operations:
        paths.setdefault(path, {})[method] = operation
    return paths


def _model_name(served_model_names: tuple[str, ...]) -> Schema:
    return {
        "type": "string",
        "enum": list(served_model_names),
        "description": "A served model name (--served-model-name); any other is a 404",
    }


def build_document(
    served_model_names: tuple[str, ...], operations: Iterable[tuple[str, str, Schema]]
) -> Schema:
    """The whole document for a server of these model names serving `operations`: (method,
    path as OpenAPI writes it, operation) in the order the document lists them."""
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "deepinfer-server",
            "version": __version__,
            "description": "OpenAI- and Anthropic-compatible server for DeepSeek-V4.1-Flash",
        },
        "paths": _paths(operations),
        "components": {
            "schemas": {
                **REQUEST_BODIES,
                **RESPONSE_SCHEMAS,
                "ModelName": _model_name(served_model_names),
                **ERROR_SCHEMAS,
            },
            "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer"},
                "apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key"},
            },
        },
    }
