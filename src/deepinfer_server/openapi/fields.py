"""The request fields every POST API shares, with the bounds the server or deepseek-recipe
draws (see `requests.py`)."""

from __future__ import annotations

from deepinfer_server.openapi.schema import (
    Schema,
    array,
    boolean,
    integer,
    neutral,
    nullable,
    number,
    obj,
    one_of,
    ref,
    string,
)
from deepinfer_server.protocol.completions.request import MAX_STOP_SEQUENCES
from deepinfer_server.protocol.core.cache_retention import RETENTIONS
from deepinfer_server.protocol.core.effort import EFFORT_PROMPT
from deepinfer_server.protocol.core.sampling import SAMPLING, Api, SamplingField
from deepinfer_server.protocol.core.validation import PRIORITY_MAX, PRIORITY_MIN

#: deepseek-recipe's own bound on max_tokens (its 400: "the valid range of max_tokens is [1, N]").
RECIPE_MAX_TOKENS = 393216
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function", "latest_reminder")
#: The effort table's values (protocol/core/effort.py), in every API.
REASONING_EFFORTS = tuple(EFFORT_PROMPT)
THINKING_TYPES = ("adaptive", "enabled", "disabled")

#: The served names (`--served-model-name`), a component the document fills in; another is a 404.
MODEL = ref("ModelName")
PRIORITY = integer(
    PRIORITY_MIN,
    PRIORITY_MAX,
    "vLLM's extension: lower starts first among the queued requests of the same API key",
)
STREAM = boolean()
#: OpenAI's `prompt_cache_retention` (Chat Completions and Responses).
PROMPT_CACHE_RETENTION = nullable(
    string(
        "How long the prefix cache keeps the prompt pinned (in_memory: 10 minutes); with the "
        "cache off, accepted and not acted on",
        enum=list(RETENTIONS),
    )
)
#: vLLM's `cache_salt` (an extension field in the Messages API).
CACHE_SALT_DESCRIPTION = (
    "Requests with different salts never share cached prompt prefixes (vLLM's field); with "
    "--prefix-cache-scope key, requests of different API keys never do either"
)
#: What the typed body fields' declarations do not say (`typed_fields.typed_fields`).
TYPED_DESCRIPTIONS = {
    "stream_options": "Needs `stream: true`",
    "cache_salt": CACHE_SALT_DESCRIPTION,
    "prompt_cache_key": "Names the request's session: with DP > 1 and prefix caching, the "
    "turns of a session go to the DP rank that holds it unless that one is much more loaded",
}
ANY_OBJECT: Schema = {"type": "object"}
#: Prefill/decode disaggregation's handoff (vLLM's field): its fields are
#: `disaggregation.handoff.params.KVTransferParams`, checked by a decode server.
KV_TRANSFER_PARAMS: Schema = {
    "anyOf": [
        {
            "type": "object",
            "description": "Prefill/decode disaggregation: on a decode server, the "
            "kv_transfer_params object of a prefill server's answer (required there); on a "
            'prefill server, optionally {"do_remote_decode": true}; refused by a server '
            "without a role",
        },
        {"type": "null"},
    ]
}
#: The fields this server adds to every generation body, whatever its protocol (vLLM's):
#: the request's scheduling priority and a disaggregated decode request's handoff.
SERVER_EXTENSIONS: dict[str, Schema] = {
    "priority": nullable(PRIORITY),
    "kv_transfer_params": KV_TRANSFER_PARAMS,
}
JSON_SCHEMA: Schema = {
    "anyOf": [{"type": "object"}, {"type": "boolean"}, {"type": "string"}],
    "description": "A JSON Schema (an object, a boolean, or its JSON text)",
}
#: A function tool's fields: Chat's `function` object, and a Responses tool beside its `type`.
FUNCTION_FIELDS: dict[str, Schema] = {
    "name": string(minLength=1),
    "description": string(),
    "parameters": JSON_SCHEMA,
    "strict": boolean(),
}
STOP = one_of(
    string(minLength=1), array(string(minLength=1), 1, MAX_STOP_SEQUENCES), {"type": "null"}
)
THINKING = obj({"type": string(enum=list(THINKING_TYPES)), "budget_tokens": integer(0)})

#: `logit_bias`, accepted only empty or all 0 (sampling.reject_logit_bias).
LOGIT_BIAS: Schema = {
    "type": "object",
    "additionalProperties": {"type": "number", "const": 0},
    "description": "Accepted only empty or with every bias 0: the engine has no logit bias",
}


def sampling_field(field: SamplingField, api: Api) -> Schema:
    """One declared sampling field's schema in `api`'s body (null is absent, as the server
    reads it, except in Anthropic's Messages, whose clients never send it)."""
    if field.neutral is not None:
        kind = "integer" if field.kind is int else "number"
        return neutral(field.neutral, field.description, kind)
    if field.kind is int:
        schema = integer(int(field.minimum), int(field.maximum), field.description)
    else:
        schema = number(field.minimum, field.maximum, field.description)
    return schema if api is Api.MESSAGES else nullable(schema)


def sampling_fields(api: Api, *, neutral: bool) -> dict[str, Schema]:
    """The schemas of `api`'s declared sampling fields: the tunable ones, or (`neutral`) those
    accepted only at their neutral value."""
    return {
        field.name: sampling_field(field, api)
        for field in SAMPLING[api].fields
        if (field.neutral is not None) == neutral
    }
