"""CompletionOutput: engine tokens in, legacy Completions chunks (or one JSON body) out.

The text goes through deepseek-recipe's stream processor with tool-call and reasoning parsing
off, for its incremental UTF-8-safe decoding, its stop sequences and its per-token strings; its
chat chunks are reshaped into `text_completion` objects. Logprobs use OpenAI's completions
shape (`tokens`, `token_logprobs`, `top_logprobs` as {token: logprob}, `text_offset`). With
`echo`, the prompt comes first; with echo and logprobs, its tokens carry the engine's prompt
logprobs (None for the first token, and only the token itself as its alternative: DeepInfer
reports no alternatives for prompt tokens).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import orjson
from deepseek_recipe import (
    ChatCompletionRequest,
    InferenceChunk,
    ParsingOptions,
    PromptUsage,
    StreamProcessor,
)

from deepinfer_server.ipc.messages import Finish, GeneratedTokens
from deepinfer_server.protocol.completions.request import PreparedCompletion
from deepinfer_server.protocol.core.json_types import JsonObject
from deepinfer_server.protocol.core.recipe import RecipeContext
from deepinfer_server.protocol.core.stream_output import (
    ends_inside_output,
    finish_parser,
    push_tokens,
)


@dataclass
class _Logprobs:
    """OpenAI's completions `logprobs` object, built token by token."""

    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)

    def add(
        self,
        token: str,
        logprob: float | None,
        top: dict[str, float] | None,
        at: int,
        width: int | None = None,
    ) -> int:
        """Append one token at offset `at` of its piece; returns the offset after it.

        `width` is how much of the text the token spans (default: its string's length; a
        special token such as BOS, absent from an echoed prompt, spans nothing).
        """
        self.tokens.append(token)
        self.token_logprobs.append(logprob)
        self.top_logprobs.append(top)
        self.text_offset.append(at)
        return at + (len(token) if width is None else width)

    def as_json(self) -> JsonObject:
        return {
            "tokens": self.tokens,
            "token_logprobs": self.token_logprobs,
            "top_logprobs": self.top_logprobs,
            "text_offset": self.text_offset,
        }


def _processor(
    prepared: PreparedCompletion, options: ParsingOptions, recipe: RecipeContext
) -> StreamProcessor:
    # The chat generator only frames the processor's output; its request is a placeholder.
    placeholder = ChatCompletionRequest(
        {
            "model": recipe.model_name,
            "messages": [{"role": "user", "content": ""}],
            "thinking": {"type": "disabled"},
        }
    ).convert(recipe.options)
    generator = ChatCompletionRequest.chunk_generator(placeholder, "cmpl", recipe.model_name)
    return StreamProcessor(generator, options, recipe.tokenizer)


