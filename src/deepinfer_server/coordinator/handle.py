"""RequestHandle: the API-side mailbox of one engine request.

The reader task `deliver()`s token batches without ever blocking; the request's consumer takes
everything that arrived since its last call with `next_batch()`, so several engine steps merge
into one write when the consumer falls behind. Closing the handle, for any reason, aborts the
engine request if the engine may still run it and frees the admission slot, exactly once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from deepinfer_server.errors import ApiError, RequestTimeoutError


@dataclass(frozen=True, slots=True)
class TokenBatch:
    """Tokens that arrived since the last batch, and the engine's finish reason if it ended.

    `arrived_at` is when the latest of them reached the API process (`time.perf_counter()`) and
    `step_seconds` how long the engine step that produced it took.
    """

    token_ids: list[int]
    finish_reason: str | None
    arrived_at: float
    step_seconds: float


class RequestHandle:
    """One request in flight on one rank."""

    def __init__(
        self,
        request_id: str,
        rank: int,
        on_close: Callable[[RequestHandle, bool], None],
        deadline: float | None,
    ) -> None:
        self.request_id = request_id
        self.rank = rank
        self._on_close = on_close
        self._tokens: list[int] = []
        self._arrived_at = 0.0
        self._step_seconds = 0.0
        self.has_first_token = False
        self._finish_reason: str | None = None
        self._error: ApiError | None = None
        self._event = asyncio.Event()
        self._closed = False
        self._engine_finished = False
        self._timer: asyncio.TimerHandle | None = None
        if deadline is not None:
            self._timer = asyncio.get_running_loop().call_at(deadline, self._expire)

    @property
    def engine_finished(self) -> bool:
        """True once the engine no longer runs this request."""
        return self._engine_finished

    @property
    def ended(self) -> bool:
        """True once the request has its outcome: a finish reason or an error."""
        return self._finish_reason is not None or self._error is not None

    def deliver(
        self, token_ids: list[int], finish_reason: str, arrived_at: float, step_seconds: float
    ) -> None:
        """Called by the reader task with one step's output for this request."""
        if self.ended:
            return
        if token_ids:
            self.has_first_token = True
            self._arrived_at = arrived_at
            self._step_seconds = step_seconds
        self._tokens.extend(token_ids)
        if finish_reason:
            self._finish_reason = finish_reason
            self._engine_finished = True
        self._event.set()

    def fail(self, error: ApiError, *, engine_finished: bool = False) -> None:
        """End the request with an error.

        `engine_finished` says the engine no longer runs it (it refused the request, or its rank
        died); otherwise (timeout, shutdown) closing the handle aborts it in the engine.
        """
        if self.ended:
            return
        self._error = error
        self._engine_finished = engine_finished
        self._event.set()

    async def next_batch(self) -> TokenBatch:
        """Wait for new tokens or the end; raises the request's ApiError if it failed."""
        while not self._tokens and self._finish_reason is None:
            if self._error is not None:
                raise self._error
            await self._event.wait()
            self._event.clear()
        tokens, self._tokens = self._tokens, []
        return TokenBatch(tokens, self._finish_reason, self._arrived_at, self._step_seconds)

    def close(self) -> bool:
        """Release the request: abort it in the engine if it may still run, free its slot.

        Returns True when this call aborted a request the engine was still running.
        """
        if self._closed:
            return False
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
        abort = not self._engine_finished
        self._on_close(self, abort)
        return abort

    def _expire(self) -> None:
        self._timer = None
        self.fail(RequestTimeoutError("the request exceeded the server's --request-timeout"))
