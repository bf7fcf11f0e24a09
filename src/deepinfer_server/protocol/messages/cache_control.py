"""Anthropic's `cache_control` breakpoints, checked as Anthropic checks them.

A system block, a tool, or a content block of a message (a `tool_result`'s own content blocks
included) may carry `cache_control: {"type": "ephemeral", "ttl": "5m" | "1h"}`. Anthropic
refuses another type or ttl, and more than four breakpoints in one request, with a 400
`invalid_request_error`; this server refuses them with the same messages. A request with
breakpoints asks the engine to keep its prompt for the longest ttl among them
(`SamplingOptions.retention_seconds`; 5m without one): an engine that honours it writes the
whole prompt (the prefix cache keeps prompts whole, so a breakpoint before the last message
keeps more than Anthropic would) and pins it that long, within a per-key budget
(docs/operations/prefix-caching.md).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from deepinfer_server.errors import BadRequestError
from deepinfer_server.protocol.core.json_types import JsonObject

#: The most breakpoints one request may carry.
MAX_BREAKPOINTS = 4
_TYPE = "ephemeral"
_TTLS = {"5m": 300, "1h": 3600}


def _listed(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _content_markers(blocks: Any, path: str) -> Iterator[tuple[str, Any]]:
    """The markers of a list of content blocks: `path.N.TYPE` each, as Anthropic names them."""
    for index, block in enumerate(_listed(blocks)):
        if not isinstance(block, dict):
            continue
        where = f"{path}.{index}.{block.get('type')}"
        if block.get("cache_control") is not None:
            yield where, block["cache_control"]
        if block.get("type") == "tool_result":
            yield from _content_markers(block.get("content"), f"{where}.content")


def _markers(body: JsonObject) -> Iterator[tuple[str, Any]]:
    """Every `cache_control` of the request with where it is, in prompt order (tools, system,
    messages)."""
    for index, tool in enumerate(_listed(body.get("tools"))):
        if isinstance(tool, dict) and tool.get("cache_control") is not None:
            yield f"tools.{index}", tool["cache_control"]
    for index, block in enumerate(_listed(body.get("system"))):
        if isinstance(block, dict) and block.get("cache_control") is not None:
            yield f"system.{index}", block["cache_control"]
    for index, message in enumerate(_listed(body.get("messages"))):
        if isinstance(message, dict):
            yield from _content_markers(message.get("content"), f"messages.{index}.content")


def _check_marker(where: str, marker: Any) -> None:
    kind = marker.get("type") if isinstance(marker, dict) else None
    if kind != _TYPE:
        raise BadRequestError(
            f"{where}.cache_control: Input tag {kind!r} found using 'type' does not match any "
            f"of the expected tags: '{_TYPE}'",
            param=f"{where}.cache_control.type",
        )
    ttl = marker.get("ttl")
    if ttl is not None and not (isinstance(ttl, str) and ttl in _TTLS):
        raise BadRequestError(
            f"{where}.cache_control.{_TYPE}.ttl: Input should be '5m' or '1h'",
            param=f"{where}.cache_control.ttl",
        )


def check_cache_control(body: JsonObject) -> int:
    """The seconds the request's breakpoints ask its prompt be kept (the longest ttl; 0
    without a breakpoint); 400 for a breakpoint of another type or ttl, or more than
    `MAX_BREAKPOINTS`."""
    found = seconds = 0
    for where, marker in _markers(body):
        _check_marker(where, marker)
        found += 1
        seconds = max(seconds, _TTLS[marker.get("ttl") or "5m"])
    if found > MAX_BREAKPOINTS:
        raise BadRequestError(
            f"A maximum of {MAX_BREAKPOINTS} blocks with cache_control may be provided. "
            f"Found {found}."
        )
    return seconds
