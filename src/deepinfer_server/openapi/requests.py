"""The request bodies of the POST APIs, as the server's validation (and deepseek-recipe's) accepts
them.

Bounds come from the constants the validation uses where the server owns them; the ones
deepseek-recipe enforces (temperature, top_p, max_tokens, the enum variants) are written here as
the recipe states them in its 400s. tests/test_openapi.py checks both directions: every body
field the protocol layer reads is described here, and every documented bound is where the
validation draws it.
"""

from __future__ import annotations

from deepinfer_server.openapi.schema import (
    Schema,
    array,
    boolean,
    boolean_false,
    integer,
    neutral,
    nullable,
    number,
    obj,
    one_of,
    ref,
    string,
)
from deepinfer_server.protocol.completions.request import MAX_LOGPROBS, MAX_STOP_SEQUENCES
from deepinfer_server.protocol.core.choices import MAX_N
from deepinfer_server.protocol.core.validation import UINT32_MAX
from deepinfer_server.protocol.responses.request import INPUT_ITEM_TYPES

#: deepseek-recipe's own bound on max_tokens (its 400: "the valid range of max_tokens is [1, N]").
RECIPE_MAX_TOKENS = 393216
#: deepseek-recipe's bound on top_k is the server's (sampling.read_top_k): a signed 32-bit int.
TOP_K_MAX = 2**31 - 1
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function", "latest_reminder")
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "ultra", "max")
THINKING_TYPES = ("adaptive", "enabled", "disabled")

#: The served names (`--served-model-name`), a component the document fills in; another is a 404.
_MODEL = ref("ModelName")
_TEMPERATURE = number(0, 2)
#: deepseek-recipe's range is (0, 1] in 32-bit floats (a 64-bit denormal rounds to 0).
_TOP_P = number(1e-9, 1)
_TOP_K = integer(-1, TOP_K_MAX, "-1 or 0 disable it (vLLM's extension)")
#: deepseek-recipe's range (the server's own check allows up to 2^64 - 1).
_SEED = integer(0, 2**63 - 1)
_STREAM = boolean()
_ANY_OBJECT: Schema = {"type": "object"}
_JSON_SCHEMA: Schema = {
    "anyOf": [{"type": "object"}, {"type": "boolean"}, {"type": "string"}],
    "description": "A JSON Schema (an object, a boolean, or its JSON text)",
}
_STOP = one_of(
    string(minLength=1), array(string(minLength=1), 1, MAX_STOP_SEQUENCES), {"type": "null"}
)
_THINKING = obj({"type": string(enum=list(THINKING_TYPES)), "budget_tokens": integer(0)})

#: Parameters the engine cannot apply, accepted at their neutral value only (sampling.py).
_NEUTRAL_SAMPLING: dict[str, Schema] = {
    "presence_penalty": neutral(0.0, "Accepted only as 0: the engine has no penalties"),
    "frequency_penalty": neutral(0.0, "Accepted only as 0: the engine has no penalties"),
    "repetition_penalty": neutral(1.0, "Accepted only as 1: the engine has no penalties"),
    "min_p": neutral(0.0, "Accepted only as 0: the engine has no min_p"),
    "logit_bias": {
        "type": "object",
        "additionalProperties": {"type": "number", "const": 0},
        "description": "Accepted only empty or with every bias 0: the engine has no logit bias",
    },
}

_STREAM_OPTIONS = obj(
    {"include_usage": boolean(), "continuous_usage_stats": boolean()},
    description="Needs `stream: true`",
)
#: stream_options without `stream: true` is a 400.
_STREAM_OPTIONS_NEED_STREAM: Schema = {
    "stream_options": {"properties": {"stream": {"const": True}}, "required": ["stream"]}
}

_FUNCTION = obj(
    {
        "name": string(minLength=1),
        "description": string(),
        "parameters": _JSON_SCHEMA,
        "strict": boolean(),
    },
    ("name",),
)
_CHAT_TOOL = obj({"type": string(enum=["function"]), "function": _FUNCTION}, ("function",))
_CHAT_TOOL_CHOICE = one_of(
    string(enum=["auto", "none", "required"]),
    obj(
        {"type": string(enum=["function"]), "function": obj({"name": string()}, ("name",))},
        ("type", "function"),
    ),
)

_CHAT_CONTENT_PART = one_of(
    obj({"type": string(enum=["text"]), "text": string()}, ("type", "text")),
    obj(
        {
            "type": string(enum=["image_url"]),
            "image_url": obj({"url": string(), "detail": string()}, ("url",)),
        },
        ("type", "image_url"),
    ),
    description="`file` parts (documents) are a 400 unsupported_content",
)
_CHAT_TOOL_CALL = obj(
    {
        "id": string(),
        "type": string(enum=["function"]),
        "function": obj({"name": string(), "arguments": string()}, ("name", "arguments")),
    },
    ("id", "type", "function"),
)
_CHAT_CONTENT = one_of(string(), array(_CHAT_CONTENT_PART))


