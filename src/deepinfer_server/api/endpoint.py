"""serve_generation: one generation request end to end, the same for every protocol.

Read and decode the body, prepare it with the protocol's recipe glue, admit it to a rank, then
stream named or unnamed SSE events, or collect one JSON body, through `token_stream()`.
Admission, cancellation, timeouts, metrics and failure handling are identical for every
protocol; a `GenerationProtocol` only says how to prepare, how to frame and how errors look.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec
import orjson
from starlette.requests import Request
from starlette.responses import Response

from deepinfer_server.api.body import read_body, require_json_content_type
from deepinfer_server.api.disconnect import until_disconnect
from deepinfer_server.api.error_responses import as_api_error
from deepinfer_server.api.sse import SSEResponse
from deepinfer_server.api.state import AppState
from deepinfer_server.api.token_stream import ProtocolOutput, token_stream
from deepinfer_server.coordinator.handle import RequestHandle
from deepinfer_server.errors import ApiError
from deepinfer_server.grammar import Constraint
from deepinfer_server.ipc.messages import AbortReason, SamplingOptions
from deepinfer_server.metrics import RequestRecord, ServerMetrics
from deepinfer_server.protocol.recipe import RecipeContext
from deepinfer_server.protocol.validation import decode_json

logger = logging.getLogger(__name__)


class Prepared(Protocol):
    """What every protocol's preparation yields."""

    @property
    def prompt_token_ids(self) -> list[int]: ...

    @property
    def sampling(self) -> SamplingOptions: ...

    @property
    def stream(self) -> bool: ...

    @property
    def constraint(self) -> Constraint | None: ...


@dataclass(frozen=True)
class GenerationProtocol:
    """How one client protocol prepares requests, frames its stream and shapes its errors."""

    id_prefix: str
    prepare: Callable[[dict[str, Any], RecipeContext], Any]
    make_output: Callable[[Any, str, RecipeContext], ProtocolOutput]
    frames: Callable[[list[str]], bytes]
    done_frame: bytes
    #: The stream's last message when the request fails after the stream started.
    error_frame: Callable[[ApiError], bytes]


async def serve_generation(request: Request, protocol: GenerationProtocol) -> Response:
    """Handle one generation request end to end (errors raise to the app's handlers)."""
    state: AppState = request.app.state.server
    config = state.config
    request_id: str = request.state.request_id
    record = RequestRecord(arrival=time.perf_counter())
    require_json_content_type(request)
    raw = await read_body(request, config.max_request_bytes, config.body_read_timeout)
    if config.log_requests:
        logger.info("request %s body: %s", request_id, raw[:65536].decode(errors="replace"))
    body = decode_json(raw)
    prepared: Prepared = await state.prepare_body(protocol.prepare, body, len(raw))
    sampling = prepared.sampling
    if prepared.constraint is not None:
        # Compiling can take seconds: never on the event loop.
        structured = await asyncio.to_thread(state.structured.compile, prepared.constraint)
        sampling = msgspec.structs.replace(sampling, structured=structured)
    response_id = f"{protocol.id_prefix}{request_id}"
    handle = state.coordinator.submit(
        state.next_engine_request_id(response_id),
        prepared.prompt_token_ids,
        sampling,
        state.deadline(),
    )
    record.prompt_tokens = len(prepared.prompt_token_ids)
    record.admitted_at = time.perf_counter()
    request.state.record = record
    try:
        output = protocol.make_output(prepared, response_id, state.recipe)
    except BaseException:
        handle.close(AbortReason.STOP)
        raise
    if prepared.stream:
        frames = _stream(protocol, handle, output, record, state.metrics, request_id)
        return SSEResponse(frames)  # type: ignore[return-value]
    body_json = await until_disconnect(
        request.receive, _collect(handle, output, record, state.metrics)
    )
    return Response(body_json, media_type="application/json")


async def _collect(
    handle: RequestHandle, output: ProtocolOutput, record: RequestRecord, metrics: ServerMetrics
) -> bytes:
    async for _ in token_stream(handle, output, record, metrics):
        pass
    return output.response_json()


async def _stream(
    protocol: GenerationProtocol,
    handle: RequestHandle,
    output: ProtocolOutput,
    record: RequestRecord,
    metrics: ServerMetrics,
    request_id: str,
) -> AsyncGenerator[bytes, None]:
    try:
        async for payloads in token_stream(handle, output, record, metrics):
            if payloads:
                yield protocol.frames(payloads)
    except Exception as exc:
        error = as_api_error(exc, request_id)
        metrics.observe_failure(error.status_code)
        record.error_kind = error.kind.value
        logger.warning(
            "request %s: the stream failed after it started: %s (%s)",
            request_id,
            error.message,
            error.kind.value,
        )
        yield protocol.error_frame(error)
    if protocol.done_frame:
        yield protocol.done_frame


def json_frame(event: str | None, body: dict[str, Any]) -> bytes:
    """One SSE message with an optional event name."""
    prefix = b"" if event is None else b"event: " + event.encode() + b"\n"
    return prefix + b"data: " + orjson.dumps(body) + b"\n\n"
