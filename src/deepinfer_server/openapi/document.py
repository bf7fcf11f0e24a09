"""The server's OpenAPI 3.1 document (served at GET /openapi.json).

`OPERATIONS` describes every route the app serves; tests/test_openapi.py checks that it and the
Starlette app's routes are the same set, so a route cannot be added without its description.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from deepinfer_server import __version__
from deepinfer_server.openapi.errors import ERROR_SCHEMAS, error_responses
from deepinfer_server.openapi.operations import (
    BEARER,
    INCLUDE,
    LOAD_FORMAT,
    MODEL_ID,
    PAGE,
    RESPONSE_ID,
    generation,
    get,
)
from deepinfer_server.openapi.requests import REQUEST_BODIES, request_body
from deepinfer_server.openapi.schema import Schema

#: (method, path) → operation. Paths as OpenAPI writes them (no Starlette converters).
OPERATIONS: dict[tuple[str, str], Schema] = {
    ("post", "/v1/chat/completions"): generation(
        "OpenAI Chat Completions", "ChatCompletionRequest", "OpenAIError"
    ),
    ("post", "/v1/completions"): generation(
        "OpenAI legacy completions, as vLLM serves them", "CompletionRequest", "OpenAIError"
    ),
    ("post", "/v1/responses"): generation(
        "OpenAI Responses (stored unless store: false)", "ResponsesRequest", "OpenAIError"
    ),
    ("get", "/v1/responses/{response_id}"): {
        **get("A stored response; 404 in another API key's scope", protected=True),
        "parameters": [RESPONSE_ID, INCLUDE],
    },
    ("delete", "/v1/responses/{response_id}"): {
        **get("Delete a stored response", protected=True),
        "parameters": [RESPONSE_ID],
    },
    ("get", "/v1/responses/{response_id}/input_items"): {
        **get("A stored response's input items, a page at a time", protected=True),
        "parameters": [RESPONSE_ID, INCLUDE, *PAGE],
    },
    ("post", "/v1/messages"): generation("Anthropic Messages", "MessagesRequest", "AnthropicError"),
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
        "security": BEARER,
    },
    ("get", "/v1/models"): get(
        "The served model names (Anthropic's shape with an anthropic-version header)",
        protected=True,
    ),
    ("get", "/v1/models/{model_id}"): {
        **get("One served model; 404 for a name not served", protected=True),
        "parameters": [MODEL_ID],
    },
    ("get", "/health"): get("200 {status: ok}, else 503 with a reason"),
    ("get", "/metrics"): get("Prometheus metrics", {"text/plain": {"schema": {"type": "string"}}}),
    ("get", "/version"): get("Server, deepseek-recipe and DeepInfer versions"),
    ("get", "/get_load"): {
        **get("Requests running and waiting, as vLLM Router or the SGLang gateway reads them"),
        "parameters": [LOAD_FORMAT],
    },
    ("get", "/server_info"): get("What the SGLang gateway reads when registering a worker"),
    ("get", "/get_server_info"): get("Alias of /server_info"),
    ("get", "/model_info"): get("The SGLang gateway's model info"),
    ("get", "/get_model_info"): get("Alias of /model_info"),
    ("get", "/openapi.json"): get("This document"),
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
