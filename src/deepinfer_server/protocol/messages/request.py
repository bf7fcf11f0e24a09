"""Anthropic Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`): request
preparation and token counting."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from deepseek_recipe import ConversationRequest, MessagesRequest

from deepinfer_server.errors import BadRequestError
from deepinfer_server.grammar import Constraint, in_thinking_mode
from deepinfer_server.ipc.messages import Images, SamplingOptions
from deepinfer_server.protocol.core.body import CacheSalt
from deepinfer_server.protocol.core.choices import reject_n
from deepinfer_server.protocol.core.field_errors import BodyShape
from deepinfer_server.protocol.core.json_types import JsonObject
from deepinfer_server.protocol.core.prepare import engine_input
from deepinfer_server.protocol.core.recipe import RecipeContext, recipe_errors
from deepinfer_server.protocol.core.sampling import (
    SAMPLING,
    Api,
    EngineValues,
    MessagesSampling,
)
from deepinfer_server.protocol.core.structured import (
    MESSAGES_CONSTRAINT,
    convert_honouring_tool_choice,
    read_constraint,
)
from deepinfer_server.protocol.core.thinking_budget import merge_budgets
from deepinfer_server.protocol.core.validation import check_model
from deepinfer_server.protocol.messages.cache_control import check_cache_control
from deepinfer_server.protocol.messages.compat import (
    anthropic_context_error,
    normalize_messages_body,
    reject_thread,
)
from deepinfer_server.protocol.messages.thinking import (
    check_messages_effort,
    read_messages_effort,
    with_explicit_thinking,
)

_SAMPLING = SAMPLING[Api.MESSAGES]
#: How the recipe parses a Messages body (see `field_errors`).
_SHAPE = BodyShape(
    MessagesRequest,
    {
        "model": "",
        "max_tokens": 1,
        "messages": [{"role": "user", "content": ""}],
    },
)


@dataclass(frozen=True)
class PreparedMessages:
    """A validated Messages request, ready for the engine."""

    request: ConversationRequest
    prompt_token_ids: list[int]
    sampling: SamplingOptions
    stream: bool
    constraint: Constraint | None
    images: Images | None = None
    #: `cache_salt` (an extension field, as vLLM's): only requests with the same salt share
    #: cached prefixes.
    cache_salt: str | None = None


class MessagesBody(MessagesSampling, kw_only=True, frozen=True):
    """The Messages fields the server reads itself as typed fields (deepseek-recipe converts
    the messages, system, tools and the rest)."""

    #: An extension field, as vLLM's.
    cache_salt: CacheSalt | None = None


class _Converted(NamedTuple):
    request: ConversationRequest
    #: The engine's values of the sampling fields the server checks.
    sampling: EngineValues
    constraint: Constraint | None
    cache_salt: str | None
    #: The seconds its `cache_control` breakpoints ask its prompt be kept (0: none).
    retention: int


def _convert(body: JsonObject, recipe: RecipeContext) -> _Converted:
    """The converted request, the sampling fields the server checks, what the request
    constrains, and its cache salt."""
    if body.get("max_tokens") is None:  # Anthropic's API requires it; the recipe would not
        raise BadRequestError("max_tokens: Field required", param="max_tokens")
    check_model(body, recipe.served_model_names)
    reject_thread(body)
    reject_n(body, "the Messages API")
    retention = check_cache_control(body)
    typed = _SAMPLING.typed(body, MessagesBody)
    sampling = _SAMPLING.values(typed)
    merge_budgets(sampling, body)
    effort = read_messages_effort(body)
    constraint = read_constraint(MESSAGES_CONSTRAINT, body)
    converted = convert_honouring_tool_choice(
        lambda b: MessagesRequest(b).convert(recipe.options),
        with_explicit_thinking(normalize_messages_body(body)),
        {"type": "auto"},
        "output_config.format",
        shape=_SHAPE,
    )
    thinking = converted.conversation.thinking_mode
    check_messages_effort(effort, thinking)
    constraint = in_thinking_mode(constraint, thinking)
    return _Converted(converted, sampling, constraint, typed.cache_salt, retention)


def prepare_messages(body: JsonObject, recipe: RecipeContext) -> PreparedMessages:
    """Turn a decoded Messages body into prompt token IDs and sampling options."""
    converted, sampling, constraint, cache_salt, retention = _convert(body, recipe)
    engine = engine_input(
        converted,
        recipe,
        ignore_eos=False,
        overflow=anthropic_context_error,
        protocol=_SAMPLING,
        sampling=sampling,
        retention_seconds=retention,
    )
    return PreparedMessages(
        converted,
        engine.prompt_token_ids,
        engine.sampling,
        converted.stream,
        constraint,
        images=engine.images,
        cache_salt=cache_salt,
    )


def count_message_tokens(body: JsonObject, recipe: RecipeContext) -> int:
    """The prompt tokens `/v1/messages` would encode for this body (system, tools, thinking).

    A count_tokens body has no `max_tokens`; any value converts the same prompt. Its
    `cache_salt` is checked as `/v1/messages` checks it (a salt changes no count).
    """
    converted = _convert({**body, "max_tokens": 1, "stream": False}, recipe)
    with recipe_errors():
        return len(recipe.encode(converted.request.conversation))
