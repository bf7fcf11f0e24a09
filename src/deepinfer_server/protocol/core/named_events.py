"""Output of the protocols whose streams are named SSE events (Responses, Messages).

Streamed, each recipe event becomes `event: <name>\\ndata: <json>\\n\\n`; neither protocol ends
its stream with a `[DONE]` message.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

from deepseek_recipe import ConversationRequest

from deepinfer_server.ipc.messages import Images
from deepinfer_server.protocol.core.json_types import JsonObject
from deepinfer_server.protocol.core.recipe import RecipeContext
from deepinfer_server.protocol.core.stream_output import RecipeOutput


def named_event(name: str | None, data: str) -> str:
    """One SSE message: the event's name and its JSON data."""
    return f"event: {name}\ndata: {data}\n\n"


class PreparedConversation(Protocol):
    """What a prepared Responses or Messages request offers its output."""

    @property
    def request(self) -> ConversationRequest: ...

    @property
    def prompt_token_ids(self) -> list[int]: ...

    @property
    def stream(self) -> bool: ...

    @property
    def images(self) -> Images | None: ...


class NamedEventOutput(RecipeOutput):
    """Engine tokens in, named SSE events (or one JSON body) out."""

    def __init__(
        self,
        generator: Any,
        response_type: Any,
        response_id: str,
        prepared: PreparedConversation,
        recipe: RecipeContext,
    ) -> None:
        """`generator` is the protocol's recipe chunk generator for this request."""
        prompt_tokens = Images.prompt_tokens(prepared.prompt_token_ids, prepared.images)
        response = None
        if not prepared.stream:
            response = response_type(
                response_id, recipe.model_name, int(time.time()), prompt_tokens, 0
            )
        options = prepared.request.parsing_options
        super().__init__(generator, options, recipe.tokenizer, response, prompt_tokens)
        self._event_name = response_type.sse_event_name

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
