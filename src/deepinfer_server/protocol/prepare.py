"""The protocol-independent half of request preparation: encode, check, resolve max_tokens."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from deepseek_recipe import ConversationRequest

from deepinfer_server.errors import ApiError, BadRequestError, ContextLengthError, ErrorKind
from deepinfer_server.ipc.messages import SamplingOptions
from deepinfer_server.protocol.recipe import RecipeContext, recipe_errors


@dataclass(frozen=True)
class EngineInput:
    """What the engine needs from a converted request."""

    prompt_token_ids: list[int]
    sampling: SamplingOptions


#: Builds a protocol's own context-overflow error: (prompt tokens, max_tokens, context limit).
ContextOverflow = Callable[[int, int | None, int], ApiError]


def _reject_provably_too_long(
    converted: ConversationRequest, recipe: RecipeContext, overflow: ContextOverflow | None
) -> None:
    """400 before tokenizing a prompt whose text alone has more bytes than the context can hold.

    Rendering is cheap (tens of ms for megabytes); tokenizing a multi-megabyte prompt takes
    seconds of CPU, which an oversized request must not get.
    """
    size = len(recipe.encoding.render_conversation(converted.conversation).prompt.encode())
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


def engine_input(
    converted: ConversationRequest,
    recipe: RecipeContext,
    ignore_eos: bool,
    overflow: ContextOverflow | None = None,
) -> EngineInput:
    """Encode the conversation (V4.1) and resolve max_tokens against the context.

    Raises BadRequestError for images (not supported yet) and for prompts that do not fit
    (ContextLengthError, or `overflow`'s error when the protocol words it its own way).
    """
    with recipe_errors():
        for index, message in enumerate(converted.conversation.messages):
            if message.image_sources:
                raise BadRequestError(
                    "image content is not supported by this server yet",
                    param=f"messages[{index}]",
                    kind=ErrorKind.UNSUPPORTED,
                    code="unsupported_content",
                )
        _reject_provably_too_long(converted, recipe, overflow)
        prompt_token_ids = recipe.encoding.encode(converted.conversation)
    try:
        with recipe_errors():
            max_tokens = converted.resolve_max_tokens(len(prompt_token_ids), recipe.context_limit)
    except ContextLengthError as exc:
        if overflow is None:
            raise
        requested = converted.inference_options.max_tokens
        raise overflow(len(prompt_token_ids), requested, recipe.context_limit) from exc
    inference = converted.inference_options
    sampling = SamplingOptions(
        max_tokens=max_tokens,
        temperature=inference.temperature,
        top_p=inference.top_p,
        ignore_eos=ignore_eos,
        seed=inference.seed,
    )
    return EngineInput(prompt_token_ids, sampling)
