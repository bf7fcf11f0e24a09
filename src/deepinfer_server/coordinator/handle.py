"""RequestHandle: the API-side mailbox of one engine request.

The reader task `deliver()`s token batches without ever blocking; the request's consumer takes
everything that arrived since its last call with `next_batch()`, so several engine steps merge
into one write when the consumer falls behind. In the steady state a consumer may instead
`attach()` a sink, which the reader task calls directly (`flush()`) once it has delivered
everything that arrived together: one pass over a rank's step reaches every stream without
waking a task per stream, and steps that arrived together still make one write.

Closing the handle, for any reason, aborts the engine request if the engine may still run it and
frees the admission slot, exactly once. A request that times out is closed by its own timer at
once, without waiting for its consumer (which may be blocked writing to a client that stopped
reading). One timer serves both timeouts: it fires first at the queue deadline (no first token by
then: 429 queue_timeout), then, re-armed, at the request deadline.

With a stream interval N (`--stream-interval`, vLLM's and SGLang's meaning), output is handed on
at the first token, then once N tokens are waiting, and at the end or on a failure: fewer,
larger chunks for less work per token.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from deepinfer_server.disaggregation.handoff.params import KVTransferParams
from deepinfer_server.errors import (
    ApiError,
    ClientDisconnected,
    QueueTimeoutError,
    RequestTimeoutError,
)
from deepinfer_server.ipc.messages import AbortReason, Finish, GeneratedTokens


@dataclass(frozen=True, slots=True)
class TokenBatch:
    """Tokens that arrived since the last batch, and the engine's finish if it ended.

    `arrived_at` is when the latest of them reached the API process (`time.perf_counter()`) and
    `step_seconds` how long the engine step that produced it took.
    """

    tokens: GeneratedTokens
    finish: Finish | None
    arrived_at: float
    step_seconds: float


#: Called once when a handle closes: (handle, whether the engine request was aborted, why).
CloseCallback = Callable[["RequestHandle", bool, AbortReason], None]

#: Takes the output delivered since the last call, from the reader task: (tokens, finish,
#: arrived_at, step_seconds); returns whether to stay attached. It must not block and should
#: not raise.
TokenSink = Callable[[GeneratedTokens, Finish | None, float, float], bool]


class RequestHandle:
    """One request in flight: queued in the server, then on one rank."""

    def __init__(
        self,
        request_id: str,
        rank: int | None,
        on_close: CloseCallback,
        deadline: float | None,
        stream_interval: int = 1,
        queue_deadline: float | None = None,
    ) -> None:
        """`deadline` and `queue_deadline` are event-loop times: the request's end, and the
        time by which its first token must have arrived."""
        self.request_id = request_id
        #: The DP rank running it; None while it waits in the server's queue.
        self.rank = rank
        self._on_close = on_close
        #: Output delivered and not yet taken (by `next_batch()` or a flush); None when none.
        self._tokens: GeneratedTokens | None = None
        self._stream_interval = stream_interval
        #: Tokens in `_tokens`, and whether the request's first token is among them.
        self._waiting_tokens = 0
        self._first_waiting = False
        self._flush_due = False
        self._arrived_at = 0.0
        self._step_seconds = 0.0
        self.has_first_token = False
        #: Prompt plus generated tokens: what the request holds in the engine's KV cache.
        self.context_tokens = 0
        #: The prompt tokens the engine reused from its prefix cache; None until the engine
        #: has taken the request (its first delta says).
        self.cached_tokens: int | None = None
        #: The prompt tokens the engine will write to its prefix cache (retention asked).
        self.written_tokens = 0
        #: A prefill engine's handoff of this request's KV (prefill role), once it ended.
        self.kv_transfer_params: KVTransferParams | None = None
        self._finish: Finish | None = None
        self._error: ApiError | None = None
        self._event = asyncio.Event()
        self._closed = False
        self._engine_finished = False
        self._timer: asyncio.TimerHandle | None = None
        self._sink: TokenSink | None = None
        self._deadline = deadline
        loop = asyncio.get_running_loop()
        if queue_deadline is not None and (deadline is None or queue_deadline < deadline):
            self._timer = loop.call_at(queue_deadline, self._queue_expired)
        elif deadline is not None:
            self._timer = loop.call_at(deadline, self._expire)

    @property
    def engine_finished(self) -> bool:
        """True once the engine no longer runs this request (ended, refused or aborted)."""
        return self._engine_finished or self._closed

    @property
    def ended(self) -> bool:
        """True once the request has its outcome: a finish or an error."""
        return self._finish is not None or self._error is not None

    def deliver(
        self,
        tokens: GeneratedTokens,
        finish: Finish | None,
        arrived_at: float,
        step_seconds: float,
    ) -> bool:
        """Called by the reader task with one step's output for this request; True (once until
        the flush) when a sink is attached and `flush()` must follow, once everything that
        arrived together is delivered."""
        if self._finish is not None or self._error is not None:  # ended
            return False
        count = len(tokens)
        if count:
            if not self.has_first_token:
                self._first_waiting = True
            self._waiting_tokens += count
            self.has_first_token = True
            self.context_tokens += count
            self._arrived_at = arrived_at
            self._step_seconds = step_seconds
        if finish is not None:
            self._finish = finish
            self._engine_finished = True
        if count or tokens.prompt_logprobs is not None:
            if self._tokens is None:
                self._tokens = tokens
            else:
                self._tokens.extend(tokens)
        if not self._due():
            return False
        if self._sink is not None:
            first = not self._flush_due
            self._flush_due = True
            return first
        self._event.set()
        return False

    def started(self, cached_tokens: int, written_tokens: int = 0) -> None:
        """The engine took the request, reusing `cached_tokens` prompt tokens and writing
        `written_tokens` to its cache: the output's opening (whose usage carries them) is due,
        even without a token."""
        self.cached_tokens = cached_tokens
        self.written_tokens = written_tokens
        self._first_waiting = True

    def flush(self) -> None:
        """Hand what was delivered since the last flush to the attached sink."""
        self._flush_due = False
        sink = self._sink
        if sink is None:  # detached meanwhile (failed, closed): the consumer takes it
            return
        tokens = self._take()
        if not sink(tokens, self._finish, self._arrived_at, self._step_seconds):
            self.detach()

    def attach(self, sink: TokenSink) -> bool:
        """Hand every later step's output to `sink`, from the reader task, instead of keeping
        it for `next_batch()`; until the sink returns False, the request fails or `detach()`.

        Returns False, attaching nothing, when output that is due (or the end) is already
        waiting for `next_batch()`; output held back by the stream interval goes to the sink.
        """
        if self._closed or self.ended or (self._tokens is not None and self._due()):
            return False
        self._event.clear()
        self._sink = sink
        return True

    def detach(self) -> None:
        """Stop calling the sink; wakes `wait_detached()`."""
        if self._sink is not None:
            self._sink = None
            self._event.set()

    async def wait_detached(self) -> None:
        """Return once no sink is attached (it detached itself, the request failed, timed out
        or was closed)."""
        while self._sink is not None:
            await self._event.wait()
            self._event.clear()

    def fail(self, error: ApiError, *, engine_finished: bool = False) -> None:
        """End the request with an error.

        `engine_finished` says the engine no longer runs it (it refused the request, or its rank
        died); otherwise closing the handle aborts it in the engine.
        """
        if self.ended:
            return
        self._error = error
        self._engine_finished = self._engine_finished or engine_finished
        self._sink = None
        self._event.set()

    async def next_batch(self) -> TokenBatch:
        """Wait for new tokens or the end; raises the request's ApiError if it failed."""
        while self._finish is None and not (self._tokens and self._due()):
            if self._error is not None:
                raise self._error
            if self._closed:  # released without an outcome: nobody waits for this any more
                raise ClientDisconnected()
            await self._event.wait()
            self._event.clear()
        return TokenBatch(self._take(), self._finish, self._arrived_at, self._step_seconds)

    def close(self, reason: AbortReason) -> None:
        """Release the request: abort it in the engine if it may still run, free its slot.

        `reason` is recorded when this call aborts a request the engine was still running.
        """
        if self._closed:
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        abort = not self._engine_finished
        self._closed = True
        self.detach()
        self._event.set()
        self._on_close(self, abort, reason)

    def withdraw(self) -> None:
        """Release a request that never reached the engine (starting it failed): frees its
        slot like `close()`, with no abort."""
        self._engine_finished = True
        self.close(AbortReason.ROLLBACK)

    def _due(self) -> bool:
        """Whether the waiting output is handed on now (always, with a stream interval of 1)."""
        return (
            self._stream_interval <= 1
            or self._waiting_tokens >= self._stream_interval
            or self._first_waiting
            or self._finish is not None
            or self._error is not None
            or self._closed
        )

    def _take(self) -> GeneratedTokens:
        tokens = self._tokens if self._tokens is not None else GeneratedTokens()
        self._tokens = None
        self._waiting_tokens = 0
        self._first_waiting = False
        return tokens

    def _queue_expired(self) -> None:
        self._timer = None
        if not self.has_first_token and not self.ended:
            self.fail(
                QueueTimeoutError(
                    "the request got no first token within the server's --queue-timeout: the "
                    "server is overloaded; retry later"
                )
            )
            self.close(AbortReason.TIMEOUT)
        elif self._deadline is not None:
            self._timer = asyncio.get_running_loop().call_at(self._deadline, self._expire)

    def _expire(self) -> None:
        self._timer = None
        self.fail(RequestTimeoutError("the request exceeded the server's --request-timeout"))
        self.close(AbortReason.TIMEOUT)
