"""OpenAI's `prompt_cache_retention` (Chat Completions and Responses), checked as OpenAI checks it.

OpenAI accepts `in_memory` and `24h` (or null) and refuses any other value with a 400
`invalid_value`. This server accepts both and keeps no prompt for a set time: its prefix cache
keeps every reusable prompt until room is needed, least recently used first, whatever the
request asked (docs/operations/prefix-caching.md).
"""

from __future__ import annotations

from deepinfer_server.errors import BadRequestError
from deepinfer_server.protocol.core.json_types import JsonObject

#: The values OpenAI accepts.
RETENTIONS = ("in_memory", "24h")


def check_cache_retention(body: JsonObject) -> None:
    """400 in OpenAI's words for a `prompt_cache_retention` other than `RETENTIONS`."""
    retention = body.get("prompt_cache_retention")
    if retention is None or retention in RETENTIONS:
        return
    shown = f"'{retention}'" if isinstance(retention, str) else repr(retention)
    raise BadRequestError(
        f"Invalid value: {shown}. Supported values are: 'in_memory' and '24h'.",
        param="prompt_cache_retention",
        code="invalid_value",
    )
