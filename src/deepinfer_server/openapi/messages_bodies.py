"""The Anthropic Messages API's request bodies (`POST /v1/messages` and its count_tokens)."""

from __future__ import annotations

from deepinfer_server.openapi.fields import (
    ANY_OBJECT,
    JSON_SCHEMA,
    MODEL,
    REASONING_EFFORTS,
    RECIPE_MAX_TOKENS,
    SERVER_EXTENSIONS,
    STREAM,
    THINKING,
    TYPED_DESCRIPTIONS,
)
from deepinfer_server.openapi.schema import (
    Schema,
    array,
    boolean,
    integer,
    nullable,
    obj,
    one_of,
    string,
)
from deepinfer_server.openapi.typed_fields import typed_fields
from deepinfer_server.protocol.completions.request import MAX_STOP_SEQUENCES
from deepinfer_server.protocol.core.sampling import Api
from deepinfer_server.protocol.core.validation import UINT32_MAX
from deepinfer_server.protocol.messages.cache_control import MAX_BREAKPOINTS
from deepinfer_server.protocol.messages.request import MessagesBody

#: A prompt-cache breakpoint: checked as Anthropic checks it, then a hint only.
_CACHE_CONTROL = nullable(
    obj(
        {"type": string(enum=["ephemeral"]), "ttl": string(enum=["5m", "1h"])},
        ("type",),
        f"At most {MAX_BREAKPOINTS} in a request; the prefix cache keeps the whole prompt "
        "pinned for the longest ttl (5m without one)",
    )
)
_TEXT_BLOCK = obj(
    {"type": string(enum=["text"]), "text": string(), "cache_control": _CACHE_CONTROL},
    ("type", "text"),
)
_MESSAGES_BLOCK = one_of(
    _TEXT_BLOCK,
    obj(
        {
            "type": string(enum=["image"]),
            "source": obj({"type": string()}, ("type",)),
            "cache_control": _CACHE_CONTROL,
        },
        ("type", "source"),
    ),
    obj(
        {"type": string(enum=["thinking"]), "thinking": string(), "signature": string()},
        ("type", "thinking"),
    ),
    obj({"type": string(enum=["redacted_thinking"]), "data": string()}, ("type", "data")),
    obj(
        {
            "type": string(enum=["tool_use"]),
            "id": string(),
            "name": string(),
            "input": ANY_OBJECT,
            "cache_control": _CACHE_CONTROL,
        },
        ("type", "id", "name", "input"),
    ),
    obj(
        {
            "type": string(enum=["tool_result"]),
            "tool_use_id": string(),
            "content": one_of(string(), array(_TEXT_BLOCK)),
            "cache_control": _CACHE_CONTROL,
        },
        ("type", "tool_use_id"),
    ),
    description="`document` blocks are not supported",
)
_ANTHROPIC_MESSAGE = obj(
    {
        "role": string(enum=["user", "assistant", "system"]),
        "content": one_of(string(), array(_MESSAGES_BLOCK)),
    },
    ("role", "content"),
)
_ANTHROPIC_TOOL = obj(
    {
        "type": string(
            pattern="^(custom$|bash_|text_editor_)",
            description="A client tool; Anthropic's server tools are a 400",
        ),
        "name": string(minLength=1),
        "description": string(),
        "input_schema": JSON_SCHEMA,
        "strict": boolean(),
        "cache_control": _CACHE_CONTROL,
    },
    ("name",),
)
_ANTHROPIC_TOOL_CHOICE = obj(
    {
        "type": string(enum=["auto", "any", "tool", "none"]),
        "name": string(),
        "disable_parallel_tool_use": boolean(),
    },
    ("type",),
)
_ANTHROPIC_FORMAT = obj(
    {"type": string(enum=["json_schema"]), "schema": JSON_SCHEMA}, ("type", "schema")
)
_MESSAGES_INPUT: dict[str, Schema] = {
    "model": MODEL,
    "messages": array(_ANTHROPIC_MESSAGE, 1),
    "system": one_of(string(), array(_TEXT_BLOCK)),
    "tools": array(_ANTHROPIC_TOOL),
    "tool_choice": _ANTHROPIC_TOOL_CHOICE,
    "thinking": THINKING,
    "output_config": obj(
        {"format": _ANTHROPIC_FORMAT, "effort": nullable(string(enum=list(REASONING_EFFORTS)))}
    ),
    "output_format": _ANTHROPIC_FORMAT,
    # Checked on count_tokens as on /v1/messages (no count depends on them).
    **typed_fields(MessagesBody, Api.MESSAGES, described=TYPED_DESCRIPTIONS),
    "n": integer(1, 1, "The Messages API has no n"),
    "thread": {
        "type": "null",
        "description": "Anthropic's message threads are not kept: any other value is a 400 "
        "whose error.details.error_code is thread_unsupported_request (the anthropic SDK then "
        "sends the whole conversation)",
    },
}

MESSAGES: Schema = obj(
    {
        **_MESSAGES_INPUT,
        "max_tokens": integer(
            1, UINT32_MAX, f"Required; above {RECIPE_MAX_TOKENS} it is lowered to that"
        ),
        "stop_sequences": array(string(), 0, MAX_STOP_SEQUENCES),
        "stream": STREAM,
        "metadata": obj({"user_id": nullable(string())}),
        **SERVER_EXTENSIONS,
    },
    ("model", "max_tokens", "messages"),
)

COUNT_TOKENS: Schema = obj(_MESSAGES_INPUT, ("model", "messages"))
