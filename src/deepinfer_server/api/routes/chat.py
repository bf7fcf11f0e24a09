"""POST /v1/chat/completions (JSON and SSE)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response

from deepinfer_server.api.body import read_body
from deepinfer_server.api.disconnect import ClientDisconnected, until_disconnect
from deepinfer_server.api.errors import sse_error_payload
from deepinfer_server.api.generation import generate
from deepinfer_server.api.sse import DONE_FRAME, SSEResponse, data_frames
from deepinfer_server.api.state import LARGE_BODY_BYTES, AppState
from deepinfer_server.coordinator.handle import RequestHandle
from deepinfer_server.metrics import RequestRecord, ServerMetrics
from deepinfer_server.protocol.chat_output import ChatOutput
from deepinfer_server.protocol.chat_request import decode_json, prepare_chat

logger = logging.getLogger(__name__)

CLIENT_CLOSED_REQUEST = 499


async def chat_completions(request: Request) -> Response:
    state: AppState = request.app.state.server
    config = state.config
    request_id: str = request.state.request_id
    loop = asyncio.get_running_loop()
    record = RequestRecord(arrival=loop.time())
    raw = await read_body(request, config.max_request_bytes, config.body_read_timeout)
    if config.log_requests:
        logger.info("request %s body: %s", request_id, raw[:65536].decode(errors="replace"))
    body = decode_json(raw)
    if len(raw) > LARGE_BODY_BYTES:
        prepared = await asyncio.to_thread(prepare_chat, body, state.recipe)
    else:
        prepared = prepare_chat(body, state.recipe)
    completion_id = f"chatcmpl-{request_id}"
    handle = state.engine.submit(
        state.next_engine_request_id(completion_id),
        prepared.prompt_token_ids,
        prepared.sampling,
        state.deadline(),
    )
    record.prompt_tokens = len(prepared.prompt_token_ids)
    record.admitted_at = loop.time()
    request.state.record = record
    try:
        output = ChatOutput(prepared, completion_id, state.recipe)
    except BaseException:
        handle.close()
        raise
    if prepared.stream:
        return SSEResponse(_stream(handle, output, record, state.metrics, request_id))  # type: ignore[return-value]
    try:
        body_json = await until_disconnect(
            request.receive, _collect(handle, output, record, state.metrics)
        )
    except ClientDisconnected:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    return Response(body_json, media_type="application/json")


async def _collect(
    handle: RequestHandle, output: ChatOutput, record: RequestRecord, metrics: ServerMetrics
) -> bytes:
    async for _ in generate(handle, output, record, metrics):
        pass
    return output.response_json()


async def _stream(
    handle: RequestHandle,
    output: ChatOutput,
    record: RequestRecord,
    metrics: ServerMetrics,
    request_id: str,
) -> AsyncIterator[bytes]:
    try:
        async for payloads in generate(handle, output, record, metrics):
            if payloads:
                yield data_frames(payloads)
    except Exception as exc:
        yield data_frames([sse_error_payload(exc, metrics, request_id)])
    yield DONE_FRAME
