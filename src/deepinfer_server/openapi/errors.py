"""The error responses of each protocol, from the one error table (`errors.ERROR_TABLE`)."""

from __future__ import annotations

from deepinfer_server.errors import ERROR_TABLE, ErrorKind
from deepinfer_server.openapi.schema import Schema, nullable, obj, ref, string

#: Never sent: the client has left by then.
_NOT_SENT = frozenset({ErrorKind.CLIENT_DISCONNECTED})


def _anthropic_codes() -> list[str]:
    return sorted({spec.anthropic_code for spec in ERROR_TABLE.values() if spec.anthropic_code})


OPENAI_ERROR: Schema = obj(
    {
        "error": obj(
            {
                "message": string(),
                "type": string(enum=sorted({spec.openai_type for spec in ERROR_TABLE.values()})),
                "param": nullable(string()),
                "code": nullable(string()),
            },
            ("message", "type", "param", "code"),
        )
    },
    ("error",),
    "OpenAI's error envelope (Chat Completions, Completions, Responses and the GET routes)",
)

ANTHROPIC_ERROR: Schema = obj(
    {
        "type": string(enum=["error"]),
        "error": obj(
            {
                "type": string(enum=sorted({spec.anthropic_type for spec in ERROR_TABLE.values()})),
                "message": string(),
                "details": obj(
                    {"error_code": string(enum=_anthropic_codes())},
                    ("error_code",),
                    "Only for the errors Anthropic's SDK tells apart by their code",
                ),
            },
            ("type", "message"),
        ),
    },
    ("type", "error"),
    "Anthropic's error shape (/v1/messages and /v1/messages/count_tokens)",
)

ERROR_SCHEMAS: dict[str, Schema] = {"OpenAIError": OPENAI_ERROR, "AnthropicError": ANTHROPIC_ERROR}


def error_statuses() -> list[int]:
    """Every HTTP status an error of this server can have, ascending."""
    kinds = (kind for kind in ERROR_TABLE if kind not in _NOT_SENT)
    return sorted({ERROR_TABLE[kind].status for kind in kinds})


def _what(status: int) -> str:
    codes = sorted(
        str(spec.openai_code)
        for kind, spec in ERROR_TABLE.items()
        if spec.status == status and kind not in _NOT_SENT
    )
    return "Error: " + ", ".join(codes)


def error_responses(envelope: str) -> dict[str, Schema]:
    """The OpenAPI responses for every error status, each in `envelope` (a component name)."""
    body = {"application/json": {"schema": ref(envelope)}}
    return {
        str(status): {"description": _what(status), "content": body} for status in error_statuses()
    }
