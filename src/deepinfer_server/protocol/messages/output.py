"""Anthropic Messages API output: engine tokens in, Messages events (or one JSON body) out.

The recipe reports `cache_creation_input_tokens` as 0. When the engine writes the prompt to
its prefix cache for the request's `cache_control` (`written_tokens`, known from its first
output), the tokens it writes beyond those it read count as created and leave
`input_tokens`, so that `input_tokens + cache_creation_input_tokens +
cache_read_input_tokens` stays the prompt's length, as Anthropic counts them. The cache keeps
whole prompts: every token after the read ones is written, so `input_tokens` is then 0. The
created tokens are also in `cache_creation`, under the ttl the request asked (`1h` when any
breakpoint asked it, else `5m`).
"""

from __future__ import annotations

from typing import Any

import orjson
from deepseek_recipe import MessagesRequest, MessagesResponse

from deepinfer_server.protocol.core.json_types import JsonObject
from deepinfer_server.protocol.core.named_events import NamedEventOutput, named_event
from deepinfer_server.protocol.core.recipe import RecipeContext
from deepinfer_server.protocol.messages.request import PreparedMessages

#: The events whose usage counts the prompt's tokens.
_USAGE_EVENTS = frozenset({"message_start", "message_delta"})


#: The retention of a `1h` breakpoint (`cache_control.check_cache_control`).
_HOUR = 3600


def with_created(usage: JsonObject, created: int, retention_seconds: int) -> JsonObject:
    """`usage` (changed in place) with `created` of its input tokens written to the cache for
    `retention_seconds`."""
    usage["cache_creation_input_tokens"] = created
    hour = retention_seconds >= _HOUR
    usage["cache_creation"] = {
        "ephemeral_5m_input_tokens": 0 if hour else created,
        "ephemeral_1h_input_tokens": created if hour else 0,
    }
    if isinstance(usage.get("input_tokens"), int):
        usage["input_tokens"] = max(0, usage["input_tokens"] - created)
    return usage


class MessagesOutput(NamedEventOutput):
    """Messages events, with the prompt tokens the engine writes to its cache in usage."""

    def __init__(
        self,
        generator: Any,
        response_type: Any,
        response_id: str,
        prepared: PreparedMessages,
        recipe: RecipeContext,
    ) -> None:
        super().__init__(generator, response_type, response_id, prepared, recipe)
        self._retention = prepared.sampling.retention_seconds

    def _created(self) -> int:
        return max(0, self._written_tokens - self._cached_tokens)

    def _stream_payloads(self, chunks: list[Any]) -> list[str]:
        created = self._created()
        if not created:
            return super()._stream_payloads(chunks)
        payloads = []
        for chunk in chunks:
            name = self._event_name(chunk)
            if name not in _USAGE_EVENTS:
                payloads.append(named_event(name, chunk.to_json()))
                continue
            event = orjson.loads(chunk.to_json())
            holder = event.get("message") if name == "message_start" else event
            if isinstance(holder, dict) and isinstance(holder.get("usage"), dict):
                with_created(holder["usage"], created, self._retention)
            payloads.append(named_event(name, orjson.dumps(event).decode()))
        return payloads

    def response_json(self) -> bytes:
        body = super().response_json()
        created = self._created()
        if not created:
            return body
        message = orjson.loads(body)
        if isinstance(message.get("usage"), dict):
            with_created(message["usage"], created, self._retention)
        return orjson.dumps(message)


def messages_output(
    prepared: PreparedMessages, message_id: str, recipe: RecipeContext
) -> MessagesOutput:
    """The output of one Messages request."""
    generator = MessagesRequest.chunk_generator(prepared.request, message_id, recipe.model_name)
    return MessagesOutput(generator, MessagesResponse, message_id, prepared, recipe)
