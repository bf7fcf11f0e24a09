"""OpenAI Responses API output: engine tokens in, Responses events (or one JSON body) out."""

from __future__ import annotations

from typing import Any

import orjson
from deepseek_recipe import ResponsesRequest, ResponsesResponse

from deepinfer_server.protocol.core.named_events import NamedEventOutput, named_event
from deepinfer_server.protocol.core.recipe import RecipeContext
from deepinfer_server.protocol.responses.reasoning import ReasoningItems
from deepinfer_server.protocol.responses.request import PreparedResponses


def responses_output(
    prepared: PreparedResponses, response_id: str, recipe: RecipeContext
) -> NamedEventOutput:
    """The output of one Responses request."""
    generator = ResponsesRequest.chunk_generator(prepared.request, response_id, recipe.model_name)
    if prepared.namespace_tool_map:
        generator = generator.with_namespace_tool_map(prepared.namespace_tool_map)
    generator = generator.with_echo(prepared.echo)
    items = ReasoningItems(prepared.reasoning, recipe.reasoning_seal)
    return ResponsesOutput(generator, response_id, prepared, recipe, items)


class ResponsesOutput(NamedEventOutput):
    """Responses events, with reasoning items finished as the request asked (`ReasoningItems`)."""

    def __init__(
        self,
        generator: Any,
        response_id: str,
        prepared: PreparedResponses,
        recipe: RecipeContext,
        items: ReasoningItems,
    ) -> None:
        super().__init__(generator, ResponsesResponse, response_id, prepared, recipe)
        self._items = items

    def _stream_payloads(self, chunks: list[Any]) -> list[str]:
        payloads = []
        for chunk in chunks:
            name = self._event_name(chunk)
            if not self._items.wants_event(name):
                payloads.append(named_event(name, chunk.to_json()))
                continue
            for event in self._items.event(name, orjson.loads(chunk.to_json())):
                payloads.append(named_event(event["type"], orjson.dumps(event).decode()))
        return payloads

    def response_json(self) -> bytes:
        return orjson.dumps(self._items.response(orjson.loads(super().response_json())))
