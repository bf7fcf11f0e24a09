"""The protocol-independent half of request preparation: encode, check, resolve max_tokens."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from deepseek_recipe import ConversationRequest, RenderedPrompt

from deepinfer_server.errors import ApiError, ContextLengthError
from deepinfer_server.ipc.messages import Images, SamplingOptions
from deepinfer_server.protocol.core.images import image_sources, place_images, resolve_images
from deepinfer_server.protocol.core.recipe import RecipeContext, recipe_errors
from deepinfer_server.protocol.core.sampling import EngineValues, ProtocolSampling
from deepinfer_server.protocol.core.thinking_budget import budgeted


@dataclass(frozen=True)
class EngineInput:
    """What the engine needs from a converted request."""

    prompt_token_ids: list[int]
    sampling: SamplingOptions
    images: Images | None = None


#: Builds a protocol's own context-overflow error: (prompt tokens, max_tokens, context limit).
ContextOverflow = Callable[[int, int | None, int], ApiError]


def _reject_provably_too_long(
    converted: ConversationRequest,
    recipe: RecipeContext,
    overflow: ContextOverflow | None,
    rendered: RenderedPrompt,
) -> None:
    """400 before tokenizing a prompt whose text alone has more bytes than the context can hold.

    Rendering is cheap (tens of ms for megabytes); tokenizing a multi-megabyte prompt takes
    seconds of CPU, which an oversized request must not get.
    """
    size = len(rendered.prompt.encode())
    at_least = -(-size // recipe.max_token_bytes)
    if at_least > recipe.context_limit:
        if overflow is not None:
            limit = recipe.context_limit
            raise overflow(at_least, converted.inference_options.max_tokens, limit)
        raise ContextLengthError(
            f"This model's maximum context length is {recipe.context_limit} tokens. However, "
            f"your messages resulted in at least {at_least} tokens ({size} bytes of text). "
            "Please reduce the length of the messages.",
            param="messages",
        )


def _max_tokens(
    converted: ConversationRequest,
    recipe: RecipeContext,
    prompt_tokens: int,
    overflow: ContextOverflow | None,
) -> int:
    """The request's max_tokens resolved against the room the prompt leaves."""
    requested = converted.inference_options.max_tokens
    limit = recipe.context_limit
    try:
        with recipe_errors():
            clamped = recipe.room_for(prompt_tokens, requested)
            resolved: int = clamped or converted.resolve_max_tokens(prompt_tokens, limit)
            return resolved
    except ContextLengthError as exc:
        if overflow is None:
            raise
        raise overflow(prompt_tokens, requested, limit) from exc


def engine_input(
    converted: ConversationRequest,
    recipe: RecipeContext,
    ignore_eos: bool,
    overflow: ContextOverflow | None = None,
    *,
    protocol: ProtocolSampling,
    sampling: EngineValues,
    logprobs: bool = False,
    retention_seconds: int = 0,
) -> EngineInput:
    """Encode the conversation (V4.1) and resolve max_tokens against the context (lowered to
    the room left with `--clamp-max-tokens`, the default, where the recipe would refuse it).

    `sampling` is what `protocol.read` read of the body. `logprobs` asks for them
    even when the converted request does not (Responses `include`). `retention_seconds` is how
    long the request asks the prefix cache to keep its prompt (`cache_retention`).
    Images are decoded and checked here (a 400 or 413 for bad ones); each counts at its image
    token count against the context. A prompt that does not fit is a ContextLengthError, or
    `overflow`'s error when the protocol words it its own way.
    """
    with recipe_errors():
        rendered = recipe.encoding.render_conversation(converted.conversation)
        # Before any image is fetched or decoded: a prompt that cannot fit costs nothing more.
        _reject_provably_too_long(converted, recipe, overflow, rendered)
        sources = image_sources(converted)
        images = None
        if sources:
            images = resolve_images(sources, recipe.image_limits, recipe.image_resolver)
        prompt_token_ids = recipe.encode(converted.conversation, rendered)
    if images is not None and recipe.image_policy is not None:
        prompt_token_ids, images = place_images(prompt_token_ids, images, recipe.image_policy)
    prompt_tokens = Images.prompt_tokens(prompt_token_ids, images)
    max_tokens = _max_tokens(converted, recipe, prompt_tokens, overflow)
    inference = converted.inference_options
    logprobs = logprobs or inference.logprobs
    options = protocol.options(
        sampling,
        inference,
        max_tokens=max_tokens,
        ignore_eos=ignore_eos,
        logprobs=logprobs,
        top_logprobs=(inference.top_logprobs or 0) if logprobs else 0,
        retention_seconds=retention_seconds,
    )
    options = budgeted(options, converted.conversation.thinking_mode, recipe.think_end_id)
    return EngineInput(prompt_token_ids, options, images)
