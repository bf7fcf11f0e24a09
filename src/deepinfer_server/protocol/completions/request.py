"""Legacy Completions (`POST /v1/completions`) request preparation, as vLLM serves it.

No chat template: a string prompt is tokenized as given, with the BOS token the tokenizer's
configuration adds; a token-ID prompt goes to the engine unchanged. A list of prompts, or
`n > 1`, makes one engine request per choice (`branches()`), in OpenAI's order: choice
`prompt_index * n + i`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from deepinfer_server.errors import BadRequestError, ContextLengthError, ErrorKind
from deepinfer_server.ipc.messages import SamplingOptions
from deepinfer_server.model.tokens import BOS_TOKEN
from deepinfer_server.protocol.core.body import (
    NO_STREAM_OPTIONS,
    StreamOptions,
    TopLogprobs,
    check_stream_options,
)
from deepinfer_server.protocol.core.choices import seeds_for, with_seed
from deepinfer_server.protocol.core.json_types import JsonObject
from deepinfer_server.protocol.core.openai_body import OpenAIGenerationBody
from deepinfer_server.protocol.core.recipe import RecipeContext
from deepinfer_server.protocol.core.sampling import SAMPLING, Api, reject_logit_bias
from deepinfer_server.protocol.core.thinking_budget import budgeted
from deepinfer_server.protocol.core.validation import check_model

_SAMPLING = SAMPLING[Api.COMPLETIONS]

#: OpenAI's and vLLM's default for completions.
DEFAULT_MAX_TOKENS = 16
MAX_STOP_SEQUENCES = 16


class CompletionBody(OpenAIGenerationBody, kw_only=True, frozen=True):
    """The Completions fields the server reads (and the prompt: `_prompts`, `text_prompt`)."""

    stream: bool | None = None
    echo: bool | None = None
    #: `logprobs: k`: report the top k alternatives of each token.
    logprobs: TopLogprobs | None = None


@dataclass(frozen=True)
class PreparedCompletion:
    """One choice of a validated Completions request, ready for the engine."""

    prompt_token_ids: list[int]
    sampling: SamplingOptions
    stream: bool
    stream_options: StreamOptions
    #: The prompt as text (what `echo` prepends).
    prompt_text: str
    echo: bool
    #: `logprobs: k`: report the top k alternatives of each token (None: no logprobs).
    logprobs: int | None
    stop: tuple[str, ...]
    #: `max_tokens: 0` with echo scores the prompt without generating (lm-eval).
    generate: bool
    index: int = 0
    #: Distinct prompts of the whole request (for usage: each prompt counts once).
    prompt_index: int = 0
    #: `cache_salt`: only requests with the same salt share cached prefixes.
    cache_salt: str | None = None

    @property
    def constraint(self) -> None:
        """Completions has no structured output."""
        return None

    @property
    def images(self) -> None:
        """Completions takes text or token IDs only."""
        return None


def _prompts(body: JsonObject, recipe: RecipeContext) -> list[tuple[list[int], str]]:
    """Each prompt as (token IDs, text)."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return [text_prompt(prompt, recipe)]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(item, str) for item in prompt):
            return [text_prompt(item, recipe) for item in prompt]
        if _is_ids(prompt):
            return [_ids_prompt(prompt, recipe)]
        if all(isinstance(item, list) and item and _is_ids(item) for item in prompt):
            return [_ids_prompt(ids, recipe) for ids in prompt]
    raise BadRequestError(
        "'prompt' must be a string, an array of strings, an array of token IDs or an array of "
        "token-ID arrays, and must not be empty",
        param="prompt",
    )


def _is_ids(items: list[Any]) -> bool:
    return all(isinstance(i, int) and not isinstance(i, bool) for i in items)


def _ids_prompt(ids: list[int], recipe: RecipeContext) -> tuple[list[int], str]:
    bound = recipe.prompt_id_bound
    low, high = min(ids), max(ids)
    if low < 0 or high >= bound:
        # The engine would drop the request (DeepInfer's add_request checks the same range);
        # beyond int32 it could not even be sent.
        raise BadRequestError(
            f"'prompt' holds token ID {low if low < 0 else high}, outside this model's "
            f"vocabulary: token IDs must be in [0, {bound})",
            param="prompt",
        )
    # The text `echo` prepends: every token of the prompt, special ones included.
    return list(ids), recipe.decoder.decode(ids, skip_special_tokens=False)


def text_prompt(text: str, recipe: RecipeContext) -> tuple[list[int], str]:
    """A text prompt's token IDs (with the BOS token first, added unless the text has it)
    and the text."""
    ids = list(recipe.tokenizer.encode(text))
    bos = recipe.tokenizer.encode(BOS_TOKEN)
    if ids[: len(bos)] != bos:
        ids = [*bos, *ids]
    return ids, text