def _chat_message(roles: list[str], content: Schema) -> Schema:
    return obj(
        {
            "role": string(enum=roles),
            "content": content,
            "name": string(),
            "reasoning_content": nullable(string()),
            "tool_calls": nullable(array(_CHAT_TOOL_CALL)),
            "tool_call_id": string(),
        },
        ("role",),
    )


#: Only an assistant message (one with tool_calls) may have null content.
_CHAT_MESSAGE = one_of(
    _chat_message(["assistant"], nullable(_CHAT_CONTENT)),
    _chat_message([r for r in CHAT_ROLES if r != "assistant"], _CHAT_CONTENT),
)
_CHAT_RESPONSE_FORMAT = obj(
    {
        "type": string(enum=["text", "json_object", "json_schema"]),
        "json_schema": obj(
            {"name": string(), "schema": _JSON_SCHEMA, "strict": boolean()}, ("schema",)
        ),
    },
    ("type",),
)
_STRUCTURED_OUTPUTS: Schema = obj(
    {
        "json": _JSON_SCHEMA,
        "regex": string(minLength=1),
        "grammar": string(minLength=1, description="EBNF (xgrammar's dialect)"),
        "choice": array(string(), 1),
        "json_object": boolean(),
    },
    description="vLLM's structured outputs: at most one of its keys",
)
_STRUCTURED_OUTPUTS["maxProperties"] = 1

CHAT_COMPLETIONS: Schema = obj(
    {
        "model": _MODEL,
        "messages": array(_CHAT_MESSAGE, 1),
        "max_tokens": nullable(integer(1, RECIPE_MAX_TOKENS)),
        "max_completion_tokens": nullable(integer(1, RECIPE_MAX_TOKENS)),
        "temperature": nullable(_TEMPERATURE),
        "top_p": nullable(_TOP_P),
        "top_k": nullable(_TOP_K),
        "seed": nullable(_SEED),
        "n": nullable(integer(1, MAX_N)),
        "stop": _STOP,
        "stream": nullable(_STREAM),
        "stream_options": nullable(_STREAM_OPTIONS),
        "logprobs": nullable(boolean()),
        "top_logprobs": nullable(integer(0, 20)),
        "ignore_eos": nullable(boolean()),
        "tools": nullable(array(_CHAT_TOOL)),
        "tool_choice": nullable(_CHAT_TOOL_CHOICE),
        "parallel_tool_calls": nullable(boolean()),
        "response_format": nullable(_CHAT_RESPONSE_FORMAT),
        "structured_outputs": nullable(_STRUCTURED_OUTPUTS),
        "guided_json": _JSON_SCHEMA,
        "guided_regex": string(minLength=1),
        "guided_grammar": string(minLength=1),
        "guided_choice": array(string(), 1),
        "thinking": nullable(_THINKING),
        "reasoning_effort": nullable(string(enum=list(REASONING_EFFORTS))),
        "user": string(),
        **_NEUTRAL_SAMPLING,
    },
    ("model", "messages"),
)
CHAT_COMPLETIONS["dependentSchemas"] = _STREAM_OPTIONS_NEED_STREAM

COMPLETIONS: Schema = obj(
    {
        "model": _MODEL,
        "prompt": one_of(
            string(),
            array(string(), 1),
            array(integer(0), 1),
            array(array(integer(0), 1), 1),
            description="Text, texts, token IDs or lists of token IDs (one choice each, times n)",
        ),
        "max_tokens": nullable(
            integer(0, UINT32_MAX, "Default 16; 0 needs echo; prompt + max_tokens must fit")
        ),
        "temperature": nullable(_TEMPERATURE),
        "top_p": nullable(number(1e-9, 1)),
        "top_k": nullable(_TOP_K),
        "seed": nullable(integer(0, 2**63 - 1)),
        "n": nullable(integer(1, MAX_N)),
        "best_of": nullable(integer(description="Only equal to n")),
        "stop": _STOP,
        "stream": nullable(_STREAM),
        "stream_options": nullable(_STREAM_OPTIONS),
        "echo": nullable(boolean()),
        "logprobs": nullable(integer(0, MAX_LOGPROBS)),
        "ignore_eos": nullable(boolean()),
        "suffix": nullable(string(enum=[""], description="Not supported: absent or empty")),
        "user": string(),
        **_NEUTRAL_SAMPLING,
    },
    ("model", "prompt"),
)
COMPLETIONS["dependentSchemas"] = _STREAM_OPTIONS_NEED_STREAM

