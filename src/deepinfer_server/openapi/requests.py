"""The request bodies of Chat Completions, Completions and vLLM's tokenizer endpoints, and the
table of every POST API's body (Messages: `messages_bodies.py`; Responses and conversations:
`responses_bodies.py`; shared fields: `fields.py`), as the server's validation (and
deepseek-recipe's) accepts them.

The fields of each protocol's typed body are generated from its Struct (`typed_fields`), so
their bounds are declared once; the fields deepseek-recipe reads (messages, tools, formats...)
are written here as the recipe states them in its 400s. tests/http/test_openapi.py checks both
directions: every body field the protocol layer reads is described here, and every documented
bound is where the validation draws it.
"""

from __future__ import annotations

from deepinfer_server.openapi.fields import (
    CHAT_ROLES,
    FUNCTION_FIELDS,
    JSON_SCHEMA,
    LOGIT_BIAS,
    MODEL,
    PROMPT_CACHE_RETENTION,
    REASONING_EFFORTS,
    RECIPE_MAX_TOKENS,
    SERVER_EXTENSIONS,
    STOP,
    STREAM,
    THINKING,
    TYPED_DESCRIPTIONS,
)
from deepinfer_server.openapi.messages_bodies import COUNT_TOKENS, MESSAGES
from deepinfer_server.openapi.responses_bodies import (
    CONVERSATION_CREATE,
    CONVERSATION_ITEMS,
    CONVERSATION_UPDATE,
    RESPONSES,
)
from deepinfer_server.openapi.schema import (
    Schema,
    array,
    boolean,
    integer,
    nullable,
    obj,
    one_of,
    ref,
    string,
)
from deepinfer_server.openapi.typed_fields import typed_fields
from deepinfer_server.protocol.chat.request import ChatBody
from deepinfer_server.protocol.completions.request import CompletionBody
from deepinfer_server.protocol.core.sampling import Api

#: deepseek-recipe's range of a Chat max_tokens (wider typed: UInt32).
_RECIPE_MAX = nullable(integer(1, RECIPE_MAX_TOKENS))
#: stream_options without `stream: true` is a 400.
_STREAM_OPTIONS_NEED_STREAM: Schema = {
    "stream_options": {"properties": {"stream": {"const": True}}, "required": ["stream"]}
}


def _openai_body(properties: dict[str, Schema], required: tuple[str, ...]) -> Schema:
    """A Chat or legacy Completions body: its `properties`, then the fields both end with
    (`user`, `logit_bias`, this server's extensions); stream_options needs stream."""
    body = obj(
        {
            **properties,
            "user": string(),
            "logit_bias": LOGIT_BIAS,
            **SERVER_EXTENSIONS,
        },
        required,
    )
    body["dependentSchemas"] = _STREAM_OPTIONS_NEED_STREAM
    return body


_FUNCTION = obj(FUNCTION_FIELDS, ("name",))
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
            {"name": string(), "schema": JSON_SCHEMA, "strict": boolean()}, ("schema",)
        ),
    },
    ("type",),
)
_STRUCTURED_OUTPUTS: Schema = obj(
    {
        "json": JSON_SCHEMA,
        "regex": string(minLength=1),
        "grammar": string(minLength=1, description="EBNF (xgrammar's dialect)"),
        "choice": array(string(), 1),
        "json_object": boolean(),
    },
    description="vLLM's structured outputs: at most one of its keys",
)
_STRUCTURED_OUTPUTS["maxProperties"] = 1

CHAT_COMPLETIONS = _openai_body(
    {
        "model": MODEL,
        "messages": array(_CHAT_MESSAGE, 1),
        **typed_fields(
            ChatBody,
            Api.CHAT,
            described=TYPED_DESCRIPTIONS,
            recipe_bounds={"max_tokens": _RECIPE_MAX, "max_completion_tokens": _RECIPE_MAX},
        ),
        "stop": STOP,
        "prompt_cache_retention": PROMPT_CACHE_RETENTION,
        "stream": nullable(STREAM),
        "tools": nullable(array(_CHAT_TOOL)),
        "tool_choice": nullable(_CHAT_TOOL_CHOICE),
        "parallel_tool_calls": nullable(boolean()),
        "response_format": nullable(_CHAT_RESPONSE_FORMAT),
        "structured_outputs": nullable(_STRUCTURED_OUTPUTS),
        "guided_json": JSON_SCHEMA,
        "guided_regex": string(minLength=1),
        "guided_grammar": string(minLength=1),
        "guided_choice": array(string(), 1),
        "thinking": nullable(THINKING),
        "reasoning_effort": nullable(string(enum=list(REASONING_EFFORTS))),
    },
    ("model", "messages"),
)

