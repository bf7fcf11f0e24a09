"""Server-sent events: OpenAI framing and a lean streaming response.

`SSEResponse` replaces Starlette's StreamingResponse on the hot path: its body writes frames
straight to the ASGI server's `send` (or, with uvicorn's httptools protocol, straight to the
transport: `transport.response_channel`), through `send_now()`, which completes a send at once when
it does not have to wait (the usual case: the transport buffers the bytes), so a frame can be
written from the reader task's pass over an engine step without a task switch per stream. The stream
stops (aborting the engine request) when the client leaves, through `until_disconnect`. A
client that stops reading is disconnected by the connection's write deadline
(`api/connection.py`), which ends the stream the same way. While a stream has nothing to send
(its request queued or prefilling) it sends keep-alives (`api/keepalive.py`), whichever route
streams it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable, Coroutine
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from deepinfer_server.api.disconnect import CLIENT_LEFT, until_disconnect
from deepinfer_server.api.keepalive import KEEPALIVE, KeepAlive, KeptAlive
from deepinfer_server.api.transport import response_channel
from deepinfer_server.errors import ClientDisconnected

DONE_FRAME = b"data: [DONE]\n\n"
_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]

#: Where the app keeps the ASGI server's own `send` in `scope["state"]` (see `keep_server_send`).
SERVER_SEND = "server_send"

#: Starts writing one frame; returns what is left to await when the send has to wait.
FrameWriter = Callable[[bytes], Coroutine[Any, Any, None] | None]
#: Writes a whole response body through the writer it is given.
BodyWriter = Callable[[FrameWriter], Coroutine[Any, Any, None]]


def data_frames(payloads: list[str]) -> bytes:
    """`data: {json}\\n\\n` for each payload, as one write."""
    if len(payloads) == 1:  # the usual case: one chunk per engine step
        return ("data: " + payloads[0] + "\n\n").encode()
    return "".join(["data: " + payload + "\n\n" for payload in payloads]).encode()


def send_now(send: Send, message: Message) -> Coroutine[Any, Any, None] | None:
    """Run `send(message)` as far as it goes without waiting: None once it completed, else a
    coroutine that completes it (await it before the next send)."""
    sending = send(message)
    try:
        waits_for = sending.send(None)  # type: ignore[attr-defined]
    except StopIteration:
        return None
    return _complete_send(sending, waits_for)


async def _complete_send(sending: Any, waits_for: Any) -> None:
    while True:
        try:
            if waits_for is None:  # a bare yield: give the loop one turn
                await asyncio.sleep(0)
            else:
                await waits_for
        except BaseException as exc:  # cancellation included: the send sees it where it waits
            try:
                waits_for = sending.throw(exc)
            except StopIteration:
                return
            continue
        try:
            waits_for = sending.send(None)
        except StopIteration:
            return


async def complete(waiting: Coroutine[Any, Any, None] | None) -> None:
    """Await what a writer left to do, if anything."""
    if waiting is not None:
        await waiting


async def write_all(frames: AsyncGenerator[bytes, None], write: FrameWriter) -> None:
    """A body writer for frames produced by an async generator (closed however it ends)."""
    try:
        async for frame in frames:
            await complete(write(frame))
    finally:
        await frames.aclose()


def keep_server_send(app: ASGIApp, keepalive: KeepAlive | None = None) -> ASGIApp:
    """`app`, keeping the ASGI server's `send` in the scope for `SSEResponse` (and the
    server's `keepalive` policy, None for none).

    A stream's body frames go straight to it, past the middlewares' wrappers of `send`: ours,
    Starlette's error boundaries and CORS act on the response start only and pass body
    messages through unchanged. A middleware that rewrites bodies (compression) must not wrap
    the streaming routes.
    """

    async def with_server_send(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            state = scope.setdefault("state", {})
            state[SERVER_SEND] = send
            state[KEEPALIVE] = keepalive
        await app(scope, receive, send)

    return with_server_send


class SSEResponse:
    """A 200 text/event-stream response whose body `body(write)` writes.

    `abandon` is called when the response ends, whether or not the body ran: it releases what
    the body would have released (a no-op when the body did).
    """

    def __init__(self, body: BodyWriter, abandon: Callable[[], None] | None = None) -> None:
        self._body = body
        self._abandon = abandon

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        body_send: Send = scope.get("state", {}).get(SERVER_SEND, send)
        write_chunk = response_channel(body_send).write_chunk

        def write(frame: bytes) -> Coroutine[Any, Any, None] | None:
            if write_chunk(frame):
                return None
            message = {"type": "http.response.body", "body": frame, "more_body": True}
            return send_now(body_send, message)

        keepalive: KeepAlive | None = scope.get("state", {}).get(KEEPALIVE)
        kept = None
        if keepalive is not None and keepalive.interval > 0:
            kept = KeptAlive(write, keepalive.frame(scope), keepalive.interval)
        try:
            await send({"type": "http.response.start", "status": 200, "headers": _HEADERS})
            await until_disconnect(receive, self._stream(write, send, kept))
        except ClientDisconnected:
            scope.setdefault("state", {})[CLIENT_LEFT] = True
            return
        finally:
            if self._abandon is not None:
                self._abandon()

    async def _stream(self, write: FrameWriter, send: Send, kept: KeptAlive | None) -> None:
        if kept is None:
            await self._body(write)
        else:
            pump = asyncio.create_task(kept.run())
            try:
                await self._body(kept.write)
            finally:
                pump.cancel()
                await asyncio.wait([pump])  # its last send ends before the body's end
        await send({"type": "http.response.body", "body": b"", "more_body": False})
