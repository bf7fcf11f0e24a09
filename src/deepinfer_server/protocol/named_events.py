"""Output of the protocols whose streams are named SSE events (Responses, Messages).

The recipe's stream processor produces protocol events; streamed, each becomes
`event: <name>\\ndata: <json>\\n\\n`; otherwise they are accumulated into the protocol's response
object. Neither protocol ends its stream with a `[DONE]` message.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

from deepseek_recipe import InferenceChunk, InferenceFinishReason, PromptUsage, StreamProcessor

_FINISH_REASONS = {"stop": InferenceFinishReason.Stop, "length": InferenceFinishReason.Length}


class _Accumulator(Protocol):
    def accumulate(self, chunk: Any) -> None: ...

    def to_json(self) -> str: ...


class NamedEventOutput:
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
        self._processor = processor
        self._response_type = response_type
        self._prompt_tokens = prompt_tokens
        self._response: _Accumulator | None = None
        if not stream:
            self._response = response_type(
                response_id, model_name, int(time.time()), prompt_tokens, 0
            )

    @property
    def finished(self) -> bool:
        return bool(self._processor.finished)

    def start(self) -> list[str]:
        usage = PromptUsage(prompt_tokens=self._prompt_tokens)
        return self._emit(self._processor.push(InferenceChunk.ready(prompt_usage=usage)))

    def push(self, token_ids: list[int]) -> list[str]:
        if not token_ids or self.finished:
            return []
        return self._emit(self._processor.push(InferenceChunk.tokens(token_ids)))

    def finish(self, engine_reason: str) -> list[str]:
        chunks = []
        if not self.finished:
            chunks = self._processor.push(InferenceChunk.finish(_FINISH_REASONS[engine_reason]))
        chunks.extend(self._processor.finish())
        return self._emit(chunks)

    def close(self) -> None:
        if not self.finished:
            self._processor.close()

    def response_json(self) -> bytes:
        assert self._response is not None, "response_json() is for non-streaming requests"
        return self._response.to_json().encode()

    def _emit(self, chunks: list[Any]) -> list[str]:
        if self._response is not None:
            for chunk in chunks:
                self._response.accumulate(chunk)
            return []
        name_of = self._response_type.sse_event_name
        return [f"event: {name_of(chunk)}\ndata: {chunk.to_json()}\n\n" for chunk in chunks]
