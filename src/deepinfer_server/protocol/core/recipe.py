"""RecipeContext: the deepseek-recipe objects built once per server, and error translation.

This module and its siblings are the only code that touches deepseek-recipe; its exceptions are
translated into the server's ApiError tree here (`recipe_errors`), never above.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson
import tokenizers
from deepseek_recipe import (
    Conversation,
    ConversionError,
    ConversionOptions,
    DeepseekV41Encoding,
    ImageResolver,
    ModelVersion,
    RenderedPrompt,
    Tokenizer,
)

from deepinfer_server.errors import ApiError, BadRequestError, ContextLengthError, ErrorKind
from deepinfer_server.model.images import ImagePolicy, recipe_image_policy
from deepinfer_server.model.tokenizer import EMBEDDED_TOKENIZER_CONFIG
from deepinfer_server.model.tokens import THINK_END_TOKEN, THINK_START_TOKEN
from deepinfer_server.protocol.core.images import ImageLimits, new_resolver
from deepinfer_server.protocol.core.prompt_encoder import PromptEncoder
from deepinfer_server.protocol.core.reasoning_seal import ReasoningSeal, seal_key


@dataclass(frozen=True)
class RecipeContext:
    """Conversion options, the V4.1 prompt encoding, the tokenizer and the reasoning seal shared
    by every request."""

    options: ConversionOptions
    encoding: DeepseekV41Encoding
    tokenizer: Tokenizer
    served_model_names: tuple[str, ...]
    context_limit: int
    reasoning_seal: ReasoningSeal
    #: The most UTF-8 bytes of prompt text one token can stand for: a prompt of B bytes has at
    #: least B / max_token_bytes tokens, which bounds the work spent on oversized prompts.
    max_token_bytes: int
    #: The same vocabulary for what the recipe's tokenizer cannot do: decode single tokens.
    decoder: tokenizers.Tokenizer
    image_limits: ImageLimits
    image_resolver: ImageResolver
    #: One past the largest token ID a client may send in a prompt: the engine's own bound
    #: (`tokenizer.prompt_id_bound`), checked here so that the engine never sees one outside.
    prompt_id_bound: int
    #: Why the engine computes no prompt logprobs (`echo` with `logprobs` is then refused).
    prompt_logprobs_unavailable: str | None = None
    #: The image placeholder the engine expands and how it counts image tokens.
    image_policy: ImagePolicy | None = None
    #: `--clamp-max-tokens` (the default): a max_tokens beyond the room the prompt leaves is
    #: lowered to it; False (`--no-clamp-max-tokens`) refuses it.
    clamp_max_tokens: bool = True
    #: `encoding.encode`, reusing the tokens of an earlier prompt that the new one extends.
    prompt_encoder: PromptEncoder | None = None
    #: The tokenizer's `tokenizer_config.json` (the checkpoint's, or the embedded one's), which
    #: `GET /tokenizer_info` reports.
    tokenizer_config: Mapping[str, Any] = field(default_factory=dict)
    #: The IDs of `<think>` (a thinking prompt's last token) and `</think>` (the reasoning's end).
    think_start_id: int = -1
    think_end_id: int = -1

    @classmethod
    def create(
        cls,
        tokenizer_json: str,
        served_model_names: tuple[str, ...],
        context_limit: int,
        default_thinking: bool,
        reasoning_secret: str | None = None,
        image_limits: ImageLimits | None = None,
        *,
        reasoning_key: bytes | None = None,
        prompt_id_bound: int | None = None,
        prompt_logprobs_unavailable: str | None = None,
        image_policy: ImagePolicy | None = None,
        clamp_max_tokens: bool = True,
        tokenizer_config: Mapping[str, Any] | None = None,
    ) -> RecipeContext:
        """`reasoning_key` (a `reasoning_seal.seal_key`) shared by every API server process
        takes precedence over `reasoning_secret`; `prompt_id_bound` defaults to the
        tokenizer's vocabulary with its added tokens, `tokenizer_config` to the embedded
        tokenizer's."""
        tokenizer = Tokenizer.from_str(tokenizer_json)
        # Only the served names are accepted, all as DeepSeek-V4.1-Flash: the recipe's default
        # table would also accept "DeepSeek-V4-Pro" and render it with the wrong encoding.
        options = ConversionOptions(default_thinking_mode=default_thinking)
        options = options.with_model_versions_by_name(
            {name: ModelVersion.DeepseekV41Flash for name in served_model_names}
        )
        encoding = DeepseekV41Encoding().with_tokenizer(tokenizer)
        decoder = tokenizers.Tokenizer.from_str(tokenizer_json)
        image_limits = image_limits or ImageLimits()
        return cls(
            options,
            encoding,
            tokenizer,
            served_model_names,
            context_limit,
            ReasoningSeal(reasoning_key or seal_key(reasoning_secret)),
            max_token_bytes(tokenizer_json),
            decoder,
            image_limits,
            new_resolver(image_limits),
            prompt_id_bound or decoder.get_vocab_size(with_added_tokens=True),
            prompt_logprobs_unavailable,
            image_policy or recipe_image_policy(tokenizer_json),
            clamp_max_tokens,
            PromptEncoder(decoder),  # read-only, as the decoder: one parse of the file
            EMBEDDED_TOKENIZER_CONFIG if tokenizer_config is None else tokenizer_config,
            _token_id(decoder, THINK_START_TOKEN),
            _token_id(decoder, THINK_END_TOKEN),
        )

    @property
    def model_name(self) -> str:
        """The name responses report."""
        return self.served_model_names[0]

    def room_for(self, prompt_tokens: int, requested: int | None) -> int | None:
        """With `--clamp-max-tokens` (the default), the output tokens a request that asked for
        `requested` gets when prompt plus request would not fit (the room the prompt leaves);
        None when nothing is to be lowered (the option is off, nothing was asked, or no room is
        left)."""
        room = self.context_limit - prompt_tokens
        if not self.clamp_max_tokens or requested is None or room < 1 or requested <= room:
            return None
        return room

    def encode(
        self, conversation: Conversation, rendered: RenderedPrompt | None = None
    ) -> list[int]:
        """The conversation's prompt token IDs (V4.1), reusing an earlier prompt's where the
        prompt encoder can; `rendered` is the conversation's rendering, if at hand."""
        if self.prompt_encoder is None:
            tokens: list[int] = self.encoding.encode(conversation)
            return tokens
        return self.prompt_encoder.encode(self.encoding, conversation, rendered)


