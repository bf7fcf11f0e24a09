"""OpenAI Responses API output: engine tokens in, Responses events (or one JSON body) out."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson
from deepseek_recipe import ResponsesRequest, ResponsesResponse

from deepinfer_server.protocol.core.json_types import JsonObject
from deepinfer_server.protocol.core.named_events import NamedEventOutput, named_event
from deepinfer_server.protocol.core.recipe import RecipeContext
from deepinfer_server.protocol.responses.reasoning import ReasoningItems
from deepinfer_server.protocol.responses.request import PreparedResponses
from deepinfer_server.protocol.responses.token_usage import complete_usage


def responses_output(
    prepared: PreparedResponses,
    response_id: str,
    recipe: RecipeContext,
    stored: StoredEcho | None = None,
) -> ResponsesOutput:
    """The output of one Responses request (`stored`: one the store serves)."""
    generator = ResponsesRequest.chunk_generator(prepared.request, response_id, recipe.model_name)
    if prepared.namespace_tool_map:
        generator = generator.with_namespace_tool_map(prepared.namespace_tool_map)
    generator = generator.with_echo(prepared.echo)
    items = ReasoningItems(prepared.reasoning, recipe.reasoning_seal)
    return ResponsesOutput(generator, response_id, prepared, recipe, items, stored)


#: The stream's last event, which carries the whole response.
_TERMINAL_EVENTS = frozenset({"response.completed", "response.incomplete", "response.failed"})
#: Every event that carries the response object (the token deltas do not: they pass as made).
_RESPONSE_OBJECT_EVENTS = _TERMINAL_EVENTS | {"response.created", "response.in_progress"}


@dataclass(frozen=True)
class StoredEcho:
    """How a response the store keeps (or continues from it) reports that, and whether its
    stream's terminal event waits for the store's write (`ResponsesOutput.held`)."""

    store: bool
    previous_response_id: str | None = None
    background: bool = False
    #: The conversation the response belongs to (`conversation` on the request).
    conversation: str | None = None

    def fields(self) -> JsonObject:
        fields: JsonObject = {
            "store": self.store,
            "previous_response_id": self.previous_response_id,
        }
        if self.background:
            fields["background"] = True
        if self.conversation is not None:
            fields["conversation"] = {"id": self.conversation}
        return fields


class ResponsesOutput(NamedEventOutput):
    """Responses events, with reasoning items finished as the request asked (`ReasoningItems`).

    With `stored` (a request the store serves), every response object reports its `store` and
    `previous_response_id`, and a stored stream's terminal event is held back (`held`, with the
    response it carries in `final`) until the caller has written the response to the store.
    Every response object echoes the request's `prompt_cache_retention`, as OpenAI's do.
    """

    def __init__(
        self,
        generator: Any,
        response_id: str,
        prepared: PreparedResponses,
        recipe: RecipeContext,
        items: ReasoningItems,
        stored: StoredEcho | None = None,
    ) -> None:
        super().__init__(generator, ResponsesResponse, response_id, prepared, recipe)
        self._items = items
        self._echo = None if stored is None else stored.fields()
        if prepared.cache_retention is not None:  # the recipe echoes null whatever was asked
            self._echo = {**(self._echo or {}), "prompt_cache_retention": prepared.cache_retention}
        # A conversation's turn is appended to it before the client hears the end, too.
        self._hold = stored is not None and (stored.store or stored.conversation is not None)
        #: The held terminal event (a stored stream), and the response object it carries.
        self.held: list[str] = []
        self.final: JsonObject | None = None

    def _stream_payloads(self, chunks: list[Any]) -> list[str]:
        payloads = []
        for chunk in chunks:
            name = self._event_name(chunk)
            echoes = self._echo is not None and name in _RESPONSE_OBJECT_EVENTS
            if not echoes and not self._items.wants_event(name):
                payloads.append(named_event(name, chunk.to_json()))
                continue
            for event in self._items.event(name, orjson.loads(chunk.to_json())):
                if isinstance(event.get("response"), dict):
                    complete_usage(event["response"], self._cache_writes())
                    if self._echo is not None:
                        event["response"].update(self._echo)
                payload = named_event(event["type"], orjson.dumps(event).decode())
                if self._hold and event["type"] in _TERMINAL_EVENTS:
                    self.final = event["response"]
                    self.held.append(payload)
                else:
                    payloads.append(payload)
        return payloads

    def _cache_writes(self) -> int:
        """The prompt tokens the engine writes to its cache beyond those it read."""
        return max(0, self._written_tokens - self._cached_tokens)

    def response(self) -> JsonObject:
        """The non-streaming response object (made once: the request has ended)."""
        if self.final is None:
            made = self._items.response(orjson.loads(super().response_json()))
            response = complete_usage(made, self._cache_writes())
            if self._echo is not None:
                response.update(self._echo)
            self.final = response
        return self.final

    def response_json(self) -> bytes:
        return orjson.dumps(self.response())
