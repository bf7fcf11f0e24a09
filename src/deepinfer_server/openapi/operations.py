"""The OpenAPI operation objects the route table (`api/route_table/`) declares its endpoints
with: a generation POST, a GET, and the parameters they share. Whether an operation is behind
the API keys (its `security`, `BEARER`) is declared on its route, not here."""

from __future__ import annotations

from deepinfer_server.openapi.errors import error_responses
from deepinfer_server.openapi.requests import request_body
from deepinfer_server.openapi.schema import Schema, ref

JSON_OBJECT = {"application/json": {"schema": {"type": "object"}}}
STREAM = {"text/event-stream": {"schema": {"type": "string"}}}
BEARER: list[dict[str, list[str]]] = [{"bearer": []}, {"apiKey": []}]
#: The error envelopes' components: OpenAI's, and Anthropic's for the paths that speak it.
OPENAI_ENVELOPE = "OpenAIError"
ANTHROPIC_ENVELOPE = "AnthropicError"


def json_content(schema: Schema) -> Schema:
    """A 200's `content`: `schema` as application/json."""
    return {"application/json": {"schema": schema}}


def generation(summary: str, body: str, envelope: str) -> Schema:
    """A generation POST: its `body` component, JSON or SSE, errors in `envelope`."""
    return {
        "summary": summary,
        "requestBody": request_body(body),
        "responses": {
            "200": {
                "description": "The answer as JSON, or as server-sent events with stream: true",
                "content": {**JSON_OBJECT, **STREAM},
            },
            **error_responses(envelope),
        },
    }


def get(
    summary: str,
    content: Schema | None = None,
    *,
    envelope: str = OPENAI_ENVELOPE,
) -> Schema:
    """A GET answering `content` (a JSON object by default), errors in `envelope` (OpenAI's
    by default)."""
    api = envelope.removesuffix("Error")
    operation: Schema = {
        "summary": summary,
        "responses": {
            "200": {"description": "OK", "content": content or JSON_OBJECT},
            "default": {
                "description": f"An error in {api}'s envelope",
                "content": {
                    "application/json": {"schema": {"$ref": f"#/components/schemas/{envelope}"}}
                },
            },
        },
    }
    return operation


def post_json(summary: str, body: str, response: str) -> Schema:
    """A POST of the `body` component answering the `response` component, errors in OpenAI's
    envelope."""
    return {
        "summary": summary,
        "requestBody": request_body(body),
        "responses": {
            "200": {"description": "OK", "content": json_content(ref(response))},
            **error_responses(OPENAI_ENVELOPE),
        },
    }


def count_tokens(summary: str, envelope: str) -> Schema:
    """Anthropic's token count: the `CountTokensRequest` body, `{input_tokens}`."""
    return {
        "summary": summary,
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
            **error_responses(envelope),
        },
    }


MODEL_ID = {"name": "model_id", "in": "path", "required": True, "schema": {"type": "string"}}
RESPONSE_ID = {"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}}
CONVERSATION_ID = {
    "name": "conversation_id",
    "in": "path",
    "required": True,
    "schema": {"type": "string"},
}
ITEM_ID = {"name": "item_id", "in": "path", "required": True, "schema": {"type": "string"}}


def include(supported: frozenset[str]) -> Schema:
    """The `include` query parameter of an endpoint that honours `supported` (others: a 400)."""
    return {
        "name": "include",
        "in": "query",
        "required": False,
        "schema": {"type": "array", "items": {"type": "string", "enum": sorted(supported)}},
    }


STREAM_AGAIN = [
    {"name": "stream", "in": "query", "required": False, "schema": {"type": "boolean"}},
    {"name": "starting_after", "in": "query", "required": False, "schema": {"type": "integer"}},
]
PAGE = [
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
LOAD_FORMAT = {
    "name": "format",
    "in": "query",
    "required": False,
    "schema": {"type": "string", "enum": ["vllm", "sglang"]},
}


def cancel(summary: str, envelope: str = OPENAI_ENVELOPE) -> Schema:
    """A POST without a body answering a JSON object, errors in `envelope`."""
    return get(summary, envelope=envelope)


FILE_ID = {"name": "file_id", "in": "path", "required": True, "schema": {"type": "string"}}
BATCH_ID = {"name": "batch_id", "in": "path", "required": True, "schema": {"type": "string"}}
AFTER_ID = {"name": "after_id", "in": "query", "required": False, "schema": {"type": "string"}}
PURPOSE = {"name": "purpose", "in": "query", "required": False, "schema": {"type": "string"}}


def upload(summary: str, body: str) -> Schema:
    """A multipart POST of the `body` component answering a JSON object."""
    return {
        **get(summary),
        "requestBody": {
            "required": True,
            "content": {"multipart/form-data": {"schema": ref(body)}},
        },
    }


def post_object(summary: str, body: str, envelope: str = OPENAI_ENVELOPE) -> Schema:
    """A POST of the `body` component answering a JSON object, errors in `envelope`."""
    return {**get(summary, envelope=envelope), "requestBody": request_body(body)}
