"""The protocol-independent half of request preparation: encode, check, resolve max_tokens."""

from __future__ import annotations

from dataclasses import dataclass

from deepseek_recipe import ConversationRequest

from deepinfer_server.ipc.messages import Images, SamplingOptions
from deepinfer_server.protocol.images import image_sources, resolve_images
from deepinfer_server.protocol.recipe import RecipeContext, recipe_errors


@dataclass(frozen=True)
class EngineInput:
    """What the engine needs from a converted request."""

    prompt_token_ids: list[int]
    sampling: SamplingOptions
    images: Images | None = None


def engine_input(
    converted: ConversationRequest,
    recipe: RecipeContext,
    ignore_eos: bool,
    *,
    top_k: int = -1,
    logprobs: bool = False,
) -> EngineInput:
    """Encode the conversation (V4.1) and resolve max_tokens against the context.

    `logprobs` asks for them even when the converted request does not (Responses `include`).

    Images are decoded and checked here (a 400 or 413 for bad ones); each counts at its image
    token count against the context. Raises BadRequestError for prompts that do not fit.
    """
    with recipe_errors():
        sources = image_sources(converted)
        images = None
        if sources:
            images = resolve_images(sources, recipe.image_limits, recipe.image_resolver)
        prompt_token_ids = recipe.encoding.encode(converted.conversation)
        max_tokens = converted.resolve_max_tokens(
            Images.prompt_tokens(prompt_token_ids, images), recipe.context_limit
        )
    inference = converted.inference_options
    logprobs = logprobs or inference.logprobs
    sampling = SamplingOptions(
        max_tokens=max_tokens,
        temperature=inference.temperature,
        top_p=inference.top_p,
        ignore_eos=ignore_eos,
        seed=inference.seed,
        top_k=top_k,
        logprobs=logprobs,
        top_logprobs=(inference.top_logprobs or 0) if logprobs else 0,
    )
    return EngineInput(prompt_token_ids, sampling, images)