COMPLETIONS = _openai_body(
    {
        "model": MODEL,
        "prompt": one_of(
            string(),
            array(string(), 1),
            array(integer(0), 1),
            array(array(integer(0), 1), 1),
            description="Text, texts, token IDs or lists of token IDs (one choice each, times n)",
        ),
        **typed_fields(
            CompletionBody,
            Api.COMPLETIONS,
            described={
                **TYPED_DESCRIPTIONS,
                "max_tokens": "Default 16; 0 needs echo; prompt + max_tokens must fit",
            },
        ),
        "best_of": nullable(integer(description="Only equal to n")),
        "stop": STOP,
        "suffix": nullable(string(enum=[""], description="Not supported: absent or empty")),
    },
    ("model", "prompt"),
)

TOKENIZE: Schema = obj(
    {
        "model": MODEL,
        "prompt": string(description="Text, encoded as legacy completions encode a prompt"),
        "messages": array(_CHAT_MESSAGE, 1),
        "add_special_tokens": nullable(
            boolean("prompt: the BOS token first (default true); messages: always there")
        ),
        "return_token_strs": nullable(boolean("Also each token's string (default false)")),
        "add_generation_prompt": nullable(
            boolean("Default true; false only with continue_final_message")
        ),
        "continue_final_message": nullable(
            boolean("Continue the last (assistant) message instead of opening a new turn")
        ),
        "tools": CHAT_COMPLETIONS["properties"]["tools"],
        "tool_choice": CHAT_COMPLETIONS["properties"]["tool_choice"],
        "response_format": CHAT_COMPLETIONS["properties"]["response_format"],
        "thinking": CHAT_COMPLETIONS["properties"]["thinking"],
        "reasoning_effort": CHAT_COMPLETIONS["properties"]["reasoning_effort"],
    },
    (),
    "vLLM's tokenize request: a prompt, or Chat Completions messages (with the Chat fields that "
    "shape the prompt) rendered as /v1/chat/completions renders them",
)
TOKENIZE["oneOf"] = [{"required": ["prompt"]}, {"required": ["messages"]}]

DETOKENIZE: Schema = obj(
    {"model": MODEL, "tokens": array(integer(0, description="A token ID of the vocabulary"))},
    ("tokens",),
    "vLLM's detokenize request",
)

BATCH: Schema = obj(
    {
        "input_file_id": string("A file uploaded with purpose 'batch'"),
        "endpoint": string(
            "The endpoint every line calls",
            enum=["/v1/chat/completions", "/v1/completions", "/v1/responses"],
        ),
        "completion_window": string("The only window offered", enum=["24h"]),
        "metadata": {
            "type": ["object", "null"],
            "maxProperties": 16,
            "additionalProperties": {"type": "string", "maxLength": 512},
        },
    },
    ("input_file_id", "endpoint", "completion_window"),
    "OpenAI's batch creation request",
)

FILE_UPLOAD: Schema = obj(
    {
        "file": {"type": "string", "contentMediaType": "application/octet-stream"},
        "purpose": string("What the file is for: batch input only", enum=["batch"]),
    },
    ("file", "purpose"),
    "OpenAI's file upload (multipart/form-data)",
)

MESSAGE_BATCH: Schema = obj(
    {
        "requests": array(
            obj(
                {
                    "custom_id": string("Unique in the batch", pattern="^[a-zA-Z0-9_-]{1,64}$"),
                    "params": ref("MessagesRequest"),
                },
                ("custom_id", "params"),
            ),
            min_items=1,
        )
    },
    ("requests",),
    "Anthropic's message batch creation request",
)

#: Component name → request body schema.
REQUEST_BODIES: dict[str, Schema] = {
    "MessageBatchRequest": MESSAGE_BATCH,
    "BatchRequest": BATCH,
    "FileUpload": FILE_UPLOAD,
    "ChatCompletionRequest": CHAT_COMPLETIONS,
    "CompletionRequest": COMPLETIONS,
    "ResponsesRequest": RESPONSES,
    "MessagesRequest": MESSAGES,
    "CountTokensRequest": COUNT_TOKENS,
    "TokenizeRequest": TOKENIZE,
    "DetokenizeRequest": DETOKENIZE,
    "ConversationCreateRequest": CONVERSATION_CREATE,
    "ConversationUpdateRequest": CONVERSATION_UPDATE,
    "ConversationItemsRequest": CONVERSATION_ITEMS,
}


def request_body(name: str) -> Schema:
    """The OpenAPI requestBody of component `name` (application/json, required)."""
    return {"required": True, "content": {"application/json": {"schema": ref(name)}}}
