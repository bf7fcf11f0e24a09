"""The response bodies the document describes beyond generation: the model objects (OpenAI's
with vLLM's `max_model_len`, or Anthropic's), the server's root and vLLM's tokenizer
endpoints."""

from __future__ import annotations

from deepinfer_server.openapi.schema import Schema, array, integer, nullable, obj, string

_CONTEXT_WINDOW = "The context window in tokens, prompt plus output (--max-model-len)"

MODEL: Schema = obj(
    {
        "id": string(),
        "object": string(enum=["model"]),
        "created": integer(0),
        "owned_by": string(),
        "root": string(),
        "parent": nullable(string()),
        "max_model_len": integer(1, description=_CONTEXT_WINDOW + ", as vLLM reports it"),
    },
    ("id", "object", "created", "owned_by", "max_model_len"),
    "A served model, as OpenAI and vLLM describe one",
)

ANTHROPIC_MODEL: Schema = obj(
    {
        "type": string(enum=["model"]),
        "id": string(),
        "display_name": string(),
        "created_at": string(format="date-time"),
        "max_input_tokens": integer(1, description=_CONTEXT_WINDOW),
        "max_tokens": integer(
            1, description="The window again: a request's output gets the room its prompt leaves"
        ),
        "max_model_len": integer(1, description=_CONTEXT_WINDOW + ", as vLLM reports it"),
    },
    ("type", "id", "display_name", "created_at", "max_model_len"),
    "A served model in the shape of Anthropic's models endpoint (with anthropic-version)",
)

MODEL_LIST: Schema = obj(
    {"object": string(enum=["list"]), "data": array(MODEL)}, ("object", "data")
)

ANTHROPIC_MODEL_LIST: Schema = obj(
    {
        "data": array(ANTHROPIC_MODEL),
        "has_more": {"type": "boolean"},
        "first_id": nullable(string()),
        "last_id": nullable(string()),
    },
    ("data", "has_more", "first_id", "last_id"),
)

ROOT: Schema = obj(
    {
        "name": string(enum=["deepinfer-server"]),
        "version": string(),
        "links": obj({}, description="Paths to start from: the OpenAPI document, the models"),
    },
    ("name", "version", "links"),
    "What answers at / (a client probing the base URL gets 200)",
)

TOKENIZE_RESPONSE: Schema = obj(
    {
        "count": integer(0),
        "max_model_len": integer(1, description=_CONTEXT_WINDOW),
        "tokens": array(integer(0)),
        "token_strs": nullable(array(string())),
    },
    ("count", "max_model_len", "tokens", "token_strs"),
    "vLLM's tokenize response",
)

DETOKENIZE_RESPONSE: Schema = obj({"prompt": string()}, ("prompt",), "vLLM's detokenize response")

TOKENIZER_INFO: Schema = obj(
    {
        "tokenizer_class": string(),
        "bos_token": nullable(string()),
        "eos_token": nullable(string()),
    },
    ("tokenizer_class",),
    "The tokenizer's tokenizer_config.json without file paths, as vLLM's /tokenizer_info",
)

RESPONSE_SCHEMAS: dict[str, Schema] = {
    "Model": MODEL,
    "ModelList": MODEL_LIST,
    "AnthropicModel": ANTHROPIC_MODEL,
    "AnthropicModelList": ANTHROPIC_MODEL_LIST,
    "ServerRoot": ROOT,
    "TokenizeResponse": TOKENIZE_RESPONSE,
    "DetokenizeResponse": DETOKENIZE_RESPONSE,
    "TokenizerInfo": TOKENIZER_INFO,
}
