"""Responses usage as openai-python's types require it.

The recipe writes `input_tokens_details` with `cached_tokens` only; openai-python's
`ResponseUsage` also requires `cache_write_tokens` (the prompt tokens written to the cache),
so a body without it fails the SDK's validation. The server reports the prompt tokens the
engine writes to its prefix cache beyond those it read, for a request whose
`prompt_cache_retention` asked it to keep the prompt (the engine decides the write when it
takes the request and says so with its first output); 0 for any other request, whose prompt
may or may not be kept when it ends.
"""

from __future__ import annotations

from deepinfer_server.protocol.core.json_types import JsonObject


def complete_usage(response: JsonObject, written_tokens: int = 0) -> JsonObject:
    """`response` (a Responses object, changed in place) with every usage field the clients
    require, `written_tokens` (when not 0) as its `cache_write_tokens`; a response without
    usage yet (`response.created`) is left as it is."""
    usage = response.get("usage")
    details = usage.get("input_tokens_details") if isinstance(usage, dict) else None
    if isinstance(details, dict):
        if written_tokens:
            details["cache_write_tokens"] = written_tokens
        details.setdefault("cache_write_tokens", 0)
    return response
