"""RecipeOutput: drives deepseek-recipe's stream processor for one request (every protocol).

The processor parses reasoning, DSML tool calls and stop sequences. In streaming mode each call
returns the protocol's stream payloads (made by the subclass's `_stream_payloads`); otherwise the
chunks are accumulated into the protocol's response object and `response_json()` gives the body.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

import orjson
from deepseek_recipe import (
    ConversationRequest,
    InferenceChunk,
    InferenceFinishReason,
    ParsingOptions,
    PromptUsage,
    StreamProcessor,
)

from deepinfer_server.ipc.messages import Finish, GeneratedTokens, Images
from deepinfer_server.protocol.core.json_types import JsonObject
from deepinfer_server.protocol.core.recipe import RecipeContext

#: How many of the last batch's chunks may carry its finish reason (the finish chunk, then
#: usage or closing events).
_FINAL_CHUNKS = 4

_FINISH_REASONS = {
    Finish.STOP: InferenceFinishReason.Stop,
    Finish.LENGTH: InferenceFinishReason.Length,
}


def ends_inside_output(options: ParsingOptions) -> bool:
    """Whether the parser may end the answer before the engine ends the request: at a stop
    sequence, or at the end of the tool calls a required tool choice forces."""
    return bool(options.stop_sequences) or options.starts_in_tool_calls


def push_tokens(
    processor: StreamProcessor, tokens: GeneratedTokens, one_by_one: bool
) -> tuple[list[Any], int]:
    """Push generated token IDs through the parser: (its protocol chunks, the tokens it took).

    Several tokens at once (merged steps, speculative decoding, `--stream-interval`) make one
    push, unless the parser may end inside them (`one_by_one`, from `ends_inside_output`): then
    they are pushed one at a time up to the end, so that the tokens after it are neither
    rendered nor counted in usage, exactly as when each arrives in a step of its own.
    """
    token_ids = tokens.token_ids
    logprobs = None if tokens.logprobs is None else tokens.logprob_pairs()
    if not one_by_one or len(token_ids) == 1:
        return processor.push(InferenceChunk.tokens(token_ids, logprobs)), len(token_ids)
    chunks: list[Any] = []
    for index, token_id in enumerate(token_ids):
        pair = None if logprobs is None else [logprobs[index]]
        chunks.extend(processor.push(InferenceChunk.tokens([token_id], pair)))
        if processor.finished:
            return chunks, index + 1
    return chunks, len(token_ids)


def finish_parser(processor: StreamProcessor, finish: Finish) -> list[Any]:
    """The parser's closing chunks once the engine ended the request (STOP or LENGTH): the
    engine's finish reason, unless the parser already ended the answer, then its last chunks."""
    chunks: list[Any] = []
    if not processor.finished:
        chunks = processor.push(InferenceChunk.finish(_FINISH_REASONS[finish]))
    chunks.extend(processor.finish())
    return chunks


class Accumulator(Protocol):
    """A recipe response object (ChatCompletionResponse, ResponsesResponse, MessagesResponse)."""

    def accumulate(self, chunk: Any) -> None: ...

    def to_json(self) -> str: ...


class PreparedRequest(Protocol):
    """What a prepared request (Chat, Responses, Messages) offers its output."""

    @property
    def request(self) -> ConversationRequest: ...

    @property
    def prompt_token_ids(self) -> list[int]: ...

    @property
    def stream(self) -> bool: ...

    @property
    def images(self) -> Images | None: ...


