"""OpenAI Responses API (`POST /v1/responses`): request preparation and output."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson
from deepseek_recipe import (
    ConversationRequest,
    ResponsesRequest,
    ResponsesResponse,
)

from deepinfer_server.errors import BadRequestError, ErrorKind
from deepinfer_server.grammar import Constraint
from deepinfer_server.ipc.messages import Images, SamplingOptions
from deepinfer_server.protocol.core.choices import reject_n
from deepinfer_server.protocol.core.named_events import NamedEventOutput, named_event
from deepinfer_server.protocol.core.prepare import engine_input
from deepinfer_server.protocol.core.recipe import RecipeContext
from deepinfer_server.protocol.core.structured import (
    RESPONSES_CONSTRAINT,
    convert_honouring_tool_choice,
    read_constraint,
)
from deepinfer_server.protocol.core.validation import check_model, optional_bool
from deepinfer_server.protocol.responses.reasoning import (
    ReasoningItems,
    ReasoningRequest,
    restore_reasoning,
)


@dataclass(frozen=True)
class PreparedResponses:
    """A validated Responses request, ready for the engine."""

    request: ConversationRequest
    prompt_token_ids: list[int]
    sampling: SamplingOptions
    stream: bool
    echo: Any
    namespace_tool_map: dict[str, tuple[str, str]]
    constraint: Constraint | None
    reasoning: ReasoningRequest = field(default_factory=ReasoningRequest)
    images: Images | None = None


def _reject_stateful_options(body: dict[str, Any]) -> None:
    """What only the store serves (it takes these fields out of the bodies it prepares), and
    what this server serves in no case."""
    if body.get("previous_response_id") is not None:
        raise BadRequestError(
            "previous_response_id is not supported: this server stores no responses "
            "(--response-store none); send the whole conversation in `input`",
            param="previous_response_id",
        )
    if optional_bool(body, "store"):
        raise BadRequestError(
            "store: true is not supported: this server stores no responses "
            "(--response-store none); omit `store` or set it to false",
            param="store",
        )
    if body.get("conversation") is not None:
        raise BadRequestError(
            "the Conversations API is not served: continue a conversation with "
            "`previous_response_id`, or send it whole in `input`",
            param="conversation",
            kind=ErrorKind.UNSUPPORTED,
        )
    if optional_bool(body, "background"):
        raise BadRequestError("background responses are not supported", param="background")


#: The `input` item types deepseek-recipe converts (an item without `type` is a message); the
#: recipe silently drops any other type, so this server rejects them.
INPUT_ITEM_TYPES = frozenset(
    {
        "message",
        "reasoning",
        "function_call",
        "function_call_output",
        "custom_tool_call",
        "custom_tool_call_output",
        "tool_search_call",
        "tool_search_output",
    }
)


def _check_input_items(body: dict[str, Any]) -> None:
    """400 naming the first `input` item whose type the conversion would drop."""
    items = body.get("input")
    if not isinstance(items, list):
        return
    for index, item in enumerate(items):
        if not isinstance(item, dict) or "type" not in item:
            continue  # the recipe rejects non-objects and reads typeless items as messages
        kind = item["type"]
        if not isinstance(kind, str) or kind not in INPUT_ITEM_TYPES:
            raise BadRequestError(
                f"input[{index}]: input item type {kind!r} is not supported; supported: "
                + ", ".join(sorted(INPUT_ITEM_TYPES)),
                param=f"input[{index}].type",
                kind=ErrorKind.UNSUPPORTED,
            )


_LOGPROBS_INCLUDE = "message.output_text.logprobs"


def _wants_logprobs(body: dict[str, Any]) -> bool:
    """`include: ["message.output_text.logprobs"]` asks for the output text's logprobs."""
    include = body.get("include")
    if include is None:
        return False
    if not isinstance(include, list) or not all(isinstance(item, str) for item in include):
        raise BadRequestError("'include' must be an array of strings", param="include")
    return _LOGPROBS_INCLUDE in include


def prepare_responses(body: dict[str, Any], recipe: RecipeContext) -> PreparedResponses:
    """Turn a decoded Responses body into prompt token IDs and sampling options."""
    _reject_stateful_options(body)
    _check_input_items(body)
    reject_n(body, "the Responses API")
    check_model(body, recipe.served_model_names)
    read_constraint(RESPONSES_CONSTRAINT, body, thinking=False)
    body, conversation = restore_reasoning(body, recipe.reasoning_seal)

    def convert(
        body: dict[str, Any],
    ) -> tuple[ConversationRequest, Any, dict[str, tuple[str, str]]]:
        request = ResponsesRequest(body)
        namespace_tool_map = request.namespace_tool_map(recipe.options)
        echo = request.echo()  # before convert(), which consumes the request
        return request.convert(recipe.options), echo, namespace_tool_map

    converted, echo, namespace_tool_map = convert_honouring_tool_choice(
        convert, body, "auto", "text.format"
    )
    constraint = read_constraint(RESPONSES_CONSTRAINT, body, converted.conversation.thinking_mode)
    engine = engine_input(converted, recipe, ignore_eos=False, logprobs=_wants_logprobs(body))
    return PreparedResponses(
        converted,
        engine.prompt_token_ids,
        engine.sampling,
        converted.stream,
        echo,
        namespace_tool_map,
        constraint,
        ReasoningRequest.of(body, conversation),
        images=engine.images,
    )


def responses_output(
    prepared: PreparedResponses,
    response_id: str,
    recipe: RecipeContext,
    stored: StoredEcho | None = None,
) -> ResponsesOutput:
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

    def fields(self) -> dict[str, Any]:
        return {"store": self.store, "previous_response_id": self.previous_response_id}


class ResponsesOutput(NamedEventOutput):
    """Responses events, with reasoning items finished as the request asked (`ReasoningItems`).

    With `stored` (a request the store serves), every response object reports its `store` and
    `previous_response_id`, and a stored stream's terminal event is held back (`held`, with the
    response it carries in `final`) until the caller has written the response to the store.
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
        self._hold = stored is not None and stored.store
        #: The held terminal event (a stored stream), and the response object it carries.
        self.held: list[str] = []
        self.final: dict[str, Any] | None = None

    def _stream_payloads(self, chunks: list[Any]) -> list[str]:
        payloads = []
        for chunk in chunks:
            name = self._event_name(chunk)
            echoes = self._echo is not None and name in _RESPONSE_OBJECT_EVENTS
            if not echoes and not self._items.wants_event(name):
                payloads.append(named_event(name, chunk.to_json()))
                continue
            for event in self._items.event(name, orjson.loads(chunk.to_json())):
                if self._echo is not None and isinstance(event.get("response"), dict):
                    event["response"].update(self._echo)
                payload = named_event(event["type"], orjson.dumps(event).decode())
                if self._hold and event["type"] in _TERMINAL_EVENTS:
                    self.final = event["response"]
                    self.held.append(payload)
                else:
                    payloads.append(payload)
        return payloads

    def response(self) -> dict[str, Any]:
        """The non-streaming response object (made once: the request has ended)."""
        if self.final is None:
            response = self._items.response(orjson.loads(super().response_json()))
            if self._echo is not None:
                response.update(self._echo)
            self.final = response
        return self.final

    def response_json(self) -> bytes:
        return orjson.dumps(self.response())