_RESPONSES_TOOL = obj(
    {
        "type": string(description="function, or a tool type deepseek-recipe supports"),
        "name": string(minLength=1),
        "description": string(),
        "parameters": _JSON_SCHEMA,
        "strict": boolean(),
    },
    ("type",),
)
_RESPONSES_INPUT_ITEM = obj(
    {
        "type": string(enum=sorted(INPUT_ITEM_TYPES)),
        "role": string(enum=["user", "assistant", "system", "developer"]),
        "content": one_of(string(), array(_ANY_OBJECT)),
        "encrypted_content": nullable(string()),
        "summary": array(_ANY_OBJECT),
        "call_id": string(description="function_call, custom_tool_call and their outputs"),
        "name": string(),
        "arguments": string(description="function_call: the arguments as JSON text"),
        "input": string(description="custom_tool_call: the tool's input"),
        "output": one_of(string(), array(_ANY_OBJECT)),
    },
    description="An item without `type` is a message",
)
_RESPONSES_FORMAT = obj(
    {
        "type": string(enum=["text", "json_object", "json_schema"]),
        "name": string(),
        "schema": _JSON_SCHEMA,
        "strict": boolean(),
    },
    ("type",),
)

RESPONSES: Schema = obj(
    {
        "model": _MODEL,
        "input": one_of(string(), array(_RESPONSES_INPUT_ITEM)),
        "instructions": nullable(string()),
        "max_output_tokens": nullable(integer(1, RECIPE_MAX_TOKENS)),
        "temperature": nullable(_TEMPERATURE),
        "top_p": nullable(_TOP_P),
        "stream": nullable(_STREAM),
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
        "background": nullable(boolean_false("background responses are not supported")),
        "previous_response_id": nullable(
            {
                "type": "string",
                "description": "Continue a stored response (its whole conversation comes first)",
            }
        ),
        "conversation": {
            "type": "null",
            "description": "Not supported: the Conversations API is not served",
        },
        "metadata": nullable(_ANY_OBJECT),
        "user": string(),
    },
    ("model",),
    "`input` or `instructions` must be given",
)
RESPONSES["anyOf"] = [{"required": ["input"]}, {"required": ["instructions"]}]

_TEXT_BLOCK = obj({"type": string(enum=["text"]), "text": string()}, ("type", "text"))
_MESSAGES_BLOCK = one_of(
    _TEXT_BLOCK,
    obj(
        {"type": string(enum=["image"]), "source": obj({"type": string()}, ("type",))},
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
            "input": _ANY_OBJECT,
        },
        ("type", "id", "name", "input"),
    ),
    obj(
        {
            "type": string(enum=["tool_result"]),
            "tool_use_id": string(),
            "content": one_of(string(), array(_TEXT_BLOCK)),
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
        "input_schema": _JSON_SCHEMA,
        "strict": boolean(),
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
    {"type": string(enum=["json_schema"]), "schema": _JSON_SCHEMA}, ("type", "schema")
)
_MESSAGES_INPUT: dict[str, Schema] = {
    "model": _MODEL,
    "messages": array(_ANTHROPIC_MESSAGE, 1),
    "system": one_of(string(), array(_TEXT_BLOCK)),
    "tools": array(_ANTHROPIC_TOOL),
    "tool_choice": _ANTHROPIC_TOOL_CHOICE,
    "thinking": _THINKING,
    "output_config": obj({"format": _ANTHROPIC_FORMAT}),
    "output_format": _ANTHROPIC_FORMAT,
    "top_k": _TOP_K,
    "n": integer(1, 1, "The Messages API has no n"),
}

MESSAGES: Schema = obj(
    {
        **_MESSAGES_INPUT,
        "max_tokens": integer(
            1, UINT32_MAX, f"Required; above {RECIPE_MAX_TOKENS} it is lowered to that"
        ),
        "temperature": _TEMPERATURE,
        "top_p": _TOP_P,
        "stop_sequences": array(string(), 0, MAX_STOP_SEQUENCES),
        "stream": _STREAM,
        "metadata": obj({"user_id": nullable(string())}),
    },
    ("model", "max_tokens", "messages"),
)

COUNT_TOKENS: Schema = obj(_MESSAGES_INPUT, ("model", "messages"))

#: Component name → request body schema.
REQUEST_BODIES: dict[str, Schema] = {
    "ChatCompletionRequest": CHAT_COMPLETIONS,
    "CompletionRequest": COMPLETIONS,
    "ResponsesRequest": RESPONSES,
    "MessagesRequest": MESSAGES,
    "CountTokensRequest": COUNT_TOKENS,
}


def request_body(name: str) -> Schema:
    """The OpenAPI requestBody of component `name` (application/json, required)."""
    return {"required": True, "content": {"application/json": {"schema": ref(name)}}}
