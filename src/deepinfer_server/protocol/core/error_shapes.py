"""Each protocol's error envelope, built from the one table in `errors.ERROR_TABLE`.

OpenAI (Chat Completions, and Responses before its stream starts): `{"error": {message, type,
param, code}}`. Anthropic: `{"type": "error", "error": {type, message}}`, plus
`details.error_code` for the errors Anthropic's SDK tells apart by it. A Responses stream
that fails mid-way ends with an `error` event: `{type, code, message, param, sequence_number}`.
"""

from __future__ import annotations

from deepinfer_server.errors import ApiError
from deepinfer_server.protocol.core.json_types import JsonObject


def openai_error_body(error: ApiError) -> JsonObject:
    """OpenAI's error envelope."""
    return {
        "error": {
            "message": error.message,
            "type": error.spec.openai_type,
            "param": error.param,
            "code": error.code,
        }
    }


def anthropic_error_body(error: ApiError) -> JsonObject:
    """Anthropic's error shape."""
    body: JsonObject = {"type": error.spec.anthropic_type, "message": error.message}
    if error.spec.anthropic_code is not None:
        body["details"] = {"error_code": error.spec.anthropic_code}
    return {"type": "error", "error": body}


def responses_error_event(error: ApiError) -> JsonObject:
    """The Responses API's `error` stream event."""
    return {
        "type": "error",
        "code": error.code or error.spec.openai_type,
        "message": error.message,
        "param": error.param,
        "sequence_number": 0,
    }
