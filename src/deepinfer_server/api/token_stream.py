"""token_stream: the one loop over a request's token batches, shared by every protocol.

Whatever ends it (normal finish, the parser ending the answer early, an error, the client
leaving) it closes the handle, which aborts the engine request if the engine may still run it,
closes the output's parser, and accounts for the request in the metrics exactly once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Protocol

from deepinfer_server.coordinator.handle import RequestHandle
from deepinfer_server.errors import (
    ApiError,
    RequestTimeoutError,
    ServiceFailedError,
    ShuttingDownError,
)
from deepinfer_server.ipc.messages import AbortReason, Finish, GeneratedTokens
from deepinfer_server.metrics import RequestRecord, ServerMetrics


class ProtocolOutput(Protocol):
    """One protocol's view of a request's output (chat chunks, Responses or Messages events)."""

    @property
    def finished(self) -> bool: ...

    def start(self) -> list[str]: ...

    def push(self, tokens: GeneratedTokens) -> list[str]: ...

    def finish(self, finish: Finish) -> list[str]: ...

    def close(self) -> None: ...

    def response_json(self) -> bytes: ...


def _abort_reason(error: BaseException | None) -> AbortReason:
    """Why an engine request still running was cut short (no error: a stop sequence)."""
    if isinstance(error, RequestTimeoutError):
        return AbortReason.TIMEOUT
    if isinstance(error, ShuttingDownError):
        return AbortReason.SHUTDOWN
    if isinstance(error, ServiceFailedError):
        return AbortReason.RANK_FAILURE
    if isinstance(error, asyncio.CancelledError | GeneratorExit):
        return AbortReason.DISCONNECT
    return AbortReason.STOP


async def token_stream(
    handle: RequestHandle, output: ProtocolOutput, record: RequestRecord, metrics: ServerMetrics
) -> AsyncIterator[list[str]]:
    """Yield the output's payloads step by step until the request ends.

    Raises the request's ApiError (timeout, rank failure, engine error); the handle and the
    output are released in every case, including cancellation.
    """
    succeeded = False
    ended_by: BaseException | None = None
    try:
        yield output.start()
        while True:
            batch = await handle.next_batch()
            if not output.finished:
                record.on_tokens(batch.arrived_at, len(batch.tokens), batch.step_seconds)
            payloads = output.push(batch.tokens)
            finish = batch.finish
            if output.finished:
                # The parser ended the answer (EOS or a stop sequence); closing the handle
                # below aborts the engine request if it is still running.
                finish = Finish.STOP
            if finish is not None:
                payloads.extend(output.finish(finish))
                record.finish_reason = (batch.finish or finish).name.lower()
                succeeded = True
                yield payloads
                return
            if payloads:
                yield payloads
    except (ApiError, asyncio.CancelledError, GeneratorExit) as exc:
        ended_by = exc
        if isinstance(exc, ApiError):
            record.error_kind = exc.kind.value
        raise
    finally:
        handle.close(_abort_reason(ended_by))
        output.close()
        metrics.observe_engine_request(record)
        if succeeded:
            metrics.observe_success(record, time.perf_counter())
