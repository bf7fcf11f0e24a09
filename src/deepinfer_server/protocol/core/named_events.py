"""Output of the protocols whose streams are named SSE events (Responses, Messages).

Streamed, each recipe event becomes `event: <name>\\ndata: <json>\\n\\n`; neither protocol ends
its stream with a `[DONE]` message.
"""

from __future__ import annotations

from typing import Any

from deepinfer_server.protocol.core.json_types import JsonObject
from deepinfer_server.protocol.core.stream_output import RecipeOutput


def named_event(name: str | None, data: str) -> str:
    """One SSE message: the event's name and its JSON data."""
    return f"event: {name}\ndata: {data}\n\n"


class NamedEventOutput(RecipeOutput):
    """Engine tokens in, named SSE events (or one JSON body) out."""

    def _event_name(self, chunk: Any) -> str | None:
        """The SSE event name of one recipe chunk."""
        name: str | None = self._response_type.sse_event_name(chunk)
        return name

    def _finish_of(self, chunk: JsonObject) -> str | None:
        """Messages: the `message_delta`'s stop_reason; Responses: the final response's
        status, or why it is incomplete."""
        kind = chunk.get("type")
        if kind == "message_delta":
            reason = (chunk.get("delta") or {}).get("stop_reason")
            return reason if isinstance(reason, str) else None
        if kind in ("response.completed", "response.incomplete"):
            response = chunk.get("response") or {}
            reason = (response.get("incomplete_details") or {}).get("reason")
            status = response.get("status")
            found = reason or status
            return found if isinstance(found, str) else None
        return None

    def _stream_payloads(self, chunks: list[Any]) -> list[str]:
        name_of = self._event_name
        return [named_event(name_of(chunk), chunk.to_json()) for chunk in chunks]
