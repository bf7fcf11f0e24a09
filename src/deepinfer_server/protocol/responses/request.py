"""OpenAI Responses API (`POST /v1/responses`): request preparation."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from deepseek_recipe import ConversationRequest, ResponsesRequest

from deepinfer_server.errors import BadRequestError, ErrorKind
from deepinfer_server.grammar import Constraint, in_thinking_mode
from deepinfer_server.ipc.messages import Images, SamplingOptions
from deepinfer_server.protocol.core.body import CacheSalt
from deepinfer_server.protocol.core.cache_retention import check_cache_retention
from deepinfer_server.protocol.core.choices import reject_n
from deepinfer_server.protocol.core.effort import check_effort_agrees, read_effort
from deepinfer_server.protocol.core.field_errors import BodyShape
from deepinfer_server.protocol.core.json_types import JsonObject
from deepinfer_server.protocol.core.prepare import engine_input
from deepinfer_server.protocol.core.recipe import RecipeContext
from deepinfer_server.protocol.core.sampling import SAMPLING, Api, ResponsesSampling
from deepinfer_server.protocol.core.structured import (
    RESPONSES_CONSTRAINT,
    convert_honouring_tool_choice,
    read_constraint,
)
from deepinfer_server.protocol.core.validation import check_model, optional_bool, refuse_given
from deepinfer_server.protocol.responses.reasoning import (
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
    #: `cache_salt`: only requests with the same salt share cached prefixes.
    cache_salt: str | None = None
    #: `prompt_cache_retention` as asked (checked and echoed; the engine pins the prompt).
    cache_retention: str | None = None


def _reject_stateful_options(body: JsonObject) -> None:
    """What only the store serves (it takes these fields out of the bodies it prepares), and
    what this server serves in no case."""
    refuse_given(
        body,
        "previous_response_id",
        "previous_response_id is not supported: this server stores no responses "
        "(--response-store none); send the whole conversation in `input`",
    )
    if optional_bool(body, "store"):
        raise BadRequestError(
            "store: true is not supported: this server stores no responses "
            "(--response-store none); omit `store` or set it to false",
            param="store",
        )
    refuse_given(
        body,
        "conversation",
        "conversations need the Responses store: this server stores none "
        "(--response-store none); send the whole conversation in `input`",
        kind=ErrorKind.UNSUPPORTED,
    )
    if optional_bool(body, "background"):
        raise BadRequestError(
            "background responses need the Responses store: this server stores no responses "
            "(--response-store none)",
            param="background",
        )


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


def check_item_type(kind: object, where: str) -> None:
    """400 (unsupported) naming `where` for an input item type outside `INPUT_ITEM_TYPES`."""
    if not isinstance(kind, str) or kind not in INPUT_ITEM_TYPES:
        raise BadRequestError(
            f"{where}: input item type {kind!r} is not supported; supported: "
            + ", ".join(sorted(INPUT_ITEM_TYPES)),
            param=f"{where}.type",
            kind=ErrorKind.UNSUPPORTED,
        )


_SAMPLING = SAMPLING[Api.RESPONSES]
#: How the recipe parses a Responses body (see `field_errors`).
_SHAPE = BodyShape(ResponsesRequest, {"model": "", "input": ""})


class ResponsesBody(ResponsesSampling, kw_only=True, frozen=True):
    """The Responses fields the server reads itself as typed fields (deepseek-recipe converts
    the input, tools and the rest; `reasoning`, `include` and the stateful options are read on
    their own)."""

    cache_salt: CacheSalt | None = None
    #: Names the request's session for the rank choice (`protocol/core/session_key.py`).
    prompt_cache_key: str | None = None


def _check_input_items(body: JsonObject) -> None:
    """400 naming the first `input` item whose type the conversion would drop."""
    items = body.get("input")
    if not isinstance(items, list):
        return
    for index, item in enumerate(items):
        if not isinstance(item, dict) or "type" not in item:
            continue  # the recipe rejects non-objects and reads typeless items as messages
        check_item_type(item["type"], f"input[{index}]")


_LOGPROBS_INCLUDE = "message.output_text.logprobs"


def _wants_logprobs(body: JsonObject) -> bool:
    """`include: ["message.output_text.logprobs"]` asks for the output text's logprobs."""
    include = body.get("include")
    if include is None:
        return False
    if not isinstance(include, list) or not all(isinstance(item, str) for item in include):
        raise BadRequestError("'include' must be an array of strings", param="include")
    return _LOGPROBS_INCLUDE in include


def prepare_responses(body: JsonObject, recipe: RecipeContext) -> PreparedResponses:
    """Turn a decoded Responses body into prompt token IDs and sampling options."""
    _reject_stateful_options(body)
    _check_input_items(body)
    retention = check_cache_retention(body)
    reject_n(body, "the Responses API")
    check_model(body, recipe.served_model_names)
    typed = _SAMPLING.typed(body, ResponsesBody)
    reasoning = body.get("reasoning")
    effort = read_effort(
        reasoning.get("effort") if isinstance(reasoning, dict) else None, "reasoning.effort"
    )
    constraint = read_constraint(RESPONSES_CONSTRAINT, body)
    body, conversation = restore_reasoning(body, recipe.reasoning_seal)

    def convert(
        relaxed: JsonObject,
    ) -> tuple[ConversationRequest, Any, dict[str, tuple[str, str]]]:
        request = ResponsesRequest(relaxed)
        namespace_tool_map = request.namespace_tool_map(recipe.options)
        # Before convert(), which consumes the request; a relaxed body (a json_object format
        # converted as its schema) still echoes what the client sent.
        echo = request.echo() if relaxed is body else ResponsesRequest(body).echo()
        return request.convert(recipe.options), echo, namespace_tool_map

    converted, echo, namespace_tool_map = convert_honouring_tool_choice(
        convert, body, "auto", "text.format", shape=_SHAPE
    )
    thinking_mode = converted.conversation.thinking_mode
    check_effort_agrees(effort, thinking_mode, "reasoning.effort", "enable thinking")
    constraint = in_thinking_mode(constraint, thinking_mode)
    engine = engine_input(
        converted,
        recipe,
        ignore_eos=False,
        protocol=_SAMPLING,
        sampling=_SAMPLING.values(typed),
        logprobs=_wants_logprobs(body),
        retention_seconds=retention,
    )
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
        cache_salt=typed.cache_salt,
        cache_retention=body.get("prompt_cache_retention"),
    )