class RecipeOutput:
    """One request's engine tokens in, protocol chunks out."""

    def __init__(
        self,
        generator: Any,
        response_type: Any,
        response_id: str,
        prepared: PreparedRequest,
        recipe: RecipeContext,
    ) -> None:
        """`generator` is the protocol's recipe chunk generator for this request;
        `response_type` the recipe's response object its chunks accumulate into when the
        request is not streamed."""
        prompt_tokens = Images.prompt_tokens(prepared.prompt_token_ids, prepared.images)
        response: Accumulator | None = None
        if not prepared.stream:
            response = response_type(
                response_id, recipe.model_name, int(time.time()), prompt_tokens, 0
            )
        options = prepared.request.parsing_options
        self._processor = StreamProcessor(generator, options, recipe.tokenizer)
        self._response_type = response_type
        self._response = response
        self._prompt_tokens = prompt_tokens
        self._ends_inside = ends_inside_output(options)
        self._completion_tokens = 0
        self._cached_tokens = self._written_tokens = 0
        # The parser's state, read once per push: it changes only when the parser is pushed.
        self._finished = False
        self._client_finish_reason: str | None = None

    @property
    def finished(self) -> bool:
        """True once the parser ended the answer (EOS, stop sequence, end of a forced tool call)."""
        return self._finished

    @property
    def client_finish_reason(self) -> str | None:
        """How the client was told the answer ended, in its protocol's words (`tool_calls`,
        `end_turn`, `max_output_tokens`, ...), once it ended normally."""
        return self._client_finish_reason

    def _finish_of(self, chunk: JsonObject) -> str | None:
        """The finish reason one chunk tells the client, if it tells one (Chat Completions;
        the named-event protocols override it)."""
        choices = chunk.get("choices") or ()
        reason = choices[0].get("finish_reason") if choices else None
        return reason if isinstance(reason, str) else None

    def start(self, cached_tokens: int = 0, written_tokens: int = 0) -> list[str]:
        """The opening payloads (role, created events); `cached_tokens` is how many prompt
        tokens the engine reused from its prefix cache (each protocol's usage reports them),
        `written_tokens` how many it will write there (Messages and Responses report them)."""
        self._cached_tokens, self._written_tokens = cached_tokens, written_tokens
        usage = PromptUsage(
            prompt_tokens=self._prompt_tokens, prompt_cache_hit_tokens=cached_tokens
        )
        chunks = self._processor.push(InferenceChunk.ready(prompt_usage=usage))
        self._finished = bool(self._processor.finished)
        return self._emit(chunks)

    def push(self, tokens: GeneratedTokens) -> list[str]:
        """Payloads for newly generated tokens (several tokens make one chunk)."""
        processor = self._processor
        token_ids = tokens.token_ids
        hidden = tokens.hidden_tokens
        if self._finished or not (token_ids or hidden):
            return []
        chunks: list[Any] = []
        if token_ids:
            chunks, taken = push_tokens(processor, tokens, self._ends_inside)
            self._completion_tokens += taken
            self._finished = bool(processor.finished)
        if hidden and not self._finished:
            # Counted in usage, never rendered (an EOS generated under ignore_eos).
            self._completion_tokens += hidden
            chunks.extend(processor.push(InferenceChunk.text("", token_count=hidden)))
            self._finished = bool(processor.finished)
        return self._emit(chunks) if chunks else []

    def finish(self, finish: Finish) -> list[str]:
        """The closing payloads once the engine ended the request (STOP or LENGTH)."""
        chunks = finish_parser(self._processor, finish)
        self._finished = bool(self._processor.finished)
        return self._emit(chunks)

    def close(self) -> None:
        """Release the parser (always call it; it is a no-op after a normal finish)."""
        if not self._finished:
            self._processor.close()

    def response_json(self) -> bytes:
        """The non-streaming response body."""
        assert self._response is not None, "response_json() is for non-streaming requests"
        return self._response.to_json().encode()

    def _emit(self, chunks: list[Any]) -> list[str]:
        if self._finished and self._client_finish_reason is None:
            # The end is in the last few chunks of the last batch: read only those.
            for chunk in reversed(chunks[-_FINAL_CHUNKS:]):
                reason = self._finish_of(orjson.loads(chunk.to_json()))
                if reason is not None:
                    self._client_finish_reason = reason
                    break
        if self._response is not None:
            for chunk in chunks:
                self._response.accumulate(chunk)
            return []
        return self._stream_payloads(chunks)

    def _stream_payloads(self, chunks: list[Any]) -> list[str]:
        raise NotImplementedError
