"""The request path shared by every protocol: drive one engine request through an output.

`generate()` is the only loop over a request's token batches. Whatever ends it (normal finish,
the parser ending the answer early, an error, the client leaving) it closes the handle, which
aborts the engine request if the engine may still run it, closes the output's parser, and
accounts for the request in the metrics exactly once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Protocol

from deepinfer_server.coordinator.client import SHUTDOWN_CODE
from deepinfer_server.coordinator.handle import RequestHandle
from deepinfer_server.errors import ApiError, RequestTimeoutError, ServiceUnavailableError
from deepinfer_server.metrics import RequestRecord, ServerMetrics


class ProtocolOutput(Protocol):
    """One protocol's view of a request's output (ChatOutput, and later Responses/Messages)."""

    @property
    def finished(self) -> bool: ...

    def start(self) -> list[str]: ...

    def push(self, token_ids: list[int]) -> list[str]: ...

    def finish(self, engine_reason: str) -> list[str]: ...

    def close(self) -> None: ...

    def response_json(self) -> bytes: ...


def _abort_reason(error: BaseException) -> str | None:
    """Why an engine request was cut short, for request_abort_total (None: not an abort)."""
    if isinstance(error, RequestTimeoutError):
        return "timeout"
    if isinstance(error, ServiceUnavailableError):
        return "shutdown" if error.code == SHUTDOWN_CODE else "rank_failure"
    if isinstance(error, asyncio.CancelledError | GeneratorExit):
        return "disconnect"
    return None


async def generate(
    handle: RequestHandle, output: ProtocolOutput, record: RequestRecord, metrics: ServerMetrics
) -> AsyncIterator[list[str]]:
    """Yield the output's payloads step by step until the request ends.

    Raises the request's ApiError (timeout, rank failure, engine error); the handle and the
    output are released in every case, including cancellation.
    """
    succeeded = False
    abort_reason: str | None = None
    try:
        yield output.start()
        while True:
            batch = await handle.next_batch()
            if not output.finished:
                record.on_tokens(batch.arrived_at, len(batch.token_ids), batch.step_seconds)
            payloads = output.push(batch.token_ids)
            if output.finished:
                # The parser ended the answer (EOS or a stop sequence); closing the handle
                # below aborts the engine request if it is still running.
                payloads.extend(output.finish("stop"))
                record.finish_reason = batch.finish_reason or "stop"
                succeeded = True
                yield payloads
                return
            if batch.finish_reason is not None:
                payloads.extend(output.finish(batch.finish_reason))
                record.finish_reason = batch.finish_reason
                succeeded = True
                yield payloads
                return
            if payloads:
                yield payloads
    except (ApiError, asyncio.CancelledError, GeneratorExit) as exc:
        abort_reason = _abort_reason(exc)
        raise
    finally:
        if handle.close():
            # The engine was still running it: a client that left, a timeout, a shutdown, or
            # (no error at all) the parser ending the answer at a stop sequence.
            metrics.observe_abort(abort_reason or "stop")
        elif abort_reason == "rank_failure":
            metrics.observe_abort(abort_reason)
        output.close()
        metrics.observe_engine_request(record)
        if succeeded:
            metrics.observe_success(record, time.perf_counter())