def _token_id(decoder: tokenizers.Tokenizer, token: str) -> int:
    found = decoder.token_to_id(token)
    return -1 if found is None else int(found)


def max_token_bytes(tokenizer_json: str) -> int:
    """The longest byte string any token of the tokenizer decodes to.

    In a byte-level BPE vocabulary every character of a token stands for one byte; otherwise a
    token's UTF-8 length is used. Added (special) tokens count with their UTF-8 spelling.
    """
    spec = orjson.loads(tokenizer_json)
    vocab = spec.get("model", {}).get("vocab") or {}
    byte_level = (spec.get("decoder") or {}).get("type") == "ByteLevel"
    lengths = [len(token) if byte_level else len(token.encode()) for token in vocab]
    lengths.extend(len(added["content"].encode()) for added in spec.get("added_tokens") or ())
    return max(lengths, default=1) or 1


_RANGE_PARAMS = {
    "Invalid temperature value": "temperature",
    "Invalid top_p value": "top_p",
    "Invalid top_logprobs": "top_logprobs",
}
_KIND_OF_STATUS = {404: ErrorKind.MODEL_NOT_FOUND, 413: ErrorKind.REQUEST_TOO_LARGE}
_CONTEXT_LENGTH_MESSAGE = "maximum context length"


def _conversion_error(exc: ConversionError) -> ApiError:
    message, param, code = str(exc), None, None
    with contextlib.suppress(ValueError, TypeError, KeyError, AttributeError):
        error = orjson.loads(exc.body)["error"]
        message = error.get("message") or message
        param = error.get("param")
        code = error.get("code")
    if _CONTEXT_LENGTH_MESSAGE in message:
        return ContextLengthError(message, param=param or "messages")
    if param is None:
        param = next((p for prefix, p in _RANGE_PARAMS.items() if message.startswith(prefix)), None)
    if code == "invalid_request_error":  # the recipe repeats the type as the code
        code = None
    kind = _KIND_OF_STATUS.get(exc.status_code, ErrorKind.BAD_REQUEST)
    return BadRequestError(message, param=param, kind=kind, code=code)


class _RecipeErrors:
    """Translates deepseek-recipe's request exceptions into the server's ApiErrors.

    A class rather than a generator-based context manager: it is entered several times per
    request, and this costs a fifth as much."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: object, exc: BaseException | None, trace: object) -> None:
        if isinstance(exc, ConversionError):
            raise _conversion_error(exc) from exc
        if isinstance(exc, ValueError):
            raise BadRequestError(str(exc)) from exc
        if isinstance(exc, RecursionError):
            raise BadRequestError("the request is nested too deeply") from exc


_RECIPE_ERRORS = _RecipeErrors()


def recipe_errors() -> _RecipeErrors:
    """A context that translates deepseek-recipe's request exceptions into the server's
    ApiErrors."""
    return _RECIPE_ERRORS
