"""Output of the protocols whose streams are named SSE events (Responses, Messages).

Streamed, each recipe event becomes `event: <name>\\ndata: <json>\\n\\n`; neither protocol ends
its stream with a `[DONE]` message.
"""

from __future__ import annotations

import time
from typing import Any

from deepseek_recipe import StreamProcessor

from deepinfer_server.protocol.stream_output import RecipeOutput


class NamedEventOutput(RecipeOutput):
    """Engine tokens in, named SSE events (or one JSON body) out."""

    def __init__(
        self,
        processor: StreamProcessor,
        response_type: Any,
        response_id: str,
        model_name: str,
        prompt_tokens: int,
        stream: bool,
    ) -> None:
        response = None
        if not stream:
            response = response_type(response_id, model_name, int(time.time()), prompt_tokens, 0)
        super().__init__(processor, response, prompt_tokens)
        self._event_name = response_type.sse_event_name

    def _stream_payloads(self, chunks: list[Any]) -> list[str]:
        name_of = self._event_name
        return [f"event: {name_of(chunk)}\ndata: {chunk.to_json()}\n\n" for chunk in chunks]
