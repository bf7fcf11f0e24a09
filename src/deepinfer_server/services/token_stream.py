"""TokenStream: one request's token batches through its protocol output, for every protocol.

Each batch goes through `TokenStream.advance()`, the one step that turns engine output into
payloads and ends the request. Whatever ends it (normal finish, the parser ending the answer
early, an error, the client leaving) `close()` closes the handle, which aborts the engine
request if the engine may still run it, closes the output's parser, and accounts for the
request in the metrics exactly once.

Two ways drive it. `run()` pushes, and is the hot path of a single-choice request: it attaches
the stream to the handle as a sink, so that the reader task advances the parser and starts the
write for each engine step directly, in one pass over the step's output; the request's own task
sleeps until the request ends or a write has to wait for a slow client. `batches()` is pulled
by its caller, for requests whose choices are merged into one response (`fan_out`).
The output's opening goes out with the request's first output from the engine (the delta that
says the engine took it, or its first tokens): its usage carries the prompt tokens the engine
reused from its prefix cache, which only the engine knows. A request that fails before then
still sends its opening before the error.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, Protocol

from deepinfer_server.coordinator.handle import RequestHandle
from deepinfer_server.errors import (
    ApiError,
    RequestTimeoutError,
    ServiceFailedError,
    ShuttingDownError,
)
from deepinfer_server.ipc.messages import AbortReason, Finish, GeneratedTokens
from deepinfer_server.metrics import RequestRecord, ServerMetrics

#: Starts writing payloads now; returns what is left to await when the write has to wait
#: (the client is not reading fast enough), else None.
PayloadWriter = Callable[[list[str]], Coroutine[Any, Any, None] | None]


class ProtocolOutput(Protocol):
    """One protocol's view of a request's output (chat chunks, Responses or Messages events)."""

    @property
    def finished(self) -> bool: ...

    @property
    def client_finish_reason(self) -> str | None: ...

    def start(self, cached_tokens: int = 0, written_tokens: int = 0) -> list[str]: ...

    def push(self, tokens: GeneratedTokens) -> list[str]: ...

    def finish(self, finish: Finish) -> list[str]: ...

    def close(self) -> None: ...

    def response_json(self) -> bytes: ...


def _abort_reason(error: BaseException | None) -> AbortReason:
    """Why an engine request still running was cut short (no error: a stop sequence)."""
    if error is None:
        return AbortReason.STOP
    if isinstance(error, RequestTimeoutError):
        return AbortReason.TIMEOUT
    if isinstance(error, ShuttingDownError):
        return AbortReason.SHUTDOWN
    if isinstance(error, ServiceFailedError):
        return AbortReason.RANK_FAILURE
    if isinstance(error, asyncio.CancelledError | GeneratorExit):
        return AbortReason.DISCONNECT
    return AbortReason.ERROR


def _no_write(payloads: list[str]) -> None:
    return None


class TokenStream:
    """One request's engine output through its protocol output, with its accounting."""

    def __init__(
        self,
        handle: RequestHandle,
        output: ProtocolOutput,
        record: RequestRecord,
        metrics: ServerMetrics,
    ) -> None:
        self._handle = handle
        self._output = output
        self._record = record
        self._metrics = metrics
        #: True once the request ended normally (the last payloads were returned).
        self.done = False
        self._opened = False
        self._closed = False
        self._write: PayloadWriter = _no_write
        self._waiting_write: Coroutine[Any, Any, None] | None = None
        self._sink_error: Exception | None = None

    def opening(self) -> list[str]:
        """The output's opening payloads, once (then []), with the engine's cached tokens."""
        if self._opened:
            return []
        self._opened = True
        return self._output.start(self._handle.cached_tokens or 0, self._handle.written_tokens)

    def advance(
        self, tokens: GeneratedTokens, finish: Finish | None, arrived_at: float, step_seconds: float
    ) -> list[str]:
        """The payloads for one batch; sets `done` (and includes the closing payloads) when the
        engine or the parser ended the request."""
        output = self._output
        record = self._record
        opening = None
        if not self._opened:
            opening = self.opening()
            if not (len(tokens) or tokens.prompt_logprobs is not None or finish is not None):
                return opening  # the engine took the request; the output has nothing yet
        if not output.finished:
            record.on_tokens(arrived_at, len(tokens), step_seconds)
        payloads = output.push(tokens)
        if opening is not None:
            opening.extend(payloads)
            payloads = opening
        if output.finished:
            # The parser ended the answer (EOS or a stop sequence); closing the handle aborts
            # the engine request if it is still running.
            record.finish_reason = (finish or Finish.STOP).name.lower()
            payloads.extend(output.finish(Finish.STOP))
            self.done = True
        elif finish is not None:
            record.finish_reason = finish.name.lower()
            payloads.extend(output.finish(finish))
            self.done = True
        if self.done:
            record.client_finish_reason = output.client_finish_reason
        return payloads

    def abandon(self) -> None:
        """Release the request as a client that left, unless it is already released (for a
        response that may never run its body)."""
        self.close(asyncio.CancelledError())

    def close(self, ended_by: BaseException | None) -> None:
        """Release the handle and the output and account for the request (once)."""
        if self._closed:
            return
        self._closed = True
        if isinstance(ended_by, ApiError):
            self._record.error_kind = ended_by.kind.value
        self._handle.close(_abort_reason(ended_by))
        self._output.close()
        self._metrics.observe_engine_request(self._record)
        if self.done:
            self._metrics.observe_success(self._record, time.perf_counter())

    async def run(self, write: PayloadWriter = _no_write) -> None:
        """Run the request to its end, passing every non-empty list of payloads to `write`.

        Raises the request's ApiError (timeout, rank failure, engine error); the handle and the
        output are released in every case, including cancellation.
        """
        self._write = write
        ended_by: BaseException | None = None
        try:
            if self._handle.cached_tokens is not None:  # the engine has taken it already
                await self._send(self.opening())
            while not self.done:
                if self._handle.attach(self._on_step):
                    await self._handle.wait_detached()
                    waiting, self._waiting_write = self._waiting_write, None
                    if waiting is not None:
                        await waiting
                    if self._sink_error is not None:
                        raise self._sink_error
                    continue
                # Output or the end is already waiting (it came while a write waited).
                batch = await self._handle.next_batch()
                await self._send(
                    self.advance(batch.tokens, batch.finish, batch.arrived_at, batch.step_seconds)
                )
        except Exception as exc:
            ended_by = exc
            await self._send(self.opening())  # the error the caller writes comes after it
            raise
        except BaseException as exc:  # its kind says why the engine request is aborted
            ended_by = exc
            raise
        finally:
            self._handle.detach()
            if self._waiting_write is not None:
                self._waiting_write.close()
            self.close(ended_by)

    async def batches(self) -> AsyncIterator[list[str]]:
        """Yield the output's payloads batch by batch until the request ends (pulled by the
        caller: for choices merged into one response).

        Raises the request's ApiError; the handle and the output are released in every case.
        """
        ended_by: BaseException | None = None
        try:
            while not self.done:
                batch = await self._handle.next_batch()
                payloads = self.advance(
                    batch.tokens, batch.finish, batch.arrived_at, batch.step_seconds
                )
                if payloads or self.done:
                    yield payloads
        except Exception as exc:
            ended_by = exc
            opening = self.opening()
            if opening:
                yield opening  # the error the caller writes comes after it
            raise
        except BaseException as exc:  # its kind says why the engine request is aborted
            ended_by = exc
            raise
        finally:
            self.close(ended_by)

    def _on_step(
        self, tokens: GeneratedTokens, finish: Finish | None, arrived_at: float, step_seconds: float
    ) -> bool:
        """The sink: called by the reader task with one step's output; False detaches it."""
        try:
            payloads = self.advance(tokens, finish, arrived_at, step_seconds)
            if payloads:
                self._waiting_write = self._write(payloads)
        except Exception as exc:  # raised in the request's task, not the reader's
            self._sink_error = exc
            return False
        return not self.done and self._waiting_write is None

    async def _send(self, payloads: list[str]) -> None:
        if payloads:
            waiting = self._write(payloads)
            if waiting is not None:
                await waiting
