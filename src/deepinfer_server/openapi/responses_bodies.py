"""The OpenAI Responses API's request bodies (`POST /v1/responses`) and the conversations'
(`/v1/conversations`), whose items are Responses input items."""

from __future__ import annotations

from deepinfer_server.openapi.fields import (
    ANY_OBJECT,
    FUNCTION_FIELDS,
    JSON_SCHEMA,
    MODEL,
    PROMPT_CACHE_RETENTION,
    REASONING_EFFORTS,
    RECIPE_MAX_TOKENS,
    SERVER_EXTENSIONS,
    STREAM,
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
from deepinfer_server.protocol.core.sampling import Api
from deepinfer_server.protocol.responses.request import INPUT_ITEM_TYPES, ResponsesBody

_RESPONSES_TOOL = obj(
    {
        "type": string(description="function, or a tool type deepseek-recipe supports"),
        **FUNCTION_FIELDS,
    },
    ("type",),
)
_RESPONSES_INPUT_ITEM = obj(
    {
        "type": string(enum=sorted(INPUT_ITEM_TYPES)),
        "role": string(enum=["user", "assistant", "system", "developer"]),
        "content": one_of(string(), array(ANY_OBJECT)),
        "encrypted_content": nullable(string()),
        "summary": array(ANY_OBJECT),
        "call_id": string(description="function_call, custom_tool_call and their outputs"),
        "name": string(),
        "arguments": string(description="function_call: the arguments as JSON text"),
        "input": string(description="custom_tool_call: the tool's input"),
        "output": one_of(string(), array(ANY_OBJECT)),
    },
    description="An item without `type` is a message",
)
_RESPONSES_FORMAT = obj(
    {
        "type": string(enum=["text", "json_object", "json_schema"]),
        "name": string(),
        "schema": JSON_SCHEMA,
        "strict": boolean(),
    },
    ("type",),
)

RESPONSES: Schema = obj(
    {
        "model": MODEL,
        "input": one_of(string(), array(_RESPONSES_INPUT_ITEM)),
        "instructions": nullable(string()),
        "max_output_tokens": nullable(integer(1, RECIPE_MAX_TOKENS)),
        **typed_fields(ResponsesBody, Api.RESPONSES, described=TYPED_DESCRIPTIONS),
        "stream": nullable(STREAM),
        "tools": nullable(array(_RESPONSES_TOOL)),
        "tool_choice": nullable(
            one_of(
                string(enum=["auto", "none", "required"]),
                obj({"type": string(enum=["function"]), "name": string()}, ("type", "name")),
            )
        ),
        "parallel_tool_calls": nullable(boolean()),
        "text": nullable(obj({"format": _RESPONSES_FORMAT})),
        "reasoning": nullable(
            obj(
                {
                    "effort": nullable(string(enum=list(REASONING_EFFORTS))),
                    "summary": nullable(string(enum=["auto", "concise", "detailed"])),
                }
            )
        ),
        "include": nullable(array(string())),
        "n": nullable(integer(1, 1, "The Responses API has no n")),
        "store": nullable(
            {
                "type": "boolean",
                "description": "Store the response (default true, as OpenAI); true is a 400 "
                "on a server without a store (--response-store none)",
            }
        ),
        "background": nullable(
            {
                "type": "boolean",
                "description": "Generate detached from the request (queued, then polled with "
                "GET, cancelled with POST .../cancel, a stream resumed with starting_after); "
                "needs the store, runs at the lowest priority",
            }
        ),
        "previous_response_id": nullable(
            {
                "type": "string",
                "description": "Continue a stored response (its whole conversation comes first)",
            }
        ),
        "conversation": nullable(
            one_of(
                string(),
                obj({"id": string()}, ("id",)),
                description="A conversation (its ID, or {id}): its items come before `input`, "
                "and the turn's input and output are appended to it; not with "
                "previous_response_id; needs the store",
            )
        ),
        "metadata": nullable(ANY_OBJECT),
        "prompt_cache_retention": PROMPT_CACHE_RETENTION,
        "user": string(),
        **SERVER_EXTENSIONS,
    },
    ("model",),
    "`input` or `instructions` must be given",
)
RESPONSES["anyOf"] = [{"required": ["input"]}, {"required": ["instructions"]}]

_METADATA: Schema = {
    "type": "object",
    "maxProperties": 16,
    "propertyNames": {"maxLength": 64},
    "additionalProperties": string(maxLength=512),
}
_CONVERSATION_ITEMS = array(_RESPONSES_INPUT_ITEM, 0, 20)
CONVERSATION_CREATE: Schema = obj(
    {"items": nullable(_CONVERSATION_ITEMS), "metadata": nullable(_METADATA)},
    (),
    "A new conversation: up to 20 first items and its metadata",
)
CONVERSATION_UPDATE: Schema = obj(
    {"metadata": nullable(_METADATA)}, ("metadata",), "The conversation's new metadata"
)
CONVERSATION_ITEMS: Schema = obj(
    {"items": array(_RESPONSES_INPUT_ITEM, 1, 20)},
    ("items",),
    "Items to add at the end of a conversation (up to 20)",
)