def _stop(body: JsonObject) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if (
        not isinstance(stop, list)
        or len(stop) > MAX_STOP_SEQUENCES
        or not all(isinstance(s, str) and s for s in stop)
    ):
        raise BadRequestError(
            f"'stop' must be a non-empty string or up to {MAX_STOP_SEQUENCES} of them",
            param="stop",
        )
    return tuple(stop)


def _reject_unsupported(body: JsonObject, n: int) -> None:
    if body.get("suffix") not in (None, ""):
        raise BadRequestError(
            "'suffix' is not supported", param="suffix", kind=ErrorKind.UNSUPPORTED
        )
    best_of = body.get("best_of")
    if best_of is not None and best_of != n:
        raise BadRequestError(
            "'best_of' is supported only equal to n", param="best_of", kind=ErrorKind.UNSUPPORTED
        )


def _check_completion(body: JsonObject, recipe: RecipeContext) -> CompletionBody:
    """The Completions fields the server reads, typed and checked against each other."""
    if not isinstance(body.get("model"), str):
        raise BadRequestError("'model' is required and must be a string", param="model")
    check_model(body, recipe.served_model_names)
    typed = _SAMPLING.typed(body, CompletionBody)
    _reject_unsupported(body, typed.n or 1)
    reject_logit_bias(body)
    check_stream_options(typed.stream_options, typed.stream)
    if typed.echo and typed.logprobs is not None and recipe.prompt_logprobs_unavailable:
        raise BadRequestError(
            f"'echo' with 'logprobs' needs prompt logprobs, and "
            f"{recipe.prompt_logprobs_unavailable}",
            param="echo",
            kind=ErrorKind.UNSUPPORTED,
        )
    if typed.max_tokens == 0 and not typed.echo:
        raise BadRequestError("'max_tokens' must be at least 1 without echo", param="max_tokens")
    return typed


def _max_tokens(typed: CompletionBody) -> int:
    return DEFAULT_MAX_TOKENS if typed.max_tokens is None else typed.max_tokens


def _sampling(typed: CompletionBody) -> SamplingOptions:
    """The request's sampling options, before each prompt's room and thinking."""
    echo, logprobs = bool(typed.echo), typed.logprobs
    return _SAMPLING.options(
        _SAMPLING.values(typed),
        max_tokens=max(_max_tokens(typed), 1),  # DeepInfer generates at least one token
        ignore_eos=bool(typed.ignore_eos),
        logprobs=logprobs is not None,
        top_logprobs=logprobs or 0,
        prompt_logprobs=echo and logprobs is not None,
    )


def _prompt_sampling(
    ids: list[int], sampling: SamplingOptions, max_tokens: int, recipe: RecipeContext
) -> SamplingOptions:
    """One prompt's sampling options: max_tokens within the context, the thinking budget."""
    room = recipe.room_for(len(ids), max_tokens)
    if room is not None:  # --clamp-max-tokens
        sampling = msgspec.structs.replace(sampling, max_tokens=room)
    elif len(ids) + max_tokens > recipe.context_limit:
        raise ContextLengthError(
            f"This model's maximum context length is {recipe.context_limit} tokens; the "
            f"prompt has {len(ids)} tokens and max_tokens is {max_tokens}",
            param="prompt",
        )
    # A raw prompt thinks when it ends as a thinking prompt does, with `<think>`.
    thinking = bool(ids) and ids[-1] == recipe.think_start_id
    return budgeted(sampling, thinking, recipe.think_end_id)


def prepare_completion(body: JsonObject, recipe: RecipeContext) -> list[PreparedCompletion]:
    """Validate a Completions body: one prepared choice per (prompt, i < n)."""
    typed = _check_completion(body, recipe)
    n, max_tokens = typed.n or 1, _max_tokens(typed)
    sampling, stop = _sampling(typed), _stop(body)
    prepared: list[PreparedCompletion] = []
    for prompt_index, (ids, text) in enumerate(_prompts(body, recipe)):
        prompt_sampling = _prompt_sampling(ids, sampling, max_tokens, recipe)
        for i, choice_seed in enumerate(seeds_for(sampling.seed, n)):
            prepared.append(
                PreparedCompletion(
                    ids,
                    with_seed(prompt_sampling, choice_seed),
                    bool(typed.stream),
                    typed.stream_options or NO_STREAM_OPTIONS,
                    text,
                    bool(typed.echo),
                    typed.logprobs,
                    stop,
                    max_tokens > 0,
                    index=prompt_index * n + i,
                    prompt_index=prompt_index,
                    cache_salt=typed.cache_salt,
                )
            )
    return prepared
