"""Chat Completions request preparation: validate, convert, encode, resolve max_tokens."""

from __future__ import annotations

from dataclasses import dataclass, replace

from deepseek_recipe import ChatCompletionRequest, ConversationRequest

from deepinfer_server.grammar import Constraint, in_thinking_mode
from deepinfer_server.ipc.messages import Images, SamplingOptions
from deepinfer_server.protocol.chat.history import recipe_messages
from deepinfer_server.protocol.core.body import (
    NO_STREAM_OPTIONS,
    StreamOptions,
    TopLogprobs,
    UInt32,
    check_stream_options,
)
from deepinfer_server.protocol.core.cache_retention import check_cache_retention
from deepinfer_server.protocol.core.choices import seeds_for, with_seed
from deepinfer_server.protocol.core.effort import check_effort_agrees, read_effort
from deepinfer_server.protocol.core.field_errors import BodyShape
from deepinfer_server.protocol.core.json_types import JsonObject
from deepinfer_server.protocol.core.openai_body import OpenAIGenerationBody
from deepinfer_server.protocol.core.prepare import engine_input
from deepinfer_server.protocol.core.recipe import RecipeContext
from deepinfer_server.protocol.core.sampling import SAMPLING, Api, reject_logit_bias
from deepinfer_server.protocol.core.structured import (
    CHAT_CONSTRAINT,
    convert_honouring_tool_choice,
    read_constraint,
)
from deepinfer_server.protocol.core.thinking_budget import merge_budgets
from deepinfer_server.protocol.core.validation import check_chat_fields, check_model

_SAMPLING = SAMPLING[Api.CHAT]
#: How the recipe parses a Chat body (see `field_errors`).
_SHAPE = BodyShape(
    ChatCompletionRequest, {"model": "", "messages": [{"role": "user", "content": ""}]}
)
_ENABLE_THINKING = 'send `thinking: {"type": "enabled"}`'


class ChatBody(OpenAIGenerationBody, kw_only=True, frozen=True):
    """The Chat Completions fields the server reads itself (deepseek-recipe converts the
    body's messages, tools and the rest)."""

    logprobs: bool | None = None
    top_logprobs: TopLogprobs | None = None
    #: The OpenAI client's current name wins over the deprecated max_tokens, as in vLLM.
    max_completion_tokens: UInt32 | None = None


@dataclass(frozen=True)
class PreparedChat:
    """A validated Chat Completions request, ready for the engine."""

    request: ConversationRequest
    prompt_token_ids: list[int]
    sampling: SamplingOptions
    stream: bool
    stream_options: StreamOptions
    constraint: Constraint | None
    images: Images | None = None
    #: The choice this engine request produces (n > 1 makes one PreparedChat per choice).
    index: int = 0
    prompt_index: int = 0
    #: `cache_salt`: only requests with the same salt share cached prefixes.
    cache_salt: str | None = None


def convert_chat(
    body: JsonObject, recipe: RecipeContext
) -> tuple[ConversationRequest, Constraint | None]:
    """A checked Chat Completions body converted by deepseek-recipe: the conversation whose
    prompt the engine gets (`/tokenize` with `messages` renders the same one), and what the
    request constrains."""
    effort = read_effort(body.get("reasoning_effort"), "reasoning_effort")
    constraint = read_constraint(CHAT_CONSTRAINT, body)
    converted = convert_honouring_tool_choice(
        lambda b: ChatCompletionRequest(b).convert(recipe.options),
        body,
        "auto",
        "response_format",
        shape=_SHAPE,
    )
    thinking = converted.conversation.thinking_mode
    check_effort_agrees(effort, thinking, "reasoning_effort", _ENABLE_THINKING)
    return converted, in_thinking_mode(constraint, thinking)


def read_chat_body(body: JsonObject) -> ChatBody:
    """The Chat Completions fields the server reads, typed (a 400 naming a refused one)."""
    typed = _SAMPLING.typed(body, ChatBody)
    check_stream_options(typed.stream_options, body.get("stream"))
    return typed


def recipe_body(body: JsonObject, typed: ChatBody) -> JsonObject:
    """The body deepseek-recipe converts, a new dict (the client's is left as sent): messages as
    the recipe takes them, no `n` (the recipe accepts only 1; the choices are the server's), and
    `max_completion_tokens` as the `max_tokens` it wins over."""
    rest = {key: value for key, value in body.items() if key != "n"}
    max_tokens = (
        {} if typed.max_completion_tokens is None else {"max_tokens": typed.max_completion_tokens}
    )
    return {**rest, "messages": recipe_messages(body["messages"]), **max_tokens}


def prepare_chat(body: JsonObject, recipe: RecipeContext) -> PreparedChat | list[PreparedChat]:
    """Turn a decoded Chat Completions body into prompt token IDs and sampling options.

    With n > 1, one PreparedChat per choice, each with its own seed (derived from `seed`).
    Raises BadRequestError (400) or ModelNotFoundError (404); never anything else on bad input.
    """
    check_chat_fields(body)
    retention = check_cache_retention(body)
    typed = read_chat_body(body)
    sampling = _SAMPLING.values(typed)
    merge_budgets(sampling, body)
    reject_logit_bias(body)
    check_model(body, recipe.served_model_names)
    converted, constraint = convert_chat(recipe_body(body, typed), recipe)
    ignore_eos = bool(typed.ignore_eos)
    engine = engine_input(
        converted,
        recipe,
        ignore_eos,
        protocol=_SAMPLING,
        sampling=sampling,
        retention_seconds=retention,
    )
    prepared = PreparedChat(
        converted,
        engine.prompt_token_ids,
        engine.sampling,
        converted.stream,
        typed.stream_options or NO_STREAM_OPTIONS,
        constraint,
        images=engine.images,
        cache_salt=typed.cache_salt,
    )
    return per_choice(prepared, typed.n or 1)


def per_choice(prepared: PreparedChat, n: int) -> PreparedChat | list[PreparedChat]:
    """One prepared request per choice, each with its own seed (derived from `seed`)."""
    if n == 1:
        return prepared
    seeds = seeds_for(prepared.sampling.seed, n)
    return [
        replace(prepared, sampling=with_seed(prepared.sampling, seed), index=index)
        for index, seed in enumerate(seeds)
    ]
