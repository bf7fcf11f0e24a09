"""The protocol-independent half of request preparation: encode, check, resolve max_tokens."""

from __future__ import annotations

from dataclasses import dataclass

from deepseek_recipe import ConversationRequest

from deepinfer_server.errors import BadRequestError, ContextLengthError, ErrorKind
from deepinfer_server.ipc.messages import SamplingOptions
from deepinfer_server.protocol.recipe import RecipeContext, recipe_errors


@dataclass(frozen=True)
class EngineInput:
    """What the engine needs from a converted request."""

    prompt_token_ids: list[int]
    sampling: SamplingOptions


def _reject_provably_too_long(converted: ConversationRequest, recipe: RecipeContext) -> None:
    """400 before tokenizing a prompt whose text alone has more bytes than the context can hold.

    Rendering is cheap (tens of ms for megabytes); tokenizing a multi-megabyte prompt takes
    seconds of CPU, which an oversized request must not get.
    """
    size = len(recipe.encoding.render_conversation(converted.conversation).prompt.encode())
    at_least = -(-size // recipe.max_token_bytes)
    if at_least > recipe.context_limit:
        raise ContextLengthError(
            f"This model's maximum context length is {recipe.context_limit} tokens. However, "
            f"your messages resulted in at least {at_least} tokens ({size} bytes of text). "
            "Please reduce the length of the messages.",
            param="messages",
        )


def engine_input(
    converted: ConversationRequest, recipe: RecipeContext, ignore_eos: bool
) -> EngineInput:
    """Encode the conversation (V4.1) and resolve max_tokens against the context.

    Raises BadRequestError for images (not supported yet) and for prompts that do not fit.
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
        _reject_provably_too_long(converted, recipe)
        prompt_token_ids = recipe.encoding.encode(converted.conversation)
        max_tokens = converted.resolve_max_tokens(len(prompt_token_ids), recipe.context_limit)
    inference = converted.inference_options
    sampling = SamplingOptions(
        max_tokens=max_tokens,
        temperature=inference.temperature,
        top_p=inference.top_p,
        ignore_eos=ignore_eos,
        seed=inference.seed,
    )
    return EngineInput(prompt_token_ids, sampling)