class CompletionOutput:
    """One completion choice's output (the `ProtocolOutput` of /v1/completions)."""

    def __init__(
        self, prepared: PreparedCompletion, completion_id: str, recipe: RecipeContext
    ) -> None:
        self._prepared = prepared
        self._recipe = recipe
        self._header = {
            "id": completion_id,
            "object": "text_completion",
            "created": int(time.time()),
            "model": recipe.model_name,
        }
        options = ParsingOptions(parse_tool_calls=False, stop_sequences=list(prepared.stop))
        self._processor = _processor(prepared, options, recipe)
        self._ends_inside = ends_inside_output(options)
        self._echo_pending = prepared.echo
        self._offset = 0
        self._text: list[str] = []
        self._logprobs = _Logprobs() if prepared.logprobs is not None else None
        self._finish_reason: str | None = None
        self._completion_tokens = 0
        self._cached_tokens = 0
        self._scored = False  # max_tokens 0: the prompt is echoed, nothing is generated

    @property
    def client_finish_reason(self) -> str | None:
        """The finish_reason the client was sent, once the answer ended normally."""
        return self._finish_reason

    @property
    def finished(self) -> bool:
        """True once the answer is complete (EOS, stop sequence, or an echo-only request)."""
        return self._scored or bool(self._processor.finished)

    def start(self, cached_tokens: int = 0, written_tokens: int = 0) -> list[str]:
        self._cached_tokens = cached_tokens
        usage = PromptUsage(
            prompt_tokens=len(self._prepared.prompt_token_ids),
            prompt_cache_hit_tokens=cached_tokens,
        )
        self._processor.push(InferenceChunk.ready(prompt_usage=usage))
        return []

    def push(self, tokens: GeneratedTokens) -> list[str]:
        if self.finished:
            return []
        pieces = [self._echo(tokens.prompt_logprobs)] if self._echo_pending else []
        if not self._prepared.generate:
            self._scored = True
            return self._emit(pieces)
        # Every generated token up to the end counts, the unrendered EOS of `ignore_eos` included.
        if tokens.token_ids:
            chunks, taken = push_tokens(self._processor, tokens, self._ends_inside)
            self._completion_tokens += taken
            pieces.extend(self._pieces(chunks))
        if not self._processor.finished:
            self._completion_tokens += tokens.hidden_tokens
        return self._emit(pieces)

    def finish(self, finish: Finish) -> list[str]:
        pieces = [self._echo(None)] if self._echo_pending else []
        if self._scored:
            self._finish_reason = "length"
        else:
            pieces.extend(self._pieces(finish_parser(self._processor, finish)))
        pieces.append(("", None))
        payloads = self._emit(pieces, final=True)
        if self._prepared.stream and self._prepared.stream_options.include_usage:
            usage = self._usage(details=True)
            payloads.append(orjson.dumps({**self._header, "choices": [], "usage": usage}).decode())
        return payloads

    def close(self) -> None:
        if not self._processor.finished:
            self._processor.close()

    def response_json(self) -> bytes:
        choice = {
            "index": 0,
            "text": "".join(self._text),
            "logprobs": self._logprobs.as_json() if self._logprobs is not None else None,
            "finish_reason": self._finish_reason,
        }
        body = {**self._header, "choices": [choice], "usage": self._usage(details=True)}
        return orjson.dumps({**body, "system_fingerprint": None})

    # Internals

    def _echo(self, prompt_logprobs: list[float] | None) -> tuple[str, _Logprobs | None]:
        """The prompt as the first piece of the text, with its logprobs when asked."""
        self._echo_pending = False
        prepared = self._prepared
        piece_logprobs = None
        if self._logprobs is not None:
            piece_logprobs = _Logprobs()
            values: list[float | None] = [None, *(prompt_logprobs or [])]
            at = 0
            for index, token_id in enumerate(prepared.prompt_token_ids):
                decoder = self._recipe.decoder
                token = decoder.decode([token_id], skip_special_tokens=False)
                width = len(decoder.decode([token_id], skip_special_tokens=True))
                value = values[index] if index < len(values) else None
                top = None if value is None else {token: value}
                at = piece_logprobs.add(token, value, top, at, width)
        return prepared.prompt_text, piece_logprobs

    def _pieces(self, chunks: list[Any]) -> list[tuple[str, _Logprobs | None]]:
        """(text, logprobs) of each recipe chat chunk; records the finish reason."""
        pieces: list[tuple[str, _Logprobs | None]] = []
        for chunk in chunks:
            choices = orjson.loads(chunk.to_json()).get("choices") or []
            if not choices:
                continue
            choice = choices[0]
            if choice.get("finish_reason"):
                self._finish_reason = choice["finish_reason"]
            text = (choice.get("delta") or {}).get("content") or ""
            entries = (choice.get("logprobs") or {}).get("content") or []
            piece_logprobs = None
            if self._logprobs is not None and entries:
                piece_logprobs = _Logprobs()
                at = 0
                for entry in entries:
                    top = {alt["token"]: alt["logprob"] for alt in entry.get("top_logprobs", ())}
                    at = piece_logprobs.add(entry["token"], entry["logprob"], top, at)
            if text or piece_logprobs is not None:
                pieces.append((text, piece_logprobs))
        return pieces

    def _emit(self, pieces: list[tuple[str, _Logprobs | None]], final: bool = False) -> list[str]:
        """Record the pieces; streamed, one chunk per piece (the last one carries the finish)."""
        payloads: list[str] = []
        for position, (text, piece_logprobs) in enumerate(pieces):
            if piece_logprobs is not None and self._logprobs is not None:
                # Offsets within the piece become offsets within the whole text.
                piece_logprobs.text_offset = [
                    at + self._offset for at in piece_logprobs.text_offset
                ]
                for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                    getattr(self._logprobs, name).extend(getattr(piece_logprobs, name))
            self._offset += len(text)
            self._text.append(text)
            if not self._prepared.stream:
                continue
            last = final and position == len(pieces) - 1
            choice = {
                "index": 0,
                "text": text,
                "logprobs": piece_logprobs.as_json() if piece_logprobs is not None else None,
                "finish_reason": self._finish_reason if last else None,
            }
            chunk: JsonObject = {**self._header, "choices": [choice]}
            if self._prepared.stream_options.continuous_usage_stats:
                chunk["usage"] = self._usage()
            payloads.append(orjson.dumps(chunk).decode())
        return payloads

    def _usage(self, details: bool = False) -> JsonObject:
        """The usage object; the final one (`details`) also says how many prompt tokens came
        from the prefix cache, as vLLM and the chat usage do (`prompt_tokens_details`)."""
        prompt_tokens = len(self._prepared.prompt_token_ids)
        usage: JsonObject = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": self._completion_tokens,
            "total_tokens": prompt_tokens + self._completion_tokens,
        }
        if details:
            usage["prompt_tokens_details"] = {"cached_tokens": self._cached_tokens}
        return usage
