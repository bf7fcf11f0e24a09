"""OpenAI's `prompt_cache_retention` (Chat Completions and Responses), checked as OpenAI checks it.

OpenAI accepts `in_memory` and `24h` (or null) and refuses any other value with a 400
`invalid_value`. This server asks the engine to keep the prompt for `RETENTIONS`' seconds
(`SamplingOptions.retention_seconds`): an engine that honours it pins the written prompt that
long, within a per-key budget, and Responses reports the tokens written as
`input_tokens_details.cache_write_tokens` (docs/operations/prefix-caching.md). Without the
field the prompt is cached as any other, least recently used first out.
"""

from __future__ import annotations

from deepinfer_server.errors import BadRequestError
from deepinfer_server.protocol.core.json_types import JsonObject

#: The values OpenAI accepts, with the seconds each keeps a prompt (`in_memory`: OpenAI keeps
#: such a prompt for 5 to 10 minutes of inactivity).
RETENTIONS = {"in_memory": 600, "24h": 24 * 3600}


def check_cache_retention(body: JsonObject) -> int:
    """The seconds the request's `prompt_cache_retention` asks a prompt be kept (0: none
    asked); 400 in OpenAI's words for a value other than `RETENTIONS`'."""
    retention = body.get("prompt_cache_retention")
    if retention is None:
        return 0
    if isinstance(retention, str) and retention in RETENTIONS:
        return RETENTIONS[retention]
    shown = f"'{retention}'" if isinstance(retention, str) else repr(retention)
    raise BadRequestError(
        f"Invalid value: {shown}. Supported values are: 'in_memory' and '24h'.",
        param="prompt_cache_retention",
        code="invalid_value",
    )
