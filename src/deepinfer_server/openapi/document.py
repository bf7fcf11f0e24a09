"""The server's OpenAPI 3.1 document (served at GET /openapi.json).

`OPERATIONS` describes every route the app serves; tests/test_openapi.py checks that it and the
Starlette app's routes are the same set, so a route cannot be added without its description.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from deepinfer_server import __version__
from deepinfer_server.openapi.errors import ERROR_SCHEMAS, error_responses
from deepinfer_server.openapi.requests import REQUEST_BODIES, request_body
from deepinfer_server.openapi.schema import Schema

_JSON_OBJECT = {"application/json": {"schema": {"type": "object"}}}
_STREAM = {"text/event-stream": {"schema": {"type": "string"}}}
_BEARER: list[dict[str, list[str]]] = [{"bearer": []}, {"apiKey": []}]


def _generation(summary: str, body: str, envelope: str) -> Schema:
    return {
        "summary": summary,
        "requestBody": request_body(body),
        "responses": {
            "200": {
                "description": "The answer as JSON, or as server-sent events with stream: true",
                "content": {**_JSON_OBJECT, **_STREAM},
            },
            **error_responses(envelope),
        },
        "security": _BEARER,
    }


def _get(summary: str, content: dict[str, Any] | None = None, *, protected: bool = False) -> Schema:
    operation: Schema = {
        "summary": summary,
        "responses": {
            "200": {"description": "OK", "content": content or _JSON_OBJECT},
            "default": {
                "description": "An error in OpenAI's envelope",
                "content": {
                    "application/json": {"schema": {"$ref": "#/components/schemas/OpenAIError"}}
                },
            },
        },
    }
    if protected:
        operation["security"] = _BEARER
    return operation


_MODEL_ID = {"name": "model_id", "in": "path", "required": True, "schema": {"type": "string"}}
_RESPONSE_ID = {"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}}
_INCLUDE = {
    "name": "include",
    "in": "query",
    "required": False,
    "schema": {"type": "array", "items": {"type": "string"}},
}
_PAGE = [
    {"name": "after", "in": "query", "required": False, "schema": {"type": "string"}},
    {
        "name": "limit",
        "in": "query",
        "required": False,
        "schema": {"type": "integer", "minimum": 1, "maximum": 100},
    },
    {
        "name": "order",
        "in": "query",
        "required": False,
        "schema": {"type": "string", "enum": ["asc", "desc"]},
    },
]
_LOAD_FORMAT = {
    "name": "format",
    "in": "query",
    "required": False,
    "schema": {"type": "string", "enum": ["vllm", "sglang"]},
}

#: (method, path) → operation. Paths as OpenAPI writes them (no Starlette converters).
OPERATIONS: dict[tuple[str, str], Schema] = {
    ("post", "/v1/chat/completions"): _generation(
        "OpenAI Chat Completions", "ChatCompletionRequest", "OpenAIError"
    ),
    ("post", "/v1/completions"): _generation(
        "OpenAI legacy completions, as vLLM serves them", "CompletionRequest", "OpenAIError"
    ),
    ("post", "/v1/responses"): _generation(
        "OpenAI Responses (stored unless store: false)", "ResponsesRequest", "OpenAIError"
    ),
    ("get", "/v1/responses/{response_id}"): {
        **_get("A stored response; 404 in another API key's scope", protected=True),
        "parameters": [_RESPONSE_ID, _INCLUDE],
    },
    ("delete", "/v1/responses/{response_id}"): {
        **_get("Delete a stored response", protected=True),
        "parameters": [_RESPONSE_ID],
    },
    ("get", "/v1/responses/{response_id}/input_items"): {
        **_get("A stored response's input items, a page at a time", protected=True),
        "parameters": [_RESPONSE_ID, _INCLUDE, *_PAGE],
    },
    ("post", "/v1/messages"): _generation(
        "Anthropic Messages", "MessagesRequest", "AnthropicError"
    ),
    ("post", "/v1/messages/count_tokens"): {
        "summary": "Anthropic token count: the prompt tokens /v1/messages would encode",
        "requestBody": request_body("CountTokensRequest"),
        "responses": {
            "200": {
                "description": "The count",
                "content": {
                    "application/json": {
                        "schema": {
                            "type": "object",
                            "properties": {"input_tokens": {"type": "integer", "minimum": 0}},
                            "required": ["input_tokens"],
                        }
                    }
                },
            },
            **error_responses("AnthropicError"),
        },
        "security": _BEARER,
    },
    ("get", "/v1/models"): _get(
        "The served model names (Anthropic's shape with an anthropic-version header)",
        protected=True,
    ),
    ("get", "/v1/models/{model_id}"): {
        **_get("One served model; 404 for a name not served", protected=True),
        "parameters": [_MODEL_ID],
    },
    ("get", "/health"): _get("200 {status: ok}, else 503 with a reason"),
    ("get", "/metrics"): _get("Prometheus metrics", {"text/plain": {"schema": {"type": "string"}}}),
    ("get", "/version"): _get("Server, deepseek-recipe and DeepInfer versions"),
    ("get", "/get_load"): {
        **_get("Requests running and waiting, as vLLM Router or the SGLang gateway reads them"),
        "parameters": [_LOAD_FORMAT],
    },
    ("get", "/server_info"): _get("What the SGLang gateway reads when registering a worker"),
    ("get", "/get_server_info"): _get("Alias of /server_info"),
    ("get", "/model_info"): _get("The SGLang gateway's model info"),
    ("get", "/get_model_info"): _get("Alias of /model_info"),
    ("get", "/openapi.json"): _get("This document"),
}


def _paths() -> dict[str, dict[str, Schema]]:
    paths: dict[str, dict[str, Schema]] = {}
    for (method, path), operation in OPERATIONS.items():
        paths.setdefault(path, {})[method] = operation
    return paths


def _model_name(served_model_names: tuple[str, ...]) -> Schema:
    return {
        "type": "string",
        "enum": list(served_model_names),
        "description": "A served model name (--served-model-name); any other is a 404",
    }


@cache
def openapi_document(served_model_names: tuple[str, ...]) -> dict[str, Any]:
    """The whole document for a server of these model names (built once per names; the caller
    must not change it)."""
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "deepinfer-server",
            "version": __version__,
            "description": "OpenAI- and Anthropic-compatible server for DeepSeek-V4.1-Flash",
        },
        "paths": _paths(),
        "components": {
            "schemas": {
                **REQUEST_BODIES,
                "ModelName": _model_name(served_model_names),
                **ERROR_SCHEMAS,
            },
            "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer"},
                "apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key"},
            },
        },
    }
