"""Responses usage as openai-python's types require it.

The recipe writes `input_tokens_details` with `cached_tokens` only; openai-python's
`ResponseUsage` also requires `cache_write_tokens` (the prompt tokens written to the cache),
so a body without it fails the SDK's validation. The server reports 0: its prefix cache keeps
a prompt only when the request ends, and only if there is room for it, after the usage has
been sent; no count of written tokens exists when the usage is made.
"""

from __future__ import annotations

from deepinfer_server.protocol.core.json_types import JsonObject


def complete_usage(response: JsonObject) -> JsonObject:
    """`response` (a Responses object, changed in place) with every usage field the clients
    require; a response without usage yet (`response.created`) is left as it is."""
    usage = response.get("usage")
    details = usage.get("input_tokens_details") if isinstance(usage, dict) else None
    if isinstance(details, dict):
        details.setdefault("cache_write_tokens", 0)
    return response
