"""RecipeOutput: drives deepseek-recipe's stream processor for one request (every protocol).

The processor parses reasoning, DSML tool calls and stop sequences. In streaming mode each call
returns the protocol's stream payloads (made by the subclass's `_stream_payloads`); otherwise the
chunks are accumulated into the protocol's response object and `response_json()` gives the body.
"""

from __future__ import annotations

from typing import Any, Protocol

from deepseek_recipe import InferenceChunk, InferenceFinishReason, PromptUsage, StreamProcessor

from deepinfer_server.ipc.messages import Finish, GeneratedTokens

_FINISH_REASONS = {
    Finish.STOP: InferenceFinishReason.Stop,
    Finish.LENGTH: InferenceFinishReason.Length,
}


class Accumulator(Protocol):
    """A recipe response object (ChatCompletionResponse, ResponsesResponse, MessagesResponse)."""

    def accumulate(self, chunk: Any) -> None: ...

    def to_json(self) -> str: ...


class RecipeOutput:
    """One request's engine tokens in, protocol chunks out."""

    def __init__(
        self, processor: StreamProcessor, response: Accumulator | None, prompt_tokens: int
    ) -> None:
        self._processor = processor
        self._response = response
        self._prompt_tokens = prompt_tokens
        self._completion_tokens = 0

    @property
    def finished(self) -> bool:
        """True once the parser ended the answer (EOS, stop sequence, end of a forced tool call)."""
        return bool(self._processor.finished)

    def start(self) -> list[str]:
        """The opening payloads (role, created events)."""
        usage = PromptUsage(prompt_tokens=self._prompt_tokens)
        return self._emit(self._processor.push(InferenceChunk.ready(prompt_usage=usage)))

    def push(self, tokens: GeneratedTokens) -> list[str]:
        """Payloads for newly generated tokens (several tokens make one chunk)."""
        token_ids = tokens.token_ids
        if not tokens or self.finished:
            return []
        self._completion_tokens += len(tokens)
        chunks = []
        if token_ids:
            chunk = InferenceChunk.tokens(token_ids, tokens.logprob_pairs())
            chunks = self._processor.push(chunk)
        if tokens.hidden_tokens and not self.finished:
            # Counted in usage, never rendered (an EOS generated under ignore_eos).
            chunks.extend(
                self._processor.push(InferenceChunk.text("", token_count=tokens.hidden_tokens))
            )
        return self._emit(chunks)

    def finish(self, finish: Finish) -> list[str]:
        """The closing payloads once the engine ended the request (STOP or LENGTH)."""
        chunks = []
        if not self.finished:
            chunks = self._processor.push(InferenceChunk.finish(_FINISH_REASONS[finish]))
        chunks.extend(self._processor.finish())
        return self._emit(chunks)

    def close(self) -> None:
        """Release the parser (always call it; it is a no-op after a normal finish)."""
        if not self.finished:
            self._processor.close()

    def response_json(self) -> bytes:
        """The non-streaming response body."""
        assert self._response is not None, "response_json() is for non-streaming requests"
        return self._response.to_json().encode()

    def _emit(self, chunks: list[Any]) -> list[str]:
        if self._response is not None:
            for chunk in chunks:
                self._response.accumulate(chunk)
            return []
        return self._stream_payloads(chunks)

    def _stream_payloads(self, chunks: list[Any]) -> list[str]:
        raise NotImplementedError
