"""POST /v1/chat/completions (JSON and SSE)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from deepinfer_server.api.body import read_body
from deepinfer_server.api.disconnect import ClientDisconnected, until_disconnect
from deepinfer_server.api.errors import sse_error_payload
from deepinfer_server.api.generation import generate
from deepinfer_server.api.sse import DONE_FRAME, data_frames
from deepinfer_server.api.state import LARGE_BODY_BYTES, AppState
from deepinfer_server.coordinator.handle import RequestHandle
from deepinfer_server.protocol.chat_output import ChatOutput
from deepinfer_server.protocol.chat_request import decode_json, prepare_chat

CLIENT_CLOSED_REQUEST = 499


async def chat_completions(request: Request) -> Response:
    state: AppState = request.app.state.server
    raw = await read_body(request)
    body = decode_json(raw)
    if len(raw) > LARGE_BODY_BYTES:
        prepared = await asyncio.to_thread(prepare_chat, body, state.recipe)
    else:
        prepared = prepare_chat(body, state.recipe)
    completion_id = f"chatcmpl-{uuid.uuid4().hex}"
    handle = state.engine.submit(
        completion_id, prepared.prompt_token_ids, prepared.sampling, state.deadline()
    )
    try:
        output = ChatOutput(prepared, completion_id, state.recipe)
    except BaseException:
        handle.close()
        raise
    if prepared.stream:
        return StreamingResponse(
            _stream(handle, output),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    try:
        body_json = await until_disconnect(request.receive, _collect(handle, output))
    except ClientDisconnected:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    return Response(body_json, media_type="application/json")


async def _collect(handle: RequestHandle, output: ChatOutput) -> bytes:
    async for _ in generate(handle, output):
        pass
    return output.response_json()


async def _stream(handle: RequestHandle, output: ChatOutput) -> AsyncIterator[bytes]:
    try:
        async for payloads in generate(handle, output):
            if payloads:
                yield data_frames(payloads)
    except Exception as exc:
        yield data_frames([sse_error_payload(exc)])
    yield DONE_FRAME
